"""A small real MPI trainer for the launcher tests (no SMB needed).

Prints its rank environment, does an allreduce per step and can be told to
fail: ``--fail-rank R --fail-step S --how raise|exit|segfault`` (``--fail-rank -2``: every rank
fails alike at that step).
"""
import argparse
import os
import sys
import time

from mpi4py import MPI

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=5)
p.add_argument("--step-seconds", type=float, default=0.2)
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--fail-step", type=int, default=2)
p.add_argument("--how", default="raise", choices=["raise", "exit", "segfault"])
p.add_argument("--no-newline-at-end", action="store_true")
args = p.parse_args()

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
env = {k: os.environ.get(k) for k in ("EDDIS_RANK", "EDDIS_SIZE", "EDDIS_LOCAL_RANK", "EDDIS_LOCAL_SIZE",
                                      "EDDIS_GROUP", "EDDIS_NUM_GROUPS", "EDDIS_GPU_TYPE", "EDDIS_HOSTNAME",
                                      "CUDA_VISIBLE_DEVICES", "EDDIS_RUN_DIR", "EDDIS_LAUNCHED")}
print("ENV " + " ".join(f"{k}={v}" for k, v in env.items()) + f" MPI_RANK={rank} MPI_SIZE={size}")
print(f"warning line from rank {rank}", file=sys.stderr)


def fail():
    if args.how == "exit":
        sys.exit(3)
    if args.how == "segfault":
        import ctypes

        ctypes.CFUNCTYPE(None)(0)()   # a call through a null function pointer
    raise RuntimeError(f"injected failure on rank {rank} at step {step}")


for step in range(args.steps):
    if args.fail_rank in (rank, -2) and step == args.fail_step:
        fail()
    total = comm.allreduce(rank + step)
    print(f"step {step} sum {total}")
    time.sleep(args.step_seconds)
comm.Barrier()
print("DONE", end="" if args.no_newline_at_end else "\n")
