"""torch.autocast + torch.amp.GradScaler with the DistributedOptimizer.

The documented order: ``scaler.scale(loss).backward()``, ``optimizer.synchronize()``,
``scaler.unscale_(optimizer)``, then ``with optimizer.skip_synchronize():
scaler.step(optimizer)`` and ``scaler.update()``. An overflow on ONE rank must
make EVERY rank skip that step (the averaged gradient is non-finite
everywhere), so the ranks stay identical. This file is also the worker.
"""
import json
import sys


def worker(mode):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import eddis.torch as eddis

    eddis.init()
    rank = eddis.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), mode=mode,
                                           bucket_bytes=4096)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    losses, scales, skipped = [], [], []
    for step in range(12):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        if step == 5 and rank == 1:
            loss = loss * float("inf")  # overflow on one rank only
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(loss).backward()
        optimizer.synchronize()
        scaler.unscale_(optimizer)
        with optimizer.skip_synchronize():
            scaler.step(optimizer)
        scaler.update()
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
        scales.append(scaler.get_scale())
        losses.append(eddis.allreduce(loss.detach().float()).item() if step != 5 else None)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = eddis.allreduce((flat - eddis.broadcast(flat, 0)).abs().max().reshape(1), op=eddis.Max).item()
    all_scales = eddis.allgather_object(scales)
    if rank == 0:
        print("RESULT " + json.dumps({"losses": losses, "scales": all_scales, "skipped": skipped,
                                      "spread": spread}), flush=True)
    eddis.shutdown()


if __name__ == "__main__":
    worker(sys.argv[1])
    sys.exit(0)

import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["sync", "allreduce"])
def test_autocast_and_grad_scaler_skip_overflow_on_every_rank(run_mpi, mode):
    from eddis.core import available_modes

    if mode not in available_modes():
        pytest.skip(f"mode {mode} needs the SMB extension (eddis.smb), which is not built")
    proc = run_mpi(2, [PYTHON, __file__, mode], timeout=150, check=True)
    res = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert res["spread"] == 0.0, "ranks diverged"
    assert res["scales"][0] == res["scales"][1], "the scalers of the two ranks disagree"
    assert res["skipped"][5] and not any(res["skipped"][:5] + res["skipped"][6:]), res["skipped"]
    assert res["scales"][0][5] == 512.0 and res["scales"][0][4] == 1024.0  # halved once, on the overflow
    losses = [l for l in res["losses"] if l is not None]
    assert losses[-1] < losses[0], losses
