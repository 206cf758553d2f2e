#!/usr/bin/env python
"""Server-side reduction throughput by number of reduction threads (a benchmark, not a test).

What the smb-server does when the last contribution of a bucket is in: the
weighted sum of W slots into the destination (`Server._op_reduce` ->
`ServerCore.weighted_sum` -> the kernels, split over SMB_REDUCE_THREADS threads).
One in-process server per thread count, all alive at once; for each W and
bucket size the servers take turns, one operation each, so load from elsewhere
hits every thread count alike. No client, no request round trip: the figure is
the reduction itself. GB/s = W x bucket bytes read per second (1 GB = 1e9 B),
median of the repeats; the speedup is each thread count's GB/s over 1 thread's.

    PYTHONPATH=src python bench/smb_reduce.py [--threads 1,2,4] [--slots 2,4,8]
        [--sizes 1M,4M,16M,64M] [--dtype float32] [--bytes-per-point 1G] [--markdown]

A reduction reads W buffers and writes one: it is bound by memory bandwidth, so
more threads help as far as the cores' share of it grows; on a 2-core machine
expect 2x at the very most.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from eddis.smb import rundir  # noqa: E402
from eddis.smb.server import Server  # noqa: E402
from smb_bandwidth import parse_size, size_label  # noqa: E402  (bench/ is sys.path[0])

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def default_threads():
    cpus = len(os.sched_getaffinity(0))
    counts = [1]
    while counts[-1] * 2 <= min(cpus, 8):
        counts.append(counts[-1] * 2)
    return ",".join(map(str, counts))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default=default_threads(),
                        help="reduction thread counts, first one the baseline (default 1,2,.. up to "
                             "the usable CPUs, at most 8)")
    parser.add_argument("--slots", default="2,4,8", help="contributions W per reduction")
    parser.add_argument("--sizes", default="1M,4M,16M,64M", help="bucket bytes (one slot)")
    parser.add_argument("--dtype", default="float32", choices=sorted(ITEMSIZE))
    parser.add_argument("--bytes-per-point", default="1G",
                        help="input bytes reduced per (W, size, threads), spread over the repeats")
    parser.add_argument("--min-repeats", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    slots = [int(w) for w in args.slots.split(",")]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    budget = parse_size(args.bytes_per_point)
    itemsize = ITEMSIZE[args.dtype]
    memory = (max(slots) + 1) * max(sizes) + (64 << 20)

    run_dir = Path(tempfile.mkdtemp(prefix="eddis-bench-reduce-"))
    rundir.create_run_dir(run_dir)
    servers = {}
    load_before = os.getloadavg()[0]
    rows = []
    try:
        for index, t in enumerate(threads):
            servers[t] = Server(run_dir, index=index, memory=memory, host="127.0.0.1",
                                reduce_threads=t).start()
        for w in slots:
            for size in sizes:
                count = size // itemsize
                regions = {t: s._create(f"r{w}-{size}", w + 1, count, args.dtype, None)
                           for t, s in servers.items()}
                sources = {t: [(r.rid, k, 1.0 / w) for k in range(w)] for t, r in regions.items()}
                repeats = max(args.min_repeats, budget // (w * size))
                times = {t: [] for t in servers}
                used = {}
                for t, s in servers.items():  # first touch of the pages, outside the timing
                    for _ in range(2):
                        s.core.weighted_sum(regions[t].rid, w, 0, count, sources[t])
                for _ in range(repeats):
                    for t, s in servers.items():
                        started = time.perf_counter()
                        used[t] = s.core.weighted_sum(regions[t].rid, w, 0, count, sources[t])
                        times[t].append(time.perf_counter() - started)
                for t, s in servers.items():
                    s._op_region_free(None, None, {"name": regions[t].name})
                gbs = {t: w * size / statistics.median(times[t]) / 1e9 for t in servers}
                rows.append((w, size, gbs, used))
                line = "  ".join(f"{t}t {gbs[t]:6.2f} GB/s (x{gbs[t] / gbs[threads[0]]:.2f}, ran on {used[t]})"
                                 for t in threads)
                print(f"W={w} {size_label(size):>7}: {line}", file=sys.stderr, flush=True)
    finally:
        for s in servers.values():
            s.stop()
    load_after = os.getloadavg()[0]

    base = threads[0]
    head = ["W", "bucket"] + [f"{t} thr GB/s" for t in threads] + [f"{t}/{base}" for t in threads[1:]]
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    else:
        print("  ".join(f"{h:>12}" for h in head))
    for w, size, gbs, used in rows:
        cells = [str(w), size_label(size)] + [f"{gbs[t]:.2f}" for t in threads]
        cells += [f"{gbs[t] / gbs[base]:.2f}" for t in threads[1:]]
        print(("| " + " | ".join(cells) + " |") if args.markdown
              else "  ".join(f"{c:>12}" for c in cells))
    print(f"\n{args.dtype}, {len(os.sched_getaffinity(0))} usable CPUs, load average "
          f"{load_before:.1f} before, {load_after:.1f} after; median of >= {args.min_repeats} "
          f"operations per point")
    return 0


if __name__ == "__main__":
    sys.exit(main())
