#!/usr/bin/env python
"""SMB put/get bandwidth and fetch-add latency beside ucx_perftest and memcpy (a benchmark, not a test).

For each transport:
  - ucx-tcp: UCX_TLS=tcp, SMB_LOCAL_MAP=0 and distinct fake node names, standing
    in for a server on another node;
  - same-node: the client maps the server's shared memory (UCX's own shared
    memory transports for ucx_perftest);
it measures, for message sizes 4 KiB .. 64 MiB:
  - SMB pool.write (put) and pool.read (get) against one real smb-server
    process, with up to --window requests in flight (as ucx_perftest keeps many);
  - ucx_perftest ucp_put_bw, ucp_get and ucp_am_bw, run as a real server/client
    pair on loopback with the same UCX_TLS;
  - memcpy of the same size;
and the latency of counter.fetch_add (a blocking round trip) beside the
ucp_am_lat round trip and ucp_fadd's pipelined time per operation. Figures are
GB/s (1e9 bytes/s) and microseconds; ratios are SMB/ucx_perftest and
SMB/memcpy (targets: >= 0.9 of ucx_perftest for 1 MiB and more, >= 0.8 of
memcpy on the same-node path).

    PYTHONPATH=src python bench/smb_bandwidth.py [--transports ucx-tcp,same-node]
        [--sizes 4K,64K,1M,16M,64M] [--bytes-per-size 256M] [--markdown]
"""
import argparse
import ctypes
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SRC = Path(__file__).resolve().parent.parent / "src"

TRANSPORTS = {
    "ucx-tcp": {"env": {"UCX_TLS": "tcp", "SMB_LOCAL_MAP": "0"}, "server_host": "smb-node",
                "client_host": "client-node", "perftest_env": {"UCX_TLS": "tcp"}},
    "same-node": {"env": {"SMB_LOCAL_MAP": "1"}, "server_host": None, "client_host": None,
                  "perftest_env": {}},
}
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
PERFTEST_TESTS = ("ucp_put_bw", "ucp_get", "ucp_am_bw")


