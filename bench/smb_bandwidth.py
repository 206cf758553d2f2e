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
and the latency of counter.fetch_add beside ucx_perftest ucp_fadd. Figures are
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
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SRC = Path(__file__).resolve().parent.parent / "src"

TRANSPORTS = {
    "ucx-tcp": {"env": {"UCX_TLS": "tcp", "SMB_LOCAL_MAP": "0"}, "server_host": "smb-node0",
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

def memcpy_gbs(size, bytes_per_size):
    src = np.ones(size, np.uint8)
    dst = np.zeros(size, np.uint8)
    n = iterations(size, bytes_per_size)
    ctypes.memmove(dst.ctypes.data, src.ctypes.data, size)
    best = float("inf")
    for _ in range(3):
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


def run_perftest(test, size, iters, env_extra, timeout=120):
    """Run one ucx_perftest pair; returns (latency usec, bandwidth GB/s)."""
    env = dict(os.environ)
    env.update(env_extra)
    port = free_port()
    server = subprocess.Popen(["ucx_perftest", "-p", str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        client_argv = ["ucx_perftest", "127.0.0.1", "-p", str(port), "-t", test, "-s", str(size),
                       "-n", str(iters), "-w", str(max(2, iters // 10))]
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


def perftest_table(transport, sizes, bytes_per_size):
    env = TRANSPORTS[transport]["perftest_env"]
    rows = {}
    for size in sizes:
        iters = iterations(size, bytes_per_size)
        rows[size] = {test: run_perftest(test, size, iters, env)[1] for test in PERFTEST_TESTS}
    fadd_latency = run_perftest("ucp_fadd", 8, 20000, env)[0]
    return rows, fadd_latency


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", default="ucx-tcp,same-node")
    parser.add_argument("--sizes", default=DEFAULT_SIZES)
    parser.add_argument("--bytes-per-size", default="256M",
                        help="bytes moved per measurement (iterations = this / size)")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    bytes_per_size = parse_size(args.bytes_per_size)
    for transport in args.transports.split(","):
        rows, fadd = perftest_table(transport, sizes, bytes_per_size)
        print(f"\n{transport}")
        print(f"{'size':>10}{'put_bw':>10}{'get':>10}{'am_bw':>10}{'memcpy':>10}")
        for size in sizes:
            r = rows[size]
            print(f"{size_label(size):>10}{r['ucp_put_bw']:>10.2f}{r['ucp_get']:>10.2f}"
                  f"{r['ucp_am_bw']:>10.2f}{memcpy_gbs(size, bytes_per_size):>10.2f}")
        print(f"ucp_fadd latency {fadd:.2f} us")


if __name__ == "__main__":
    main()
