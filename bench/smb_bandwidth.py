#!/usr/bin/env python
"""SMB put/get bandwidth and fetch-add latency beside ucx_perftest and memcpy (a benchmark, not a test).

For each transport:
  - socket: SMB's socket transport (proven sockets; the server's request loop moves
    every byte), SMB_LOCAL_MAP=0 and distinct fake node names, standing in for a
    server on another node; ucx_perftest over UCX_TLS=tcp beside it;
  - rdma: SMB_TRANSPORT=rdma, the same fake nodes: one-sided UCX put/get, here over
    UCX's shared memory/CMA (one host, no HCA); ucx_perftest on UCX's defaults;
  - rdma-tcp: rdma over UCX's tcp with the test-only SMB_UCX_ALLOW_TCP=1 (not in
    the default list);
  - same-node: the client maps the server's shared memory (UCX's own shared
    memory transports for ucx_perftest);
it measures, for message sizes 4 KiB .. 64 MiB:
  - SMB pool.write (put) and pool.read (get) against one real smb-server
    process, with up to --window requests in flight (as ucx_perftest keeps many),
    and the server's CPU seconds (user + system, all its threads) per GB moved;
  - ucx_perftest ucp_put_bw, ucp_get and ucp_am_bw, run as a real server/client
    pair on loopback with the same UCX_TLS;
  - memcpy of the same size;
and the latency of counter.fetch_add (a blocking round trip) beside the
ucp_am_lat round trip and ucp_fadd's pipelined time per operation. Figures are
GB/s (1e9 bytes/s) and microseconds; ratios are SMB/ucx_perftest and
SMB/memcpy (targets: >= 0.9 of ucx_perftest for 1 MiB and more, >= 0.8 of
memcpy on the same-node path). With socket and rdma both measured, a table puts
them side by side against issue 43's targets (rdma >= 0.8 of memcpy and >= 1.5x
socket for 1 MiB and more, the server's CPU per GB <= 0.1 of socket's).

    PYTHONPATH=src python bench/smb_bandwidth.py [--transports socket,rdma,same-node]
        [--sizes 4K,64K,1M,16M,64M] [--bytes-per-size 256M] [--markdown]

Two nodes (--pair, one task per node of a Slurm allocation, a run directory both
see): the first task serves, the second measures socket and rdma and runs
ucx_perftest (and ib_write_bw / ib_read_bw where perftest is installed) against the
first, for the same sizes; see docs/smb-programming.md, "Verifying on your
InfiniBand cluster":

    srun -N2 -n2 --ntasks-per-node=1 python bench/smb_bandwidth.py --pair
        [--transports socket,rdma] [--sizes 64K,1M,16M,64M] [--run-dir DIR]

Cluster mode (--cluster, as root, under flock /tmp/eddis-bench.lock): SMB pooling on
many hosts. A private netns cluster of scripts/eddis-dev-cluster (--cluster-dir, own
ports) of 5 nodes: n1, the client's node, with an unlimited link, and n2..n5, each an
smb-server's node, with links limited to --link (EDDIS_DEV_CLUSTER_LINK=1gbit,n1=unlimited).
For each server count N of --server-counts (1, 2, 4) one Slurm job starts one
smb-server on each of n2..n(N+1) (srun steps) and ONE client process on n1, which
stripes one pool over the N servers (none of them on its host, so nothing is mapped)
and times --cluster-size transfers (pool.write: put, pool.read: get), --cluster-repeat
of each, interleaved. It prints the aggregate GB/s (best and median), the ratio to one
server, the target 0.85 x N, the link ceiling, how busy the machine's CPUs were and the
bytes that crossed each node's link (devcluster.traffic() around every transfer).

    sudo flock /tmp/eddis-bench.lock .venv/bin/python bench/smb_bandwidth.py --cluster
        [--link 1gbit] [--server-counts 1,2,4] [--cluster-size 64M] [--cluster-repeat 8]
        [--keep-cluster] [--json out.json] [--markdown]
"""
import argparse
import ctypes
import json
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SRC = Path(__file__).resolve().parent.parent / "src"

