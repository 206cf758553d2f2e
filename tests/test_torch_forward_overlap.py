"""EDDIS_OVERLAP_FORWARD=on: step() returns before its updates and the next forward applies
them module by module, with the same parameters as updates applied inside step(); a parameter
read outside its module's forward stops backward with a UsageError.

This file is also the worker: ``mpirun -n 2 python tests/test_torch_forward_overlap.py CASE MODE``.
"""
import json
import os
import sys


def _model(torch, nn):
    torch.manual_seed(0)
    # buckets of 64 KiB: the head with the last hidden layer, the wide layer, the first layer
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))


def _optimizer(eddis, torch, model, mode):
    return eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                      named_parameters=model.named_parameters(), mode=mode,
                                      bucket_bytes=64 << 10)


def same_updates(mode):
    """Two copies of one model, one trained with the updates left for the forward, one with
    them inside step(): every parameter equal after every step, bit for bit."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import eddis.torch as eddis

    eddis.init()
    later, now = _model(torch, nn), _model(torch, nn)
    opt_later, opt_now = _optimizer(eddis, torch, later, mode), _optimizer(eddis, torch, now, mode)
    rng = torch.Generator().manual_seed(1 + eddis.rank())
    facts = {"buckets": opt_later.reducer.num_buckets, "pending_after_step": 0,
             "first_layer_unchanged_after_step": 0, "applied_by_forward": 0, "steps": 6, "equal_steps": 0}
    for step in range(facts["steps"]):
        x, y = torch.randn(32, 64, generator=rng), torch.randint(0, 10, (32,), generator=rng)
        for model, optimizer, deferred in ((later, opt_later, "on"), (now, opt_now, "off")):
            os.environ["EDDIS_OVERLAP_FORWARD"] = deferred
            # every other step zeroes in place: .grad is the averaged gradient's buffer then
            optimizer.zero_grad(set_to_none=step % 2 == 0)
            out = model(x)
            if deferred == "on" and step > 0 and opt_later._eddis.deferred is None:
                facts["applied_by_forward"] += 1
            F.cross_entropy(out, y).backward()
            before = model[0].weight.detach().clone()
            optimizer.step()
            if deferred == "on":
                facts["pending_after_step"] += opt_later._eddis.deferred is not None
                facts["first_layer_unchanged_after_step"] += torch.equal(model[0].weight, before)
        # state_dict() applies what is pending
        a, b = later.state_dict(), now.state_dict()
        facts["equal_steps"] += all(torch.equal(a[name], b[name]) for name in b)
    os.environ["EDDIS_OVERLAP_FORWARD"] = "on"
    x = torch.randn(32, 64, generator=rng)
    F.cross_entropy(later(x), torch.zeros(32, dtype=torch.long)).backward()
    opt_later.step()
    facts["pending_before_shutdown"] = opt_later._eddis.deferred is not None
    before = later[0].weight.detach().clone()
    opt_later.finish_step()
    facts["finish_step_applied"] = not torch.equal(later[0].weight, before)
    if eddis.rank() == 0:
        print("RESULT " + json.dumps(facts), flush=True)
    opt_later.close()
    opt_now.close()
    eddis.shutdown()


def stale_read(mode):
    """A module that uses another's weight without calling it: backward says so."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import eddis.torch as eddis

    from eddis.errors import UsageError

    class Borrower(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(64, 256)
            self.head = nn.Linear(256, 10)

        def forward(self, x):
            return self.head(torch.tanh(F.linear(x, self.inner.weight, self.inner.bias)))

    eddis.init()
    os.environ["EDDIS_OVERLAP_FORWARD"] = "on"
    torch.manual_seed(0)
    model = Borrower()
    optimizer = _optimizer(eddis, torch, model, mode)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    error = None
    for _ in range(3):
        optimizer.zero_grad()
        try:
            F.cross_entropy(model(x), y).backward()
        except UsageError as exc:   # raised by the gradient hook, inside backward
            error = str(exc)
            break
        optimizer.step()
    if eddis.rank() == 0:
        print("RESULT " + json.dumps({"error": error}), flush=True)
    optimizer.finish_step()
    optimizer.close()
    eddis.shutdown()


if __name__ == "__main__":
    {"same": same_updates, "stale": stale_read}[sys.argv[1]](sys.argv[2])
    sys.exit(0)

import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402

# sync through the hierarchy (also on one node), whose relay sends the bucket the next forward
# needs first; allreduce, whose buckets come back in plan order
MODES = [("sync", {"EDDIS_SYNC_REDUCE": "hierarchical"}), ("allreduce", {})]


def _result(proc):
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[7:])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode,env", MODES, ids=[m for m, _ in MODES])
def test_updates_left_for_the_forward_equal_those_inside_step(run_mpi, mode, env):
    res = _result(run_mpi(2, [PYTHON, __file__, "same", mode], env=env, timeout=200, check=True))
    assert res["buckets"] >= 3, res
    assert res["equal_steps"] == res["steps"], res
    # every step() left its updates pending; the forward applied all of them (steps after the first)
    assert res["pending_after_step"] == res["steps"], res
    assert res["first_layer_unchanged_after_step"] == res["steps"], res
    assert res["applied_by_forward"] == res["steps"] - 1, res
    assert res["pending_before_shutdown"] and res["finish_step_applied"], res


@pytest.mark.timeout(240)
def test_a_parameter_read_outside_its_module_stops_backward(run_mpi):
    mode, env = MODES[0]
    res = _result(run_mpi(2, [PYTHON, __file__, "stale", mode], env=env, timeout=200, check=True))
    assert res["error"] is not None, res
    assert "parameter inner." in res["error"] and "EDDIS_OVERLAP_FORWARD=off" in res["error"], res
