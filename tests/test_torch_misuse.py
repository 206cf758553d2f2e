"""Misuse of the PyTorch API gives an error that names the problem and the fix,
and never a hang. This file is also the worker:
``mpirun -n N python tests/test_torch_misuse.py CASE``.
"""
import sys


def _setup(width=5):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, width), nn.ReLU(), nn.Linear(width, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def case_no_init():
    import eddis.torch as eddis

    model, opt = _setup()
    eddis.DistributedOptimizer(opt)


def case_shapes_differ():
    import eddis.torch as eddis

    eddis.init()
    model, opt = _setup(width=5 if eddis.rank() == 0 else 6)
    eddis.DistributedOptimizer(opt, named_parameters=model.named_parameters())


def case_original_optimizer_step():
    import torch
    import eddis.torch as eddis

    eddis.init()
    model, opt = _setup()
    wrapped = eddis.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    model(torch.randn(4, 10)).sum().backward()
    wrapped.synchronize()
    opt.step()  # the original, not the wrapper


def case_backward_twice():
    import torch
    import eddis.torch as eddis

    eddis.init()
    model, opt = _setup()
    opt = eddis.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    x = torch.randn(4, 10)
    model(x).sum().backward()
    model(x).sum().backward()


def case_zero_grad_before_step():
    import torch
    import eddis.torch as eddis

    eddis.init()
    model, opt = _setup()
    opt = eddis.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    model(torch.randn(4, 10)).sum().backward()
    opt.zero_grad()


def case_update_by_hand():
    """The wrapper is created, but the loop updates the parameters itself and never steps."""
    import torch
    import eddis.torch as eddis

    eddis.init()
    model, opt = _setup()
    opt = eddis.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 10)).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.1)


def case_wrap_model():
    import eddis.torch as eddis

    eddis.init()
    model, _ = _setup()
    eddis.DistributedOptimizer(model)


def case_accumulation_ok():
    """backward_passes_per_step=2: two backwards then one step is fine."""
    import torch
    import eddis.torch as eddis

    eddis.init()
    model, opt = _setup()
    opt = eddis.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                     backward_passes_per_step=2)
    for _ in range(2):
        x = torch.randn(4, 10)
        model(x).sum().backward()
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    print("ACCUMULATION OK", flush=True)
    eddis.shutdown()


def case_broadcast_state():
    """Not a misuse: rank 0's weights and (non-empty) optimizer state reach every rank."""
    import torch
    import eddis.torch as eddis

    eddis.init()
    torch.manual_seed(eddis.rank())  # different weights on each rank
    model = torch.nn.Sequential(torch.nn.Linear(10, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if eddis.rank() == 0:  # only rank 0 has optimizer state
        model(torch.randn(4, 10)).sum().backward()
        opt.step()
    opt = eddis.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    eddis.broadcast_parameters(model.state_dict(), root_rank=0)
    eddis.broadcast_optimizer_state(opt, root_rank=0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()] +
                     [opt.state[p]["exp_avg"].reshape(-1) for p in model.parameters()])
    spread = eddis.allreduce((flat - eddis.broadcast(flat, 0)).abs().max().reshape(1), op=eddis.Max).item()
    print(f"BROADCAST spread={spread}", flush=True)


def case_all_caught():
    """Every recoverable misuse in one run: each error is printed, the run goes on."""
    import eddis.torch as eddis

    cases = ["no_init", "original_optimizer_step", "backward_twice", "zero_grad_before_step",
             "update_by_hand", "wrap_model", "broadcast_state", "accumulation_ok"]
    for case in cases:
        try:
            globals()["case_" + case]()
        except Exception as exc:
            print(f"CASE {case}: {type(exc).__name__}: {exc}", flush=True)
    print("SURVIVED", flush=True)


if __name__ == "__main__":
    globals()["case_" + sys.argv[1]]()
    sys.exit(0)

import pytest  # noqa: E402
pytestmark = pytest.mark.mpi  # starts real Open MPI ranks

from conftest import PYTHON  # noqa: E402

CAUGHT = {
    "no_init": ["UsageError", "call eddis.init() first"],
    "original_optimizer_step": ["UsageError", "original optimizer", "eddis.DistributedOptimizer("],
    "backward_twice": ["UsageError", "backward_passes_per_step=1"],
    "zero_grad_before_step": ["UsageError", "move it before backward()"],
    "update_by_hand": ["UsageError", "optimizer.step() or optimizer.synchronize() was not called after "
                       "loss.backward()", "call optimizer.synchronize() first"],
    "wrap_model": ["ConfigError", "you passed the model"],
}


@pytest.fixture(scope="module")
def caught_run(request):
    from conftest import python_env, run_process_group
    import os
    import tempfile
    import shutil

    shm = tempfile.mkdtemp(prefix="eddis-test-ompi-", dir="/dev/shm")
    env = python_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                      "OMPI_MCA_btl_vader_backing_directory": shm, "EDDIS_MODE": "allreduce"})
    try:
        return run_process_group(["mpirun", "--oversubscribe", "-n", "2", PYTHON, __file__, "all_caught"],
                                 env, 150)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", sorted(CAUGHT))
def test_misuse_error_names_problem_and_fix(caught_run, case):
    # mpirun may glue the two ranks' lines together: split on the marker, not on newlines
    marker = f"CASE {case}: "
    parts = [p.split("CASE ")[0] for p in caught_run.stdout.split(marker)[1:]]
    assert len(parts) == 2, f"expected the error on both ranks:\n{caught_run.stdout}\n{caught_run.stderr[-2000:]}"
    for part in parts:
        for word in CAUGHT[case]:
            assert word in part, f"{word!r} missing from {part!r}"


@pytest.mark.timeout(180)
def test_ranks_survive_caught_misuse_and_accumulation_works(caught_run):
    assert caught_run.returncode == 0, caught_run.stderr[-3000:]
    assert caught_run.stdout.count("ACCUMULATION OK") == 2
    assert caught_run.stdout.count("SURVIVED") == 2


@pytest.mark.timeout(180)
def test_broadcast_parameters_and_optimizer_state(caught_run):
    assert caught_run.stdout.count("BROADCAST spread=0.0") == 2, caught_run.stdout


@pytest.mark.timeout(90)
def test_shape_mismatch_fails_every_rank_fast(run_mpi):
    proc = run_mpi(2, [PYTHON, __file__, "shapes_differ"], env={"EDDIS_MODE": "allreduce"}, timeout=80)
    assert proc.returncode != 0
    for word in ["ConfigError", "differs between ranks", "0.weight", "rank 1",
                 "Build the same model on every rank"]:
        assert word in proc.stderr, f"{word!r} missing from:\n{proc.stderr[-3000:]}"
