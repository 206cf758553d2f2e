"""A converted script fails loudly instead of drifting: in the synchronous modes the ranks
compare a checksum of their parameters every EDDIS_CHECK_PARAMETERS steps and at shutdown.

The worker cases run on 2 real MPI ranks: ``mpirun -n 2 python tests/test_parameter_agreement.py CASE``.
"""
import sys


def _torch_loop(wrap, extra_unwrapped=False, steps=6):
    import torch
    import eddis.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    head, body = list(model[2].parameters()), list(model[0].parameters())
    opt = torch.optim.SGD(body if extra_unwrapped else model.parameters(), lr=0.1)
    if wrap:
        opt = hvd.DistributedOptimizer(opt)
    other = torch.optim.SGD(head, lr=0.1) if extra_unwrapped else None
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.randn(steps, 8, 6, generator=torch.Generator().manual_seed(100 + hvd.rank()))
    for x in data:  # each rank its own data: only the averaging keeps the models equal
        opt.zero_grad()
        if other is not None:
            other.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if other is not None:
            other.step()
    print(f"LOOP DONE rank {hvd.rank()}", flush=True)


def case_torch_nothing_wrapped():
    _torch_loop(wrap=False)


def case_torch_wrapped():
    _torch_loop(wrap=True)


def case_torch_second_optimizer_unwrapped():
    _torch_loop(wrap=True, extra_unwrapped=True)


def case_torch_nothing_wrapped_explicit_shutdown():
    import eddis.torch as hvd

    _torch_loop(wrap=False)
    try:
        hvd.shutdown()
    except hvd_errors().ParameterDriftError as exc:
        print(f"CAUGHT {type(exc).__name__}", flush=True)


def hvd_errors():
    import eddis.errors

    return eddis.errors


def case_keras_nothing_wrapped():
    import keras
    import numpy as np
    import eddis.tensorflow.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(hvd.rank())
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    rng = np.random.default_rng(hvd.rank())
    x, y = rng.normal(size=(32, 6)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    print(f"LOOP DONE rank {hvd.rank()}", flush=True)


if __name__ == "__main__":
    globals()["case_" + sys.argv[1]]()
    sys.exit(0)

import pytest  # noqa: E402
pytestmark = pytest.mark.mpi  # starts real Open MPI ranks

from conftest import PYTHON  # noqa: E402

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}


def run_case(run_mpi, case, **env):
    return run_mpi(2, [PYTHON, __file__, case], env={"EDDIS_MODE": "allreduce", **TF_ENV, **env}, timeout=150)


@pytest.mark.timeout(180)
def test_nothing_wrapped_fails_at_exit_naming_the_fix(run_mpi):
    proc = run_case(run_mpi, "torch_nothing_wrapped")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert proc.stdout.count("LOOP DONE") == 2                # the loop ran; the check came at exit
    assert "ParameterDriftError" in proc.stderr and "at shutdown" in proc.stderr, proc.stderr[-3000:]
    assert "No eddis.DistributedOptimizer" in proc.stderr and "Wrap the optimizer" in proc.stderr


@pytest.mark.timeout(180)
def test_explicit_shutdown_raises_the_drift(run_mpi):
    proc = run_case(run_mpi, "torch_nothing_wrapped_explicit_shutdown")
    assert proc.stdout.count("CAUGHT ParameterDriftError") == 2, proc.stdout + proc.stderr[-3000:]


@pytest.mark.timeout(180)
def test_the_check_can_be_turned_off(run_mpi):
    proc = run_case(run_mpi, "torch_nothing_wrapped", EDDIS_CHECK_PARAMETERS="0")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["allreduce", "sync"])
def test_a_wrapped_run_checked_every_step_passes(run_mpi, mode):
    proc = run_case(run_mpi, "torch_wrapped", EDDIS_MODE=mode, EDDIS_CHECK_PARAMETERS="1")
    assert proc.returncode == 0 and proc.stdout.count("LOOP DONE") == 2, proc.stdout + proc.stderr[-3000:]


@pytest.mark.timeout(180)
def test_an_unwrapped_second_optimizer_fails_mid_run(run_mpi):
    proc = run_case(run_mpi, "torch_second_optimizer_unwrapped", EDDIS_CHECK_PARAMETERS="2")
    assert proc.returncode != 0
    assert "LOOP DONE" not in proc.stdout                    # caught at step 2, not at the end
    assert "at step 2" in proc.stderr and "an optimizer that was not wrapped" in proc.stderr, \
        proc.stderr[-3000:]


@pytest.mark.timeout(240)
def test_keras_fit_with_nothing_wrapped_fails(run_mpi):
    proc = run_case(run_mpi, "keras_nothing_wrapped", EDDIS_CHECK_PARAMETERS="3")
    assert proc.returncode != 0
    assert "at step 3" in proc.stderr and "No eddis.DistributedOptimizer" in proc.stderr, proc.stderr[-3000:]