TRANSPORTS = {
    "socket": {"env": {"SMB_TRANSPORT": "socket", "SMB_LOCAL_MAP": "0"}, "server_host": "smb-node",
               "client_host": "client-node", "perftest_env": {"UCX_TLS": "tcp"}},
    "rdma": {"env": {"SMB_TRANSPORT": "rdma", "SMB_LOCAL_MAP": "0"}, "server_host": "smb-node",
             "client_host": "client-node", "perftest_env": {}},
    "rdma-tcp": {"env": {"SMB_TRANSPORT": "rdma", "SMB_UCX_ALLOW_TCP": "1", "UCX_TLS": "tcp", "SMB_LOCAL_MAP": "0"},
                 "server_host": "smb-node", "client_host": "client-node", "perftest_env": {"UCX_TLS": "tcp"}},
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

HUGE_PAGE = 2 << 20


def host_buffer(size, fill, huge=False):
    """``size`` bytes set to ``fill``; ``huge``: on transparent huge pages (a 2 MiB-aligned
    anonymous mapping with MADV_HUGEPAGE), as the servers' arena is with --hugepages, so
    that SMB and the memcpy reference copy between the same kind of pages."""
    if not huge:
        return np.full(size, fill, np.uint8)
    mapping = mmap.mmap(-1, size + 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(mapping, np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE
    buffer = whole[start:start + size]
    buffer[:] = fill
    return buffer


def memcpy_gbs(size, bytes_per_size, repeat, huge=False):
    """The best of `repeat` timed loops, as many as SMB gets in a round."""
    src = host_buffer(size, 1, huge)
    dst = host_buffer(size, 0, huge)
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


def server_cpu(client):
    """CPU seconds the client's servers have used so far (all their threads)."""
    return sum(client.stats(s)["cpu_seconds"] for s in range(client.num_servers))


def measure(client, transport, sizes, bytes_per_size, window, repeat, many_samples, huge=False):
    """SMB put/get GB/s per size (each run with the servers' CPU seconds per GB moved) and
    the fetch_add latency, with ``client``."""
    want = "rdma" if transport.startswith("rdma") else "socket"
    if transport != "same-node" and client.transport != want:
        raise SystemExit(f"{transport}: the client runs on {client.transport} ({client.transport_reason})")
    results = {"sizes": {}, "transport": client.transport, "ucx_tls": client.ucx_tls}
    pool = client.pool("bench-bandwidth", max(sizes), dtype="uint8")

    def timed(post, n):
        cpu = server_cpu(client)
        seconds = timed_pipeline(post, n, window)  # one buffer each way: no memory cap on the window
        moved = size * n / 1e9
        return moved / seconds, (server_cpu(client) - cpu) / moved

    for size in sizes:
        n = iterations(size, bytes_per_size)
        src = host_buffer(size, 1, huge)
        # One destination, as ucx_perftest and the memcpy reference use: rotating over
        # `window` buffers made the reads cache-cold while the references stayed warm.
        out = host_buffer(size, 0, huge)
        pool.write(src)
        pool.read(out)
        puts = [timed(lambda i: pool.write_nb(src), n) for _ in range(repeat)]
        gets = [timed(lambda i: pool.read_nb(out), n) for _ in range(repeat)]
        if not (out == 1).all():
            raise SystemExit(f"{transport}: read back wrong data at size {size}")
        results["sizes"][size] = {"put runs": [g for g, _ in puts], "get runs": [g for g, _ in gets],
                                  "put cpu runs": [c for _, c in puts], "get cpu runs": [c for _, c in gets]}
    pool.free()
    counter = client.counter("bench-fetch-add")
    for _ in range(200):
        counter.fetch_add(1)
    samples = []
    for _ in range(3000 if many_samples else 1000):
        t0 = time.perf_counter()
        counter.fetch_add(1)
        samples.append(time.perf_counter() - t0)
    results["fetch_add_median_us"] = statistics.median(samples) * 1e6
    results["fetch_add_mean_us"] = statistics.fmean(samples) * 1e6
    return results


def smb_child(transport, run_dir, servers, sizes, bytes_per_size, window, repeat, hugepages="off"):
    """Runs in a child process (its own UCX_TLS); prints one JSON line."""
    from eddis.smb import Client

    with Client(run_dir, expected_servers=servers, timeout=60) as client:
        want_local = transport == "same-node"
        local = [client.is_local(i) for i in range(client.num_servers)]
        if local != [want_local] * servers:
            raise SystemExit(f"{transport}: expected is_local={want_local} for {servers} "
                             f"servers, got {local}")
        results = measure(client, transport, sizes, bytes_per_size, window, repeat, want_local,
                          huge=hugepages != "off")
    print(json.dumps(results))


def smb_table(transport, servers_count, sizes, bytes_per_size, window, repeat, hugepages="off"):
    sys.path.insert(0, str(SRC))
    from eddis.smb.testing import LocalServers

    spec = TRANSPORTS[transport]
    hostnames = ([f"{spec['server_host']}-{i}" for i in range(servers_count)]
                 if spec["server_host"] else None)
    memory = f"{max(sizes) * 2 // (1 << 20) // servers_count + 64}M"
    server_env = dict(spec["env"], SMB_HUGEPAGES=hugepages)
    with LocalServers(servers_count, memory=memory, env=server_env, hostnames=hostnames) as servers:
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
                "--window", str(window), "--repeat", str(repeat), "--hugepages", hugepages]
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
# cluster mode: one client on n1 striping one pool over smb-servers on other hosts
# ---------------------------------------------------------------------------

REPO = SRC.parent
DEV_CLUSTER = REPO / "scripts" / "eddis-dev-cluster"
CLUSTER_UP_TIMEOUT_S = 300
CLUSTER_JOB_TIMEOUT_S = 900
SERVER_WAIT_S = 120
# TCP payload per byte on the wire at MTU 1500 (1448-byte segments in 1514-byte frames):
# what a shaped link of rate R carries at most, R / 8 * this, in bytes/s.
PAYLOAD_PER_WIRE_BYTE = 1448 / 1514
LINK_BITS = {"100mbit": 100e6, "1gbit": 1e9, "10gbit": 10e9, "unlimited": None}
CPU_BOUND = 0.85  # the machine's cores this busy below the links' ceiling: the CPUs cap the figure


def cpu_times():
    """(busy, total) jiffies of all CPUs of the machine (every node shares them)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return total - idle, total


def cluster_client(args):
    """Runs on n1 inside the Slurm job; prints one RESULT line of JSON."""
    from eddis.slurm import devcluster
    from eddis.smb import Client

    size = parse_size(args.cluster_size)
    expected_nodes = args.server_nodes.split(",")
    result = {"servers": args.servers, "size": size, "client_node": os.environ.get("SLURMD_NODENAME"),
              "client_host": socket.gethostname(), "runs": []}
    with Client(args.run_dir, expected_servers=args.servers, timeout=120) as client:
        hosts = [client.servers[i]["hostname"] for i in range(client.num_servers)]
        if sorted(hosts) != sorted(expected_nodes) or result["client_node"] in hosts:
            raise SystemExit(f"servers on {hosts}, expected {expected_nodes}, the client on "
                             f"{result['client_node']}")
        mapped = [i for i in range(client.num_servers) if client.is_local(i)]
        if mapped:
            raise SystemExit(f"the client mapped servers {mapped}: they are on other hosts")
        result["server_nodes"] = hosts
        pool = client.pool("bench-cluster-stripe", size, dtype="uint8",
                           servers=list(range(client.num_servers)))
        result["stripes"] = {hosts[seg.server]: seg.stop - seg.start for seg in pool.segments}
        src = np.full(size, 7, np.uint8)
        out = np.zeros(size, np.uint8)
        pool.write(src)  # warm: registration, connections, the servers' pages
        pool.read(out)
        for rep in range(args.cluster_repeat):
            for op in ("put", "get"):
                if op == "get":
                    out[:] = 0
                net0, cpu0 = devcluster.traffic(args.cluster_dir), cpu_times()
                t0 = time.perf_counter()
                if op == "put":
                    pool.write(src)
                else:
                    pool.read(out)
                seconds = time.perf_counter() - t0
                cpu1, net1 = cpu_times(), devcluster.traffic(args.cluster_dir)
                if op == "get" and not (out == 7).all():
                    raise SystemExit(f"get {rep}: read back wrong data")
                result["runs"].append({
                    "op": op, "rep": rep, "seconds": seconds, "gbs": size / seconds / 1e9,
                    "cpu_busy": (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]),
                    "bytes": devcluster.difference(net0, net1)})
        pool.free()
    print("RESULT " + json.dumps(result), flush=True)


def cluster_env(args, link, nodes):
    env = dict(os.environ)
    for key in [k for k in env if k.startswith(("SLURM_JOB", "SLURM_STEP", "SLURM_PROCID", "EDDIS_RUN_DIR",
                                                "EDDIS_HOSTNAME", "UCX_TLS", "SMB_LOCAL_MAP"))]:
        del env[key]
    env.update({"EDDIS_DEV_CLUSTER_DIR": args.cluster_dir, "EDDIS_DEV_CLUSTER_NET": "netns",
                "EDDIS_DEV_CLUSTER_LINK": link, "EDDIS_DEV_CLUSTER_NODES": str(nodes),
                "EDDIS_DEV_CLUSTER_PORT": str(args.cluster_port),
                "SLURM_CONF": str(Path(args.cluster_dir) / "slurm.conf"),
                "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
                "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p),
                "OMP_NUM_THREADS": "1"})
    return env


def cluster_job_script(args, servers, work):
    """The Slurm job of one server count: smb-servers on n2..n(servers+1), the client on n1."""
    nodes = ["n1"] + [f"n{i + 2}" for i in range(servers)]
    run_dir = work / "run"
    memory = f"{parse_size(args.cluster_size) // servers // (1 << 20) + 64}M"
    client = [sys.executable, str(Path(__file__).resolve()), "--cluster-client", "--run-dir", str(run_dir),
              "--servers", str(servers), "--server-nodes", ",".join(nodes[1:]),
              "--cluster-size", args.cluster_size, "--cluster-repeat", str(args.cluster_repeat),
              "--cluster-dir", args.cluster_dir]
    return f"""#!/bin/bash
#SBATCH --job-name=smbbw-{servers}
#SBATCH --nodes={len(nodes)}
#SBATCH --nodelist={','.join(nodes)}
#SBATCH --ntasks-per-node=1
#SBATCH --time=00:20:00
#SBATCH --output={work / 'job.out'}
# Written by bench/smb_bandwidth.py --cluster: one smb-server on each server node, one
# client on n1 (the job script of eddis.slurm.script would put a server on n1 too).
set -uo pipefail
export EDDIS_RUN_DIR={run_dir}
eddis-train --create-run-dir "$EDDIS_RUN_DIR" >/dev/null || exit 1
pids=()
for ((i = 0; i < {servers}; i++)); do
    srun --job-name=smb-server --overlap -w n$((i + 2)) -N1 -n1 --gres=none --kill-on-bad-exit=1 \\
        smb-server --run-dir "$EDDIS_RUN_DIR" --index $i --memory {memory} --hugepages off &
    pids+=($!)
done
# SIGTERM through Slurm (srun answers a SIGTERM of its own with SIGKILL, which would leave
# the servers' shared memory behind), then a bounded wait, then whatever is left: KILL.
stop_servers() {{
    local steps deadline=$((SECONDS + 30)) pid
    steps=$(squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' 2>/dev/null | awk '$2 == "smb-server" {{print $1}}')
    [ -z "$steps" ] || scancel --signal=TERM $steps 2>/dev/null
    for pid in "${{pids[@]}}"; do
        while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
    done
    [ -z "$steps" ] || scancel $steps 2>/dev/null
    kill -9 "${{pids[@]}}" 2>/dev/null
    wait "${{pids[@]}}" 2>/dev/null
}}
watch=()
for pid in "${{pids[@]}}"; do watch+=(--watch-pid "$pid"); done
if ! eddis-train --wait-servers {servers} --timeout {SERVER_WAIT_S} "${{watch[@]}}"; then
    echo "smb_bandwidth: the smb-servers did not all publish within {SERVER_WAIT_S} s" >&2
    stop_servers
    exit 1
fi
timeout {CLUSTER_JOB_TIMEOUT_S - 120} srun --job-name=smb-client --overlap -w n1 -N1 -n1 --gres=none \\
    {' '.join(client)}
rc=$?
stop_servers
exit $rc
"""


def run_cluster_job(args, env, servers):
    work = Path(tempfile.mkdtemp(prefix=f"eddis-smbbw-{servers}-", dir="/tmp"))
    os.chmod(work, 0o755)
    script = work / "job.sh"
    script.write_text(cluster_job_script(args, servers, work))
    submit = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True,
                            timeout=60)
    if submit.returncode != 0:
        raise RuntimeError(f"sbatch failed: {submit.stderr}")
    job = submit.stdout.strip().split(";")[0]
    deadline = time.monotonic() + CLUSTER_JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True,
                               text=True, timeout=30).stdout.strip()
        if not state:
            break
        time.sleep(0.5)
    else:
        subprocess.run(["scancel", job], env=env, timeout=30)
        print(f"job {job} ran past {CLUSTER_JOB_TIMEOUT_S} s and was cancelled", file=sys.stderr)
    output = (work / "job.out").read_text() if (work / "job.out").exists() else ""
    found = [line for line in output.splitlines() if line.startswith("RESULT ")]
    if not found:
        raise RuntimeError(f"job {job} ({servers} servers) gave no result; its script and output are in "
                           f"{work}; the end of its output:\n" + "\n".join(output.splitlines()[-30:]))
    result = json.loads(found[-1][len("RESULT "):])
    result["job"] = job
    if args.keep_cluster:
        print(f"job {job}: script and output kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return result


def summarize(result, link):
    """Best and median GB/s per op, CPU busy fraction, bytes per node per op (summed over runs)."""
    med = statistics.median
    out = {"servers": result["servers"], "server_nodes": result["server_nodes"], "job": result["job"],
           "stripes": result["stripes"]}
    for op in ("put", "get"):
        runs = [r for r in result["runs"] if r["op"] == op]
        out[op] = {"best": max(r["gbs"] for r in runs), "median": med(r["gbs"] for r in runs),
                   "runs": [r["gbs"] for r in runs], "cpu_busy": med(r["cpu_busy"] for r in runs)}
        moved = {}
        for r in runs:
            for node, d in r["bytes"].items():
                m = moved.setdefault(node, {"tx": 0, "rx": 0})
                m["tx"] += d["tx"]
                m["rx"] += d["rx"]
        out[op]["bytes"] = moved
        out[op]["payload"] = result["size"] * len(runs)
    bits = LINK_BITS[link]
    out["ceiling_gbs"] = None if bits is None else result["servers"] * bits / 8 * PAYLOAD_PER_WIRE_BYTE / 1e9
    return out


def limit_of(row, op, one):
    """What held this figure back: the links (>= 0.9 of their ceiling), the CPUs (busy), or
    '-' where it reached 0.85 x N of one server's figure."""
    fig = row[op]
    if row["ceiling_gbs"] and fig["best"] >= 0.9 * row["ceiling_gbs"]:
        return "links"
    if fig["cpu_busy"] >= CPU_BOUND:
        return f"CPUs ({100 * fig['cpu_busy']:.0f}% busy)"
    return "-" if one and fig["best"] >= 0.85 * row["servers"] * one[op]["best"] else "?"


def cluster_report(rows, link, markdown):
    one = next((r for r in rows if r["servers"] == 1), None)
    cols = ["servers", "server nodes", "put GB/s best (median)", "get GB/s best (median)",
            "put x 1 server", "get x 1 server", "target 0.85 x N", "link ceiling GB/s", "CPUs busy put/get",
            "limit put/get"]
    table = []
    for r in rows:
        n = r["servers"]
        cells = [str(n), ",".join(r["server_nodes"])]
        for op in ("put", "get"):
            cells.append(f"{r[op]['best']:.3f} ({r[op]['median']:.3f})")
        for op in ("put", "get"):
            cells.append(f"{r[op]['best'] / one[op]['best']:.2f} ({r[op]['median'] / one[op]['median']:.2f})"
                         if one else "-")
        cells.append(f"{0.85 * n:.2f}")
        cells.append("-" if r["ceiling_gbs"] is None else f"{r['ceiling_gbs']:.3f}")
        cells.append(f"{100 * r['put']['cpu_busy']:.0f}% / {100 * r['get']['cpu_busy']:.0f}%")
        cells.append(f"{limit_of(r, 'put', one)} / {limit_of(r, 'get', one)}")
        table.append(cells)
    print()
    print(("### " if markdown else "") + f"SMB pooling on many hosts: one client on n1 (unlimited link), "
          f"smb-servers on n2.. ({link} links)")
    print("aggregate GB/s (1e9 bytes/s) of one pool striped over N servers; ratios: best to best "
          "(median to median); CPUs busy: all of the machine's cores during the transfers (median)")
    print_table(cols, table, markdown)
    print()
    print("bytes that crossed each node's link during the timed transfers (MB, headers included):")
    for r in rows:
        for op, direction in (("put", "rx"), ("get", "tx")):
            moved = r[op]["bytes"]
            client_dir = "tx" if direction == "rx" else "rx"
            word = {"rx": "in", "tx": "out"}
            per_server = ", ".join(f"{node} {word[direction]} {moved[node][direction] / 1e6:.1f}"
                                   for node in r["server_nodes"])
            idle = [node for node in sorted(moved) if node != "n1" and node not in r["server_nodes"]]
            others = sum(moved[node]["tx"] + moved[node]["rx"] for node in idle)
            print(f"  {r['servers']} server(s) {op}: payload {r[op]['payload'] / 1e6:.1f}; n1 "
                  f"{word[client_dir]} {moved['n1'][client_dir] / 1e6:.1f}; {per_server}"
                  f"{f'; the idle nodes {others / 1e6:.2f}' if idle else ''}")
            for node in r["server_nodes"]:
                share = r["stripes"][node] * len(r[op]["runs"])
                if moved[node][direction] < share:
                    print(f"    WARNING: {node} moved {moved[node][direction]} bytes, less than its stripes "
                          f"({share}): part of the traffic did not cross its link")
    cpu_bound = sorted({r["servers"] for r in rows for op in ("put", "get")
                        if limit_of(r, op, one).startswith("CPUs")})
    if cpu_bound:
        print(f"note: with {', '.join(map(str, cpu_bound))} server(s) the machine's {os.cpu_count()} CPUs "
              f"were >= {100 * CPU_BOUND:.0f}% busy below the links' ceiling: there the CPUs, not the links, "
              "cap the aggregate (every node, the client's included, runs on the same cores)")
    sys.stdout.flush()


def cluster_main(args):
    counts = sorted({int(c) for c in args.server_counts.split(",")})
    if not counts or counts[0] < 1 or counts[-1] > 7:
        sys.exit("smb_bandwidth.py: --server-counts takes counts from 1 to 7 (the client's node n1 is "
                 "the 8th)")
    if args.link not in LINK_BITS:
        sys.exit(f"smb_bandwidth.py: --link {args.link!r} is not one of {', '.join(LINK_BITS)}")
    if os.geteuid() != 0:
        sys.exit("smb_bandwidth.py --cluster needs root (scripts/eddis-dev-cluster builds namespaces and links)")
    nodes = max(2, counts[-1] + 1)
    link = f"{args.link},n1=unlimited"
    env = cluster_env(args, link, nodes)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"SMB pooling on many hosts, {started}: {nodes}-node netns cluster at {args.cluster_dir} "
          f"(EDDIS_DEV_CLUSTER_LINK={link}), server counts {counts}, "
          f"{size_label(parse_size(args.cluster_size))} x {args.cluster_repeat} per op, "
          f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    rows = []
    try:
        up = subprocess.run([str(DEV_CLUSTER), "up"], env=env, capture_output=True, text=True,
                            timeout=CLUSTER_UP_TIMEOUT_S)
        if up.returncode != 0:
            sys.exit(f"smb_bandwidth.py: the cluster did not come up:\n{up.stdout}\n{up.stderr}")
        print("\n".join(line for line in up.stdout.splitlines() if line.startswith("  ")), flush=True)
        for n in counts:
            result = run_cluster_job(args, env, n)
            row = summarize(result, args.link)
            rows.append(row)
            print(f"-- {n} server(s) on {','.join(row['server_nodes'])} (job {row['job']}): put "
                  f"{', '.join(f'{x:.3f}' for x in row['put']['runs'])} GB/s; get "
                  f"{', '.join(f'{x:.3f}' for x in row['get']['runs'])} GB/s", flush=True)
    finally:
        if not args.keep_cluster:
            down = subprocess.run([str(DEV_CLUSTER), "down"], env=env, capture_output=True, text=True,
                                  timeout=CLUSTER_UP_TIMEOUT_S)
            print(down.stdout.strip() or down.stderr.strip(), flush=True)
        else:
            print(f"the cluster stays up: SLURM_CONF={env['SLURM_CONF']}; take it down with "
                  f"EDDIS_DEV_CLUSTER_DIR={args.cluster_dir} {DEV_CLUSTER} down")
    if rows:
        cluster_report(rows, args.link, args.markdown)
    print(f"finished {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps({"started": started, "link": link, "nodes": nodes,
                                               "size": parse_size(args.cluster_size), "rows": rows}, indent=1))



# ---------------------------------------------------------------------------
# two nodes (--pair): task 0 serves, task 1 measures; a real cluster's fabric
# ---------------------------------------------------------------------------

PAIR_WAIT_S = 300
PAIR_PORT = 18515


def pair_plan(sizes, bytes_per_size):
    """The reference runs both tasks go through in the same order: (tool, test, size, iterations)."""
    plan = []
    for size in sizes:
        iters = iterations(size, bytes_per_size)
        plan += [("ucx_perftest", test, size, iters) for test in ("ucp_put_bw", "ucp_get")]
        plan += [(tool, tool, size, iters) for tool in ("ib_write_bw", "ib_read_bw")]
    return plan


def reference_argv(tool, test, size, iters, host, args):
    """The server's argv (host None) or the client's, of one reference run."""
    if tool == "ucx_perftest":
        if host is None:
            return ["ucx_perftest", "-p", str(PAIR_PORT)]
        return ["ucx_perftest", host, "-p", str(PAIR_PORT), "-t", test, "-s", str(size), "-n", str(iters),
                "-w", str(max(2, iters // 10)), *args.perftest_args.split()]
    argv = [tool, "-p", str(PAIR_PORT), "-s", str(size), "-n", str(iters), "-F", "--report_gbits",
            *args.ib_args.split()]
    return argv if host is None else argv + [host]


def reference_gbs(tool, output):
    """GB/s (1e9 bytes/s) of one reference client run."""
    if tool == "ucx_perftest":
        return perftest_final(output)[1] * (1 << 20) / 1e9     # ucx_perftest's MB is 2^20 bytes
    lines = output.splitlines()
    for i, line in enumerate(lines):   # perftest: "#bytes #iterations BW peak[Gb/sec] BW average[Gb/sec] ..."
        if "BW average" in line and i + 1 < len(lines):
            return float(lines[i + 1].split()[3]) / 8
    raise RuntimeError(f"no bandwidth line in the {tool} output:\n" + output[-2000:])


def wait_for_file(path, what, timeout=PAIR_WAIT_S):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(f"smb_bandwidth.py --pair: {what} did not happen within {timeout} s ({path} missing)")
        time.sleep(0.2)


def pair_serve(base, transports, plan, args):
    """Task 0: an smb-server per transport until the other task is done with it, then the
    server side of every reference run."""
    sys.path.insert(0, str(SRC))
    from eddis.smb import rundir

    memory = f"{2 * max(parse_size(x) for x in args.sizes.split(',')) // (1 << 20) + 64}M"
    for transport in transports:
        run_dir = base / transport
        rundir.create_run_dir(run_dir)
        env = dict(os.environ, SMB_TRANSPORT=transport,
                   PYTHONPATH=os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p))
        server = subprocess.Popen([sys.executable, "-m", "eddis.smb.server", "--run-dir", str(run_dir),
                                   "--index", "0", "--memory", memory], env=env)
        try:
            wait_for_file(run_dir / "measured", f"the measurement of {transport}", PAIR_WAIT_S * 4)
        finally:
            server.terminate()
            server.wait(30)
    (base / "references-host").write_text(socket.gethostname())
    for i, (tool, test, size, iters) in enumerate(plan):
        if shutil.which(tool) is None:
            (base / f"reference-{i}-missing").write_text(tool)
            continue
        server = subprocess.Popen(reference_argv(tool, test, size, iters, None, args), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        (base / f"reference-{i}-serving").write_text("")
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def pair_measure(base, transports, plan, sizes, bytes_per_size, args):
    """Task 1: SMB put/get against task 0's servers, then the client side of every reference run."""
    sys.path.insert(0, str(SRC))
    from eddis.smb import Client, rundir

    results, references = {}, {}
    for transport in transports:
        run_dir = base / transport
        rundir.wait_for_servers(run_dir, 1, PAIR_WAIT_S)
        os.environ["SMB_TRANSPORT"] = transport
        with Client(run_dir, expected_servers=1, timeout=120) as client:
            if client.is_local(0):
                sys.exit("smb_bandwidth.py --pair: the server is on this node; run one task per node")
            results[transport] = measure(client, transport, sizes, bytes_per_size, args.window, args.repeat, False)
            results[transport]["server_host"] = client.servers[0]["hostname"]
        (run_dir / "measured").write_text("")
    wait_for_file(base / "references-host", "the reference servers' start")
    host = (base / "references-host").read_text().strip()
    for i, (tool, test, size, iters) in enumerate(plan):
        missing, serving = base / f"reference-{i}-missing", base / f"reference-{i}-serving"
        deadline = time.monotonic() + 60
        while not missing.exists() and not serving.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if missing.exists() or shutil.which(tool) is None:
            continue
        argv = reference_argv(tool, test, size, iters, host, args)
        for _ in range(50):      # until the server listens
            time.sleep(0.2)
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            if proc.returncode == 0:
                references.setdefault(size, {})[test] = reference_gbs(tool, proc.stdout)
                break
        else:
            print(f"{' '.join(argv)} failed: {proc.stdout[-500:]}{proc.stderr[-500:]}", file=sys.stderr)
    return results, references


def pair_main(args, sizes, bytes_per_size):
    rank, ntasks = int(os.environ.get("SLURM_PROCID", "-1")), int(os.environ.get("SLURM_NTASKS", "0"))
    if ntasks != 2 or rank not in (0, 1):
        sys.exit("smb_bandwidth.py --pair runs as two tasks on two nodes: "
                 "srun -N2 -n2 --ntasks-per-node=1 python bench/smb_bandwidth.py --pair")
    transports = [t.strip() for t in args.transports.split(",")]
    if not set(transports) <= {"socket", "rdma"}:
        sys.exit("smb_bandwidth.py --pair measures the transports socket and rdma")
    base = Path(args.run_dir or Path.home() / ".eddis" / f"bench-pair-{os.environ.get('SLURM_JOB_ID', 'local')}")
    plan = pair_plan(sizes, bytes_per_size)
    if rank == 0:
        base.mkdir(parents=True, exist_ok=True)
        pair_serve(base, transports, plan, args)
        return
    wait_for_file(base, "the run directory (shared by both nodes?)")
    results, references = pair_measure(base, transports, plan, sizes, bytes_per_size, args)
    shutil.rmtree(base, ignore_errors=True)
    for transport, smb in results.items():
        smb["sizes"] = {size: {**runs, "put": max(runs["put runs"]), "get": max(runs["get runs"]),
                               "put cpu": statistics.median(runs["put cpu runs"]),
                               "get cpu": statistics.median(runs["get cpu runs"])}
                        for size, runs in smb["sizes"].items()}
    print(f"SMB between two nodes: client on {socket.gethostname()}, server on "
          f"{next(iter(results.values()))['server_host']}; {', '.join(results)}; rdma over UCX "
          f"{results.get('rdma', {}).get('ucx_tls')}")
    cols = ["size"] + [f"{t} {op}" for t in results for op in ("put", "get")] + [
        "ucp_put_bw", "ucp_get", "ib_write_bw", "ib_read_bw"]
    rows = []
    for size in sizes:
        ref = references.get(size, {})
        rows.append([size_label(size)] + [f"{results[t]['sizes'][size][op]:.2f}" for t in results
                                          for op in ("put", "get")]
                    + [f"{ref[k]:.2f}" if k in ref else "-" for k in ("ucp_put_bw", "ucp_get", "ib_write_bw",
                                                                        "ib_read_bw")])
    print("GB/s (1e9 bytes/s), best run")
    print_table(cols, rows, args.markdown)
    if "rdma" in results:
        ratios = [f"{size_label(x)} put {results['rdma']['sizes'][x]['put'] / references[x][ref]:.2f}"
                  for x in sizes if x in references for ref in ("ucp_put_bw", "ib_write_bw") if ref in references[x]]
        print("rdma / reference (ucp_put_bw, then ib_write_bw): " + (", ".join(ratios) or "no reference ran"))
    if "socket" in results and "rdma" in results:
        side_by_side(results["socket"], results["rdma"], None, sizes, args.markdown, "socket and rdma, two nodes")


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------

def describe(transport, ucx_tls=None):
    if transport == "socket":
        return ("socket: SMB's proven sockets, SMB_LOCAL_MAP=0, servers on fake nodes smb-node-<i> "
                "(stand in for other nodes); ucx_perftest over UCX_TLS=tcp")
    if transport == "rdma":
        return (f"rdma: SMB_TRANSPORT=rdma, one-sided over UCX {ucx_tls} (one host: shared memory/CMA, "
                "no HCA), SMB_LOCAL_MAP=0, servers on fake nodes smb-node-<i>; ucx_perftest on UCX's "
                "default (shared memory) transports")
    if transport == "rdma-tcp":
        return (f"rdma-tcp: SMB_TRANSPORT=rdma over UCX {ucx_tls} (SMB_UCX_ALLOW_TCP=1, UCX_TLS=tcp, "
                "unsafe: tests only), servers on fake nodes smb-node-<i>; ucx_perftest over UCX_TLS=tcp")
    return ("same-node: the client maps the server's shared memory; ucx_perftest on UCX's "
            "default (shared memory) transports")


def merge_rounds(rounds, sizes):
    """One (smb, perf, small_ops) from several rounds: every run's figure kept, the best
    as the headline figure, latencies as the median of the rounds' figures."""
    smb = {"sizes": {}, "ucx_tls": rounds[0][0].get("ucx_tls")}
    for size in sizes:
        merged = {}
        for op in ("put", "get"):
            runs = [x for s, _, _ in rounds for x in s["sizes"][size][op + " runs"]]
            merged[op], merged[op + " runs"] = max(runs), runs
            cpu = [x for s, _, _ in rounds for x in s["sizes"][size][op + " cpu runs"]]
            merged[op + " cpu"], merged[op + " cpu runs"] = statistics.median(cpu), cpu
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
    print(("### " if markdown else "") + describe(transport, smb.get("ucx_tls")))
    print("bandwidth in GB/s (1e9 bytes/s); ratios: SMB / ucx_perftest and SMB / memcpy")
    print_table(cols, rows, markdown)
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


def print_table(cols, rows, markdown):
    if markdown:
        print()
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        print()
        return
    widths = [max(len(c), *(len(r[i]) for r in rows)) + 2 for i, c in enumerate(cols)]
    print("".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in rows:
        print("".join(v.rjust(w) for v, w in zip(row, widths)))


def side_by_side(socket_smb, rdma_smb, memcpy, sizes, markdown, title):
    """socket and rdma per size: bandwidth, rdma/socket, rdma/memcpy and the server's CPU
    seconds per GB, against issue 43's targets for 1 MiB and more."""
    cols = ["size", "socket put", "rdma put", "x socket", "socket get", "rdma get", "x socket",
            "rdma/memcpy put", "get", "server CPU s/GB put socket", "rdma", "get socket", "rdma"]
    rows = []
    for size in sizes:
        s, r = socket_smb["sizes"][size], rdma_smb["sizes"][size]
        m = memcpy.get(size) if memcpy else None
        rows.append([size_label(size), f"{s['put']:.2f}", f"{r['put']:.2f}", f"{r['put'] / s['put']:.2f}",
                     f"{s['get']:.2f}", f"{r['get']:.2f}", f"{r['get'] / s['get']:.2f}",
                     f"{r['put'] / m:.2f}" if m else "-", f"{r['get'] / m:.2f}" if m else "-",
                     f"{s['put cpu']:.3f}", f"{r['put cpu']:.3f}", f"{s['get cpu']:.3f}", f"{r['get cpu']:.3f}"])
    print()
    print(("### " if markdown else "") + title)
    print("GB/s (best run); the servers' CPU seconds (user + system) per GB moved (median run)")
    print_table(cols, rows, markdown)
    big = [size for size in sizes if size >= 1 << 20]
    if not big:
        return
    worst = {op: min(rdma_smb["sizes"][x][op] / socket_smb["sizes"][x][op] for x in big) for op in ("put", "get")}
    cpu = {op: max(rdma_smb["sizes"][x][op + " cpu"] / max(socket_smb["sizes"][x][op + " cpu"], 1e-9)
                   for x in big) for op in ("put", "get")}
    line = (f"sizes >= 1 MiB: worst rdma/socket put {worst['put']:.2f}, get {worst['get']:.2f} (target 1.5); "
            f"highest rdma/socket server CPU per GB put {cpu['put']:.3f}, get {cpu['get']:.3f} (target 0.1)")
    if memcpy:
        line += (f"; worst rdma/memcpy put {min(rdma_smb['sizes'][x]['put'] / memcpy[x] for x in big):.2f}, "
                 f"get {min(rdma_smb['sizes'][x]['get'] / memcpy[x] for x in big):.2f} (target 0.8)")
    print(line)
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", default="socket,rdma,same-node",
                        help="comma-separated: socket, rdma, rdma-tcp, same-node (--pair: socket, rdma)")
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
    parser.add_argument("--hugepages", default="off", choices=["off", "hugetlb", "transparent", "auto"],
                        help="the servers' SMB_HUGEPAGES; other than off, the client's buffers and the "
                             "memcpy reference's are on transparent huge pages too")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    pair = parser.add_argument_group("two nodes (--pair: srun -N2 -n2 --ntasks-per-node=1)")
    pair.add_argument("--pair", action="store_true",
                      help="task 0 serves, task 1 measures socket and rdma against it, then ucx_perftest "
                           "and ib_write_bw/ib_read_bw between the same nodes")
    pair.add_argument("--ib-args", default="", help="extra ib_write_bw/ib_read_bw arguments, e.g. '-d mlx5_0'")
    cluster = parser.add_argument_group("cluster mode (SMB pooling on many hosts)")
    cluster.add_argument("--cluster", action="store_true",
                         help="one client on n1 (unlimited link) striping one pool over N smb-servers on "
                              "n2.. of a private netns dev cluster (needs root)")
    cluster.add_argument("--link", default="1gbit", help="the server nodes' link rate (default 1gbit)")
    cluster.add_argument("--server-counts", default="1,2,4", help="server counts N, one job each")
    cluster.add_argument("--cluster-size", default="64M", help="bytes per timed transfer")
    cluster.add_argument("--cluster-repeat", type=int, default=8, help="timed transfers per op and N")
    cluster.add_argument("--cluster-dir", default="/tmp/eddis-smbbw-cluster",
                         help="state directory of the private cluster")
    cluster.add_argument("--cluster-port", type=int, default=19817, help="its slurmctld port (base)")
    cluster.add_argument("--keep-cluster", action="store_true",
                         help="leave the cluster up (and keep each job's script and output)")
    cluster.add_argument("--json", help="also write the cluster figures to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help="--pair: a directory both nodes see (default ~/.eddis/bench-pair-<job>)")
    parser.add_argument("--cluster-client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--server-nodes", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cluster_client:
        cluster_client(args)
        return
    if args.cluster:
        cluster_main(args)
        return
    sizes = sorted(parse_size(s) for s in args.sizes.split(","))
    bytes_per_size = parse_size(args.bytes_per_size)
    if args.pair:
        if args.transports == parser.get_default("transports"):
            args.transports = "socket,rdma"
        pair_main(args, sizes, bytes_per_size)
        return
    if args.child:
        smb_child(args.child, args.run_dir, args.servers, sizes, bytes_per_size, args.window,
                  args.repeat, args.hugepages)
        return
    transports = [t.strip() for t in args.transports.split(",")]
    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown:
        parser.error(f"unknown transport(s) {unknown}: use {', '.join(TRANSPORTS)}")
    print(f"SMB bandwidth benchmark: {args.servers} server(s), huge pages {args.hugepages}, "
          f"sizes {', '.join(size_label(s) for s in sizes)}, "
          f"{size_label(bytes_per_size)} per figure, window {args.window}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    measured, memcpy = {}, {size: 0.0 for size in sizes}
    for transport in transports:
        # Rounds alternate SMB, ucx_perftest and memcpy, so a slow spell of the machine hits all.
        rounds = []
        for _ in range(args.rounds):
            for size in sizes:
                memcpy[size] = max(memcpy[size], memcpy_gbs(size, bytes_per_size, args.repeat,
                                                            huge=args.hugepages != "off"))
            smb = smb_table(transport, args.servers, sizes, bytes_per_size, args.window, args.repeat,
                            args.hugepages)
            perf, small_ops = perftest_table(transport, sizes, bytes_per_size, args.repeat,
                                             args.perftest_args.split())
            rounds.append((smb, perf, small_ops))
        smb, perf, small_ops = merge_rounds(rounds, sizes)
        measured[transport] = smb
        report(transport, smb, perf, small_ops, memcpy, sizes, args.markdown)
        print(f"load average after {transport}: {os.getloadavg()[0]:.1f}")
    for rdma in ("rdma", "rdma-tcp"):
        if "socket" in measured and rdma in measured:
            side_by_side(measured["socket"], measured[rdma], memcpy, sizes, args.markdown,
                         f"socket and {rdma} side by side ({describe(rdma, measured[rdma].get('ucx_tls'))})")


if __name__ == "__main__":
    main()
