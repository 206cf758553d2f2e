"""``DistributedOptimizer.step(closure)``: LBFGS (and any optimizer that evaluates a closure)
on N ranks ends with the parameters of one process on the global batch, as written for
one process: the closure zeroes, computes the loss on the rank's shard, calls backward
and returns the loss; nothing else.

This file is also the worker (``mpirun -n N python tests/test_torch_closure.py``). Rank 0
trains a plain torch copy on the whole global batch in-process; every rank checks its
parameters against rank 0's; rank 0 reports the relative L2 error against the reference,
the closure's evaluations per step on both sides, and the losses step() returned.
Tolerance: fp32 1e-5 (LBFGS on an MLP, 4 steps of up to 5 iterations (4 with
its strong Wolfe line search); SGD with momentum for the plain closure case.

``diverge``: the ranks' LBFGS are told different iteration limits, so one stops while the
other evaluates again: every rank must raise the UsageError that says so at once.
"""
import copy
import json
import os
import sys

STEPS = 4
GLOBAL_BATCH = 24
TOLERANCE = 1e-5
# sgd-prebackward: a backward before step(closure), whose averaging ends before the closure runs
CONFIGS = [(mode, opt) for mode in ("sync", "allreduce") for opt in ("lbfgs", "lbfgs-wolfe", "sgd",
                                                                     "sgd-prebackward")] + [
    ("sync", "lbfgs-weighted")]


def make_optimizer(kind, params, max_iter=5):
    import torch

    # LBFGS amplifies rounding (float32 sums of the ranks' shares are not the global batch's
    # sum, bit for bit): a few iterations a step, away from convergence, keep it below 1e-5
    if kind == "lbfgs-wolfe":
        return torch.optim.LBFGS(params, lr=0.5, max_iter=max_iter - 1, history_size=5,
                                 line_search_fn="strong_wolfe")
    if kind.startswith("lbfgs"):
        return torch.optim.LBFGS(params, lr=0.2, max_iter=max_iter, history_size=5)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def data():
    import torch

    g = torch.Generator().manual_seed(7)
    x = torch.randn(GLOBAL_BATCH, 12, generator=g)
    return x, torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)


def train_step(model, optimizer, x, y, evaluations=None, prebackward=False):
    import torch.nn.functional as F

    if prebackward:
        F.cross_entropy(model(x), y).backward()

    def closure():
        if evaluations is not None:
            evaluations[-1] += 1
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss
    return float(optimizer.step(closure))


def train(model, optimizer, x, y, evaluations, losses, prebackward=False):
    for _ in range(STEPS):
        evaluations.append(0)
        losses.append(train_step(model, optimizer, x, y, evaluations, prebackward))


def run_config(mode, kind):
    import torch
    import torch.nn as nn
    import eddis.torch as eddis
    from eddis.core import batch_slice

    rank, size = eddis.rank(), eddis.size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3))
    reference = copy.deepcopy(model) if rank == 0 else None
    weights = [r + 1 for r in range(size)] if kind.endswith("weighted") else None
    optimizer = eddis.DistributedOptimizer(make_optimizer(kind, model.parameters()),
                                           named_parameters=model.named_parameters(), mode=mode,
                                           bucket_bytes=512)
    eddis.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = data()
    shard = batch_slice(GLOBAL_BATCH, rank, size, weights)
    optimizer.set_sample_count(shard.stop - shard.start)
    evaluations, losses = [], []
    train(model, optimizer, x[shard], y[shard], evaluations, losses, kind.endswith("prebackward"))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rank0 = eddis.broadcast(flat, root_rank=0)
    spread = eddis.allreduce((flat - rank0).abs().max().reshape(1), op=eddis.Max).item()
    buckets = len(optimizer.reducer.plan.buckets)
    optimizer.close()
    if reference is None:
        return None
    ref_evaluations, ref_losses = [], []
    train(reference, make_optimizer(kind, reference.parameters()), x, y, ref_evaluations, ref_losses,
          kind.endswith("prebackward"))
    ref = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    return {"config": f"{mode},{kind}", "ranks": size, "rel_error": float((flat - ref).norm() / ref.norm()),
            "rank_spread": spread, "evaluations": evaluations, "ref_evaluations": ref_evaluations,
            "losses": losses, "ref_losses": ref_losses, "buckets": buckets}


def diverge():
    """Rank 0's LBFGS may iterate 6 times a step, the others' 3: the ranks part after the
    third evaluation, and every rank must say so instead of waiting."""
    import torch
    import torch.nn as nn
    import eddis.torch as eddis
    from eddis.errors import UsageError

    rank = eddis.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = eddis.DistributedOptimizer(make_optimizer("lbfgs", model.parameters(),
                                                          max_iter=6 if rank == 0 else 3))
    x, y = data()
    try:
        train(model, optimizer, x, y, [], [])
        message = None
    except UsageError as exc:
        message = str(exc)
    # the exchange that found it completed on every rank: MPI still works for the report
    everyone = eddis.allgather_object(message)
    if rank == 0:
        print("DIVERGED " + json.dumps(everyone), flush=True)
    eddis.shutdown()