def parse_size(text):
    text = text.strip().upper().rstrip("B").rstrip("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * scale)


def size_label(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def iterations(size, bytes_per_size, lo=8, hi=20000):
    return max(lo, min(hi, bytes_per_size // size))


# ---------------------------------------------------------------------------
# memcpy
# ---------------------------------------------------------------------------

def memcpy_gbs(size, bytes_per_size, repeat):
    """The best of `repeat` timed loops, as many as SMB gets in a round."""
    src = np.ones(size, np.uint8)
    dst = np.zeros(size, np.uint8)
    n = iterations(size, bytes_per_size)
    ctypes.memmove(dst.ctypes.data, src.ctypes.data, size)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            ctypes.memmove(dst.ctypes.data, src.ctypes.data, size)
        best = min(best, time.perf_counter() - t0)
    return size * n / best / 1e9


# ---------------------------------------------------------------------------
# ucx_perftest as a real server/client pair on loopback
# ---------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def perftest_final(output):
    """(overhead usec average, bandwidth MB/s overall) from the 'Final:' line."""
    for line in output.splitlines():
        if line.strip().startswith("Final:"):
            cols = line.split()
            return float(cols[3]), float(cols[6])
    raise RuntimeError("no 'Final:' line in ucx_perftest output:\n" + output[-2000:])


def run_perftest(test, size, iters, env_extra, extra_args=(), timeout=120):
    """Run one ucx_perftest pair; returns (latency usec, bandwidth GB/s)."""
    env = dict(os.environ)
    env.update(env_extra)
    port = free_port()
    server = subprocess.Popen(["ucx_perftest", "-p", str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        client_argv = ["ucx_perftest", "127.0.0.1", "-p", str(port), "-t", test, "-s", str(size),
                       "-n", str(iters), "-w", str(max(2, iters // 10)), *extra_args]
        deadline = time.monotonic() + 15
        while True:
            time.sleep(0.3)  # the server must be listening before the client connects
            proc = subprocess.run(client_argv, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            if proc.returncode == 0 or time.monotonic() > deadline or server.poll() is not None:
                break
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(client_argv)} failed ({proc.returncode}):\n"
                               f"{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
        latency, mbs = perftest_final(proc.stdout)
        return latency, mbs * (1 << 20) / 1e9  # ucx_perftest's MB is 2^20 bytes
    finally:
        if server.poll() is None:
            server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def perftest_table(transport, sizes, bytes_per_size, repeat, extra_args=()):
    """ucx_perftest figures per size, every run's under "<test> runs" (merge_rounds
    picks the best), or None when ucx_perftest is not installed."""
    if shutil.which("ucx_perftest") is None:
        print("ucx_perftest not found (apt-get install ucx-utils / dnf install ucx): "
              "its columns are left out", file=sys.stderr)
        return None, None
    env = TRANSPORTS[transport]["perftest_env"]
    rows = {}
    for size in sizes:
        iters = iterations(size, bytes_per_size)
        rows[size] = {}
        for test in PERFTEST_TESTS:
            rows[size][test + " runs"] = [run_perftest(test, size, iters, env, extra_args)[1]
                                          for _ in range(repeat)]
    small_ops = {
        # ucp_fadd streams fetch-adds (many in flight): time per operation, not a round trip
        "ucp_fadd_per_op_us": run_perftest("ucp_fadd", 8, 20000, env)[0],
        # ucp_am_lat is a ping-pong and reports half the round trip
        "ucp_am_rtt_us": 2 * run_perftest("ucp_am_lat", 8, 20000, env)[0],
    }
    return rows, small_ops


# ---------------------------------------------------------------------------
# SMB: one real smb-server process, the client in a child process
# ---------------------------------------------------------------------------

def timed_pipeline(post, n, window):
    """Seconds to complete n requests from post(i), keeping up to window in flight."""
    in_flight = []
    t0 = time.perf_counter()
    for i in range(n):
        if len(in_flight) >= window:
            in_flight.pop(0).wait()
        in_flight.append(post(i))
    for req in in_flight:
        req.wait()
    return time.perf_counter() - t0


def smb_child(transport, run_dir, servers, sizes, bytes_per_size, window, repeat):
    """Runs in a child process (its own UCX_TLS); prints one JSON line."""
    from eddis.smb import Client

    results = {"sizes": {}}
    with Client(run_dir, expected_servers=servers, timeout=60) as client:
        want_local = transport == "same-node"
        local = [client.is_local(i) for i in range(client.num_servers)]
        if local != [want_local] * servers:
            raise SystemExit(f"{transport}: expected is_local={want_local} for {servers} "
                             f"servers, got {local}")
        pool = client.pool("bench-bandwidth", max(sizes), dtype="uint8")
        for size in sizes:
            n = iterations(size, bytes_per_size)
            depth = window  # one buffer each way, so no memory cap on the requests in flight
            src = np.ones(size, np.uint8)
            # One destination, as ucx_perftest and the memcpy reference use: rotating over
            # `depth` buffers made the reads cache-cold while the references stayed warm.
            out = np.empty(size, np.uint8)
            pool.write(src)
            pool.read(out)
            puts = [size * n / timed_pipeline(lambda i: pool.write_nb(src), n, depth) / 1e9
                    for _ in range(repeat)]
            gets = [size * n / timed_pipeline(lambda i: pool.read_nb(out), n, depth) / 1e9
                    for _ in range(repeat)]
            if not (out == 1).all():
                raise SystemExit(f"{transport}: read back wrong data at size {size}")
            results["sizes"][size] = {"put runs": puts, "get runs": gets}
        pool.free()
        counter = client.counter("bench-fetch-add")
        for _ in range(200):
            counter.fetch_add(1)
        samples = []
        for _ in range(3000 if want_local else 1000):
            t0 = time.perf_counter()
            counter.fetch_add(1)
            samples.append(time.perf_counter() - t0)
        results["fetch_add_median_us"] = statistics.median(samples) * 1e6
        results["fetch_add_mean_us"] = statistics.fmean(samples) * 1e6
    print(json.dumps(results))


def smb_table(transport, servers_count, sizes, bytes_per_size, window, repeat):
    sys.path.insert(0, str(SRC))
    from eddis.smb.testing import LocalServers

    spec = TRANSPORTS[transport]
    hostnames = ([f"{spec['server_host']}-{i}" for i in range(servers_count)]
                 if spec["server_host"] else None)
    memory = f"{max(sizes) * 2 // (1 << 20) // servers_count + 64}M"
    with LocalServers(servers_count, memory=memory, env=spec["env"], hostnames=hostnames) as servers:
        env = dict(os.environ)
        env.update(spec["env"])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
        if spec["client_host"]:
            env["EDDIS_HOSTNAME"] = spec["client_host"]
        else:
            env.pop("EDDIS_HOSTNAME", None)
        argv = [sys.executable, __file__, "--child", transport, "--run-dir", str(servers.run_dir),
                "--servers", str(servers_count),
                "--sizes", ",".join(map(str, sizes)), "--bytes-per-size", str(bytes_per_size),
                "--window", str(window), "--repeat", str(repeat)]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"SMB client ({transport}) failed:\n"
                               f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    if servers.leftovers:
        print(f"warning: the server left {servers.leftovers} behind", file=sys.stderr)
    result["sizes"] = {int(k): v for k, v in result["sizes"].items()}
    return result


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------

def describe(transport):
    if transport == "ucx-tcp":
        return ("ucx-tcp: UCX_TLS=tcp, SMB_LOCAL_MAP=0, servers on fake nodes smb-node-<i> "
                "(stand in for other nodes)")
    return ("same-node: the client maps the server's shared memory; ucx_perftest on UCX's "
            "default (shared memory) transports")


def merge_rounds(rounds, sizes):
    """One (smb, perf, small_ops) from several rounds: every run's figure kept, the best
    as the headline figure, latencies as the median of the rounds' figures."""
    smb = {"sizes": {}}
    for size in sizes:
        merged = {}
        for op in ("put", "get"):
            runs = [x for s, _, _ in rounds for x in s["sizes"][size][op + " runs"]]
            merged[op], merged[op + " runs"] = max(runs), runs
        smb["sizes"][size] = merged
    for key in ("fetch_add_median_us", "fetch_add_mean_us"):
        smb[key] = statistics.median(s[key] for s, _, _ in rounds)
    if rounds[0][1] is None:
        return smb, None, None
    perf = {}
    for size in sizes:
        perf[size] = {}
        for test in PERFTEST_TESTS:
            runs = [x for _, p, _ in rounds for x in p[size][test + " runs"]]
            perf[size][test], perf[size][test + " runs"] = max(runs), runs
    small_ops = {key: statistics.median(o[key] for _, _, o in rounds) for key in rounds[0][2]}
    return smb, perf, small_ops


def report(transport, smb, perf, small_ops, memcpy, sizes, markdown):
    cols = ["size", "SMB put", "ucp_put_bw", "put ratio", "SMB get", "ucp_get", "get ratio",
            "ucp_am_bw", "memcpy", "put/memcpy", "get/memcpy"]
    nan = {"ucp_put_bw": float("nan"), "ucp_get": float("nan"), "ucp_am_bw": float("nan")}
    perf = perf or {size: nan for size in sizes}
    small_ops = small_ops or {"ucp_am_rtt_us": float("nan"), "ucp_fadd_per_op_us": float("nan")}
    rows = []
    for size in sizes:
        s, p, m = smb["sizes"][size], perf[size], memcpy[size]
        rows.append([size_label(size), f"{s['put']:.2f}", f"{p['ucp_put_bw']:.2f}",
                     f"{s['put'] / p['ucp_put_bw']:.2f}", f"{s['get']:.2f}", f"{p['ucp_get']:.2f}",
                     f"{s['get'] / p['ucp_get']:.2f}", f"{p['ucp_am_bw']:.2f}", f"{m:.2f}",
                     f"{s['put'] / m:.2f}", f"{s['get'] / m:.2f}"])
    print()
    print(("### " if markdown else "") + describe(transport))
    print("bandwidth in GB/s (1e9 bytes/s); ratios: SMB / ucx_perftest and SMB / memcpy")
    if markdown:
        print()
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        print()
    else:
        widths = [max(len(c), *(len(r[i]) for r in rows)) + 2 for i, c in enumerate(cols)]
        print("".join(c.rjust(w) for c, w in zip(cols, widths)))
        for row in rows:
            print("".join(v.rjust(w) for v, w in zip(row, widths)))
    rtt = small_ops["ucp_am_rtt_us"]
    print(f"fetch_add (one blocking round trip): SMB median {smb['fetch_add_median_us']:.1f} us "
          f"(mean {smb['fetch_add_mean_us']:.1f} us); ucx_perftest ucp_am_lat round trip "
          f"{rtt:.1f} us (ratio SMB/ucp_am_lat {smb['fetch_add_median_us'] / rtt:.2f}); "
          f"ucp_fadd pipelined {small_ops['ucp_fadd_per_op_us']:.2f} us per op")
    big = [s for s in sizes if s >= 1 << 20]
    if big:
        put_ok = min(smb["sizes"][s]["put"] / perf[s]["ucp_put_bw"] for s in big)
        get_ok = min(smb["sizes"][s]["get"] / perf[s]["ucp_get"] for s in big)
        line = (f"sizes >= 1 MiB: worst SMB/ucx_perftest put {put_ok:.2f}, get {get_ok:.2f} "
                "(target 0.9)")
        if transport == "same-node":
            put_m = min(smb["sizes"][s]["put"] / memcpy[s] for s in big)
            get_m = min(smb["sizes"][s]["get"] / memcpy[s] for s in big)
            line += f"; worst SMB/memcpy put {put_m:.2f}, get {get_m:.2f} (target 0.8)"
        print(line)
        spread = []
        for label, runs in (("SMB put", lambda s: smb["sizes"][s]["put runs"]),
                            ("ucp_put_bw", lambda s: perf[s].get("ucp_put_bw runs", [])),
                            ("SMB get", lambda s: smb["sizes"][s]["get runs"]),
                            ("ucp_get", lambda s: perf[s].get("ucp_get runs", []))):
            figures = [x for s in big for x in runs(s)]
            if figures:
                spread.append(f"{label} {min(figures):.2f}-{max(figures):.2f}")
        print(f"run-to-run spread, sizes >= 1 MiB, GB/s: {', '.join(spread)}")
        if perf and all(perf[s].get("ucp_put_bw runs") for s in big):
            med = statistics.median
            typical = ", ".join(
                f"{size_label(s)} put {med(smb['sizes'][s]['put runs']) / med(perf[s]['ucp_put_bw runs']):.2f} "
                f"get {med(smb['sizes'][s]['get runs']) / med(perf[s]['ucp_get runs']):.2f}" for s in big)
            print(f"median run against median run, SMB/ucx_perftest: {typical}")
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", default="ucx-tcp,same-node",
                        help="comma-separated: ucx-tcp, same-node")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="message sizes, e.g. 4K,1M,64M")
    parser.add_argument("--bytes-per-size", default="256M",
                        help="bytes moved per measurement (iterations = this / size)")
    parser.add_argument("--window", type=int, default=16, help="SMB requests kept in flight")
    parser.add_argument("--servers", type=int, default=1,
                        help="smb-server processes the pool is spread over (1 compares with "
                             "one ucx_perftest pair; more shows pooled bandwidth)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per figure and round, for SMB and ucx_perftest alike")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds that alternate SMB and ucx_perftest; the best run of all "
                             "rounds is the figure (loopback TCP puts swing 2-10x between runs "
                             "on a small VM), the median run is printed beside it")
    parser.add_argument("--perftest-args", default="",
                        help="extra ucx_perftest client arguments for the bandwidth tests, "
                             "e.g. '-O 16' to cap its outstanding operations like --window")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = sorted(parse_size(s) for s in args.sizes.split(","))
    bytes_per_size = parse_size(args.bytes_per_size)
    if args.child:
        smb_child(args.child, args.run_dir, args.servers, sizes, bytes_per_size, args.window,
                  args.repeat)
        return
    transports = [t.strip() for t in args.transports.split(",")]
    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown:
        parser.error(f"unknown transport(s) {unknown}: use {', '.join(TRANSPORTS)}")
    print(f"SMB bandwidth benchmark: {args.servers} server(s), "
          f"sizes {', '.join(size_label(s) for s in sizes)}, "
          f"{size_label(bytes_per_size)} per figure, window {args.window}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for transport in transports:
        # Rounds alternate SMB, ucx_perftest and memcpy, so a slow spell of the machine hits all.
        rounds = []
        memcpy = {size: 0.0 for size in sizes}
        for _ in range(args.rounds):
            for size in sizes:
                memcpy[size] = max(memcpy[size], memcpy_gbs(size, bytes_per_size, args.repeat))
            smb = smb_table(transport, args.servers, sizes, bytes_per_size, args.window, args.repeat)
            perf, small_ops = perftest_table(transport, sizes, bytes_per_size, args.repeat,
                                             args.perftest_args.split())
            rounds.append((smb, perf, small_ops))
        smb, perf, small_ops = merge_rounds(rounds, sizes)
        report(transport, smb, perf, small_ops, memcpy, sizes, args.markdown)
        print(f"load average after {transport}: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
