"""One Slurm job's worker on the emulated cluster: mode sync's results and link bytes (and
mode allreduce's bytes).

1. The equivalence configurations of tests/test_torch_equivalence.py named in
   EQUIV_CONFIGS: rank 0 prints ``RESULT {json}`` for each (its error against one
   process on the global batch).
2. For each case of LINK_BYTES_CASES (``compression:path``, e.g. ``none:auto``,
   ``fp16:auto``, ``none:server``; path is EDDIS_SYNC_REDUCE, or ``allreduce``: mode
   allreduce, MPI's non-blocking allreduces): a warm-up step, a
   barrier while rank 0 reads the link counters of the emulated cluster
   (EDDIS_DEV_CLUSTER_DIR), STEPS steps, a barrier and the counters again; rank 0
   prints ``BYTES {json}``: per node the bytes out and in over the steps, the
   plan's fp32 gradient bytes and whether the reducer was hierarchical.
"""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import eddis.torch as eddis  # noqa: E402
from eddis.slurm import devcluster  # noqa: E402
from test_torch_equivalence import train_config  # noqa: E402

STEPS = 3


def link_bytes(compression, path):
    mode = "allreduce" if path == "allreduce" else "sync"
    if mode == "sync":
        os.environ["EDDIS_SYNC_REDUCE"] = path
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1000, 2000), torch.nn.Tanh(), torch.nn.Linear(2000, 1000))
    opt = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters(), mode=mode,
                                     compression=getattr(eddis.Compression, compression))
    x = torch.randn(4, 1000)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    step()
    eddis.barrier()
    before = devcluster.traffic() if eddis.rank() == 0 else None
    eddis.barrier()
    for _ in range(STEPS):
        step()
    eddis.barrier()
    if eddis.rank() == 0:
        moved = devcluster.difference(before, devcluster.traffic())
        print("BYTES " + json.dumps({"compression": compression, "path": path, "nodes": moved, "steps": STEPS,
                                     "gradient_bytes": 4 * opt.reducer.plan.total,
                                     "hierarchical": getattr(opt.reducer, "layout", None) is not None}),
              flush=True)
    opt.close()


def main():
    eddis.init()
    for entry in filter(None, os.environ.get("EQUIV_CONFIGS", "").split(";")):
        mode, compression, kind, weighted = entry.split(",")
        result = train_config(mode, compression, kind, weighted == "True")
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
    for case in filter(None, os.environ.get("LINK_BYTES_CASES", "").split(",")):
        link_bytes(*case.split(":"))
    eddis.shutdown()


if __name__ == "__main__":
    main()