def progress(case, mode):
    """Rank 0's progress line over STEPS steps of 25 samples, shared 13/12 (``closure``: LBFGS,
    no set_sample_count: the model's batches count) or as sample counts 10/15 that the
    script gives (``plain``: SGD steps without a closure)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import eddis.torch as eddis
    from eddis.core import batch_slice

    rank, size = eddis.rank(), eddis.size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(25, 12, generator=g), torch.randint(0, 3, (25,), generator=g)
    if case == "closure":
        optimizer = eddis.DistributedOptimizer(make_optimizer("lbfgs", model.parameters()), mode=mode)
        shard = batch_slice(25, rank, size)
        train(model, optimizer, x[shard], y[shard], [], [])
    else:
        optimizer = eddis.DistributedOptimizer(make_optimizer("sgd", model.parameters()), mode=mode)
        shard = batch_slice(25, rank, size, [2, 3])
        optimizer.set_sample_count(shard.stop - shard.start)
        for _ in range(STEPS):
            optimizer.zero_grad()
            F.cross_entropy(model(x[shard]), y[shard]).backward()
            optimizer.step()
    eddis.shutdown()


def join_with_closure():
    """Rank 1 runs out of data after one step and joins while rank 0 goes on with LBFGS."""
    import torch
    import torch.nn as nn
    import eddis.torch as eddis

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = eddis.DistributedOptimizer(make_optimizer("lbfgs", model.parameters()))
    x, y = data()
    for _ in range(2 if eddis.rank() == 0 else 1):
        train_step(model, optimizer, x, y)
    eddis.join()
    eddis.shutdown()


def worker():
    import eddis.torch as eddis

    eddis.init()
    if sys.argv[1:] == ["diverge"]:
        return diverge()
    if sys.argv[1:] == ["join"]:
        return join_with_closure()
    if sys.argv[1:2] == ["progress"]:
        return progress(*sys.argv[2:])
    only = os.environ.get("CLOSURE_CONFIGS")
    configs = CONFIGS if not only else [tuple(c.split(",")) for c in only.split(";")]
    for mode, kind in configs:
        result = run_config(mode, kind)
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
    eddis.shutdown()


if __name__ == "__main__":
    sys.exit(worker())

# ---------------------------------------------------------------------- tests
import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402

_results = {}


def _run(run_mpi, ranks):
    if ranks not in _results:
        proc = run_mpi(ranks, [PYTHON, __file__], timeout=240, check=True)
        found = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        _results[ranks] = {r["config"]: r for r in found}
    return _results[ranks]


CASES = [(ranks, config) for ranks in (1, 2, 4) for config in CONFIGS]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks,config", CASES, ids=[f"{','.join(c)}-{n}" for n, c in CASES])
def test_closure_step_matches_one_process_on_global_batch(run_mpi, ranks, config):
    results = _run(run_mpi, ranks)
    key = ",".join(config)
    assert key in results, f"worker printed no result for {key}: {sorted(results)}"
    r = results[key]
    assert r["rank_spread"] == 0.0, f"ranks ended with different parameters: {r}"
    assert r["rel_error"] < TOLERANCE, r
    # as often as one process, and every evaluation was a reduction over the ranks
    assert r["evaluations"] == r["ref_evaluations"], r
    if config[1].startswith("lbfgs"):
        assert min(r["evaluations"]) > 1, f"LBFGS should evaluate several times a step: {r}"
    else:
        assert r["evaluations"] == [1] * len(r["evaluations"]), r
    # step() returns the loss of the global batch (the first evaluation's, as torch does)
    for mine, ref in zip(r["losses"], r["ref_losses"]):
        assert abs(mine - ref) <= 1e-5 * abs(ref), r
    assert r["buckets"] > 1, r


@pytest.mark.timeout(200)
def test_ranks_that_evaluate_differently_all_raise(run_mpi):
    proc = run_mpi(2, [PYTHON, __file__, "diverge"], timeout=150, env={"EDDIS_COMM_TIMEOUT": "100"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("DIVERGED ")]
    assert lines, proc.stdout + proc.stderr
    messages = json.loads(lines[0][9:])
    assert len(messages) == 2 and all(messages), messages
    for m in messages:
        assert "evaluated the closure a different number of times" in m, m
        assert "rank 1 finished the step after 3 evaluation(s)" in m and "rank 0 is at evaluation 4" in m, m


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["closure", "plain"])
@pytest.mark.parametrize("mode", ["sync", "allreduce"])
def test_progress_counts_optimizer_steps_and_every_ranks_samples(run_mpi, case, mode):
    import re

    proc = run_mpi(2, [PYTHON, __file__, "progress", case, mode], timeout=150, check=True,
                   env={"EDDIS_PROGRESS": "log", "EDDIS_PROGRESS_INTERVAL": "0"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[eddis] train step")]
    assert lines, proc.stdout + proc.stderr
    # one line per optimizer step, however many evaluations LBFGS took; 25 samples each, not 2 x 13
    steps = [int(re.search(r"step (\d+)", line).group(1)) for line in lines]
    assert steps[:STEPS] == list(range(1, STEPS + 1)) and set(steps[STEPS:]) <= {STEPS}, lines
    for step, line in zip(steps, lines):   # (the closing line repeats the last step)
        assert f"  {25 * step} samples  " in line, lines


@pytest.mark.timeout(200)
def test_join_with_a_closure_optimizer_says_why(run_mpi):
    proc = run_mpi(2, [PYTHON, __file__, "join"], timeout=150, env={"EDDIS_COMM_TIMEOUT": "60"})
    assert proc.returncode != 0
    assert "eddis.join() with an optimizer that steps with a closure (LBFGS)" in proc.stdout + proc.stderr, (
        proc.stdout + proc.stderr)
