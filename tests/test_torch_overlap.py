"""Communication overlaps the backward pass: the first bucket goes on the wire
before the last bucket of the same step is ready (asserted on the order of
recorded events, never on durations).

This file is also the worker: ``mpirun -n 2 python tests/test_torch_overlap.py MODE``.
"""
import json
import sys


def worker(mode):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import eddis.torch as eddis

    eddis.init()
    torch.manual_seed(0)
    # small head (bucket 0, ready first), then wide layers whose backward takes a while
    model = nn.Sequential(nn.Linear(768, 768), nn.Tanh(), nn.Linear(768, 768), nn.Tanh(),
                          nn.Linear(768, 768), nn.Tanh(), nn.Linear(768, 10))
    optimizer = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                           named_parameters=model.named_parameters(),
                                           mode=mode, bucket_bytes=1 << 20)
    reducer = optimizer.reducer
    reducer.record_events()
    x, y = torch.randn(128, 768), torch.randint(0, 10, (128,))
    steps = 4
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    log = reducer.event_log
    per_step = []
    for s in range(steps):
        ev = [(t, e, b) for t, e, st, b in log if st == s]
        first_push = min(t for t, e, b in ev if e == "push_start" and b == 0)
        last_ready = max(t for t, e, b in ev if e == "ready")
        pushes_before = sum(1 for t, e, b in ev if e == "push_start" and t < last_ready)
        per_step.append({"first_push_before_last_ready": first_push < last_ready,
                         "pushes_before_backward_end": pushes_before})
    if eddis.rank() == 0:
        print("RESULT " + json.dumps({"steps": per_step, "buckets": reducer.num_buckets,
                                      "overlapped": reducer.stats["overlapped"]}), flush=True)
    optimizer.close()
    eddis.shutdown()


if __name__ == "__main__":
    worker(sys.argv[1])
    sys.exit(0)

import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["allreduce", "sync"])
def test_pushes_start_before_backward_ends(run_mpi, mode):
    from eddis.core import available_modes

    # sync needs the SMB extension: a build without it is a failure here, not a skip
    assert mode in available_modes(), f"mode {mode} is not available: build the extensions (make build)"
    proc = run_mpi(2, [PYTHON, __file__, mode], timeout=150, check=True)
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    res = json.loads(line[7:])
    assert res["buckets"] >= 4
    # every step: bucket 0 was on the wire before backward produced the last bucket
    assert all(s["first_push_before_last_ready"] for s in res["steps"]), res
    assert res["overlapped"] >= len(res["steps"]), res
