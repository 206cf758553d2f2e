#!/usr/bin/env python
"""Bandwidth of the SMB vector kernels next to numpy and memcpy (a benchmark, not a test).

For each dtype, with buffers of --mib MiB each (default 64):
  - weighted_sum of 4 source slots into a destination (reads 4 buffers, writes 1),
  - axpy y += a*x (reads 2, writes 1),
timed as the best of --repeat runs, printed in GB/s (bytes the kernel must move
divided by time) beside numpy doing the same computation with fp32 accumulation
(fp64 for float64; bfloat16 emulated with integer ops, as numpy has no bfloat16)
and beside memcpy of one buffer (read + write). Ratios: kernel/numpy speed-up
and kernel GB/s / memcpy GB/s.

    PYTHONPATH=src python bench/vecops.py [--mib 64] [--repeat 5] [--isa auto|generic|avx2]
"""
import argparse
import ctypes
import os
import platform
import sys
import time

import numpy as np

from eddis.smb import _vecops as vecops

DTYPES = ["float32", "float16", "bfloat16", "float64"]
STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
           "float64": np.float64}


def best_time(fn, repeat):
    fn()  # warm-up: page faults, caches
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# numpy equivalents ----------------------------------------------------------

def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    u = x.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def numpy_weighted_sum(dtype, dst, srcs, weights):
    """What a numpy user would write: convert, accumulate with out= buffers, convert back."""
    acc_t = np.float64 if dtype == "float64" else np.float32
    load = bf16_to_f32 if dtype == "bfloat16" else (lambda a: a.astype(acc_t, copy=False))
    acc = np.multiply(load(srcs[0]), acc_t(weights[0]))
    tmp = np.empty_like(acc)
    for s, w in zip(srcs[1:], weights[1:]):
        np.multiply(load(s), acc_t(w), out=tmp)
        acc += tmp
    if dtype == "bfloat16":
        dst[:] = f32_to_bf16(acc)
    else:
        dst[:] = acc


def numpy_axpy(dtype, y, x, alpha):
    acc_t = np.float64 if dtype == "float64" else np.float32
    if dtype in ("float32", "float64"):
        y += acc_t(alpha) * x
    elif dtype == "float16":
        y[:] = y.astype(np.float32) + np.float32(alpha) * x.astype(np.float32)
    else:
        y[:] = f32_to_bf16(bf16_to_f32(y) + np.float32(alpha) * bf16_to_f32(x))


def memcpy_time(nbytes, repeat):
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    return best_time(lambda: ctypes.memmove(dst.ctypes.data, src.ctypes.data, nbytes), repeat)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="size of each buffer in MiB")
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement (best kept)")
    parser.add_argument("--slots", type=int, default=4, help="weighted_sum source slots")
    parser.add_argument("--isa", default="auto", choices=["auto", "generic", "avx2"],
                        help="kernel path (avx2: AVX2 loops and F16C float16)")
    args = parser.parse_args()

    vecops.set_isa(args.isa)
    nbytes = args.mib << 20
    gb = 1e9
    print(f"SMB vector kernels: {args.mib} MiB per buffer, best of {args.repeat}, "
          f"kernel path {vecops.isa()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, numpy {np.__version__}")
    t_memcpy = memcpy_time(nbytes, args.repeat)
    memcpy_gbs = 2 * nbytes / t_memcpy / gb
    print(f"memcpy {args.mib} MiB: {memcpy_gbs:.2f} GB/s (read + write)\n")

    header = (f"{'kernel':<16}{'dtype':<10}{'eddis GB/s':>11}{'numpy GB/s':>11}"
              f"{'eddis/numpy':>12}{'eddis/memcpy':>13}")
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    for dtype in DTYPES:
        storage = STORAGE[dtype]
        n = nbytes // np.dtype(storage).itemsize
        values = rng.standard_normal(n).astype(np.float32)
        if dtype == "bfloat16":
            make = lambda: f32_to_bf16(values)  # noqa: E731
        else:
            make = lambda: values.astype(storage)  # noqa: E731
        srcs = [make() for _ in range(args.slots)]
        weights = [1.0 / args.slots] * args.slots
        dst = np.empty(n, storage)
        moved = (args.slots + 1) * nbytes
        t_k = best_time(lambda: vecops.weighted_sum(dst, srcs, weights), args.repeat)
        t_np = best_time(lambda: numpy_weighted_sum(dtype, dst, srcs, weights), args.repeat)
        report(f"weighted_sum x{args.slots}", dtype, moved, t_k, t_np, memcpy_gbs)

        x, y = srcs[0], srcs[1]
        moved = 3 * nbytes
        t_k = best_time(lambda: vecops.axpy(y, x, 1e-3), args.repeat)
        t_np = best_time(lambda: numpy_axpy(dtype, y, x, 1e-3), args.repeat)
        report("axpy", dtype, moved, t_k, t_np, memcpy_gbs)
        del srcs, dst, x, y
    print("\nGB/s counts the bytes each kernel must read and write once; ratios > 1 favour eddis.")
    sys.stdout.flush()


def report(kernel, dtype, moved, t_kernel, t_numpy, memcpy_gbs):
    k = moved / t_kernel / 1e9
    n = moved / t_numpy / 1e9
    print(f"{kernel:<16}{dtype:<10}{k:>11.2f}{n:>11.2f}{k / n:>12.2f}{k / memcpy_gbs:>13.2f}")


if __name__ == "__main__":
    main()
