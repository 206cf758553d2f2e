"""Misuse of the heterogeneity API gives an error naming the problem and the fix, never a
hang. All cases run in one 2-rank MPI job (starting torch costs more than the cases); each
case must raise on every rank and leave the ranks able to run the next one.

This file is also the worker: ``mpirun -n 2 python tests/test_hetero_misuse.py OUT.json``.
"""
import json
import os
import sys


def _model():
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _wrap(**kwargs):
    import eddis.torch as eddis

    model, opt = _model()
    return model, eddis.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kwargs)


def case_balance_with_easgd():
    _wrap(mode="easgd", balance=True)


def case_balance_weights_wrong_length():
    _wrap(mode="sync", balance=[1, 2, 3])


def case_balance_hybrid_weights_wrong_length():
    # a hybrid group takes its own ranks' weights from the list of every rank's
    _wrap(mode="hybrid", balance=[1, 2, 3])


def _wrap_with_slowdown(spec):
    os.environ["EDDIS_SIMULATE_SLOWDOWN"] = spec
    try:
        _wrap(mode="sync")
    finally:
        del os.environ["EDDIS_SIMULATE_SLOWDOWN"]


def case_slowdown_typo():
    _wrap_with_slowdown("1:half")


def case_slowdown_unknown_rank():
    _wrap_with_slowdown("5:2")


def case_no_total():
    import eddis.torch as eddis

    _, opt = _wrap(mode="easgd")
    try:
        eddis.should_stop()
    finally:
        opt.close()


def case_configure_twice():
    import eddis.torch as eddis

    _, opt = _wrap(mode="easgd")
    try:
        eddis.configure_progress(total=10)
        eddis.should_stop()
        eddis.configure_progress(total=10)
    finally:
        from eddis.core.progress import counter as progress

        progress.reset()
        opt.close()


def case_counter_before_optimizer():
    import eddis.torch as eddis

    opt = None
    _, first = _wrap(mode="sync")
    first.close()
    eddis.configure_progress(total=10)   # set up for the newest optimizer's mode: sync
    try:
        _, opt = _wrap(mode="easgd")
    finally:
        from eddis.core.progress import counter as progress

        progress.reset()
        if opt is not None:
            opt.close()


def case_checkpoint_plain_optimizer():
    import torch
    import eddis.torch as eddis

    model, opt = _model()
    eddis.save_checkpoint("/nonexistent/x.pt", model, torch.optim.SGD(model.parameters(), lr=0.1))


def case_checkpoint_unwritable():
    import eddis.torch as eddis

    model, opt = _wrap(mode="sync")
    try:
        eddis.save_checkpoint("/nonexistent-dir/model.pt", model, opt)
    finally:
        opt.close()


def case_global_batch_too_small():
    import eddis.torch as eddis

    _, opt = _wrap(mode="sync", balance=True)
    try:
        eddis.balanced_slice(1)
    finally:
        opt.close()


def case_unit_leader_stalls():
    """Rank 0 waits for its unit's leader (rank 1 here), which never claims: a timeout
    that names the leader, not a hang."""
    from eddis.core.comm import collectives, connection, runtime
    from eddis.core.progress import counter as progress

    rank = runtime.rank()
    unit = runtime.comm().Split(0, runtime.size() - 1 - rank)   # world rank 1 leads
    try:
        ctl = progress.ProgressController(connection.smb_client(), 10, rank, runtime.size(),
                                          lockstep_comm=unit, name="misuse.stalled", timeout=1.0)
        if rank == 0:
            ctl.should_stop()
        else:
            collectives.barrier(what="the leader stalls until the member gave up")
            raise progress.ProgressTimeoutError("the leader stalled on purpose")
    finally:
        if rank == 0:
            collectives.barrier(what="the leader stalls until the member gave up")
        unit.Free()


CASES = [name[5:] for name in list(globals()) if name.startswith("case_")]


def main(out):
    import eddis.torch as eddis

    os.environ.pop("EDDIS_TOTAL_ITERATIONS", None)
    eddis.init()
    results = {}
    for name in CASES:
        try:
            globals()["case_" + name]()
            results[name] = None
        except Exception as exc:
            results[name] = [type(exc).__name__, [c.__name__ for c in type(exc).__mro__], str(exc)]
        eddis.barrier()   # both ranks are still in step
    if eddis.rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    eddis.shutdown()


if __name__ != "__main__":
    import pytest
    pytestmark = pytest.mark.mpi  # starts real Open MPI ranks

    from conftest import PYTHON

    EXPECTED = {   # case: (exception class in the MRO, words the message must hold)
        "balance_with_easgd": ("ConfigError", ["balance=True", "mode='sync'"]),
        "balance_weights_wrong_length": ("ConfigError", ["one positive number per rank (2)"]),
        "balance_hybrid_weights_wrong_length": ("ConfigError", ["one positive number per rank (2)"]),
        "slowdown_typo": ("ConfigError", ["EDDIS_SIMULATE_SLOWDOWN", "'half' is not a number", "e.g."]),
        "slowdown_unknown_rank": ("ConfigError", ["rank(s) [5]", "ranks 0..1"]),
        "no_total": ("ConfigError", ["EDDIS_TOTAL_ITERATIONS", "configure_progress(total=N)"]),
        "configure_twice": ("UsageError", ["already configured", "once per training run"]),
        "counter_before_optimizer": ("UsageError", ["set up for mode 'sync'", "Create the DistributedOptimizer first"]),
        "checkpoint_plain_optimizer": ("ConfigError", ["eddis.DistributedOptimizer(...)"]),
        "checkpoint_unwritable": ("OSError", ["failed on rank 0", "/nonexistent-dir/model.pt"]),
        "global_batch_too_small": ("ConfigError", ["at least one sample per rank (2)"]),
        "unit_leader_stalls": ("ProgressTimeoutError", ["rank 0 waited 1 s for rank 1", "leader",
                                                         "EDDIS_COMM_TIMEOUT"]),
    }

    @pytest.fixture(scope="module")
    def outcomes(tmp_path_factory):
        from conftest import python_env, run_process_group
        import shutil
        import tempfile

        out = tmp_path_factory.mktemp("misuse") / "out.json"
        shm = tempfile.mkdtemp(prefix="eddis-test-ompi-", dir="/dev/shm")
        env = python_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                          "OMPI_MCA_btl_vader_backing_directory": shm, "EDDIS_COMM_TIMEOUT": "60"})
        try:
            proc = run_process_group(["mpirun", "--oversubscribe", "-n", "2", PYTHON, os.path.abspath(__file__),
                                      str(out)], env, 180, what="mpirun -n 2 test_hetero_misuse.py")
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return json.loads(out.read_text())

    @pytest.mark.timeout(200)
    @pytest.mark.parametrize("case", sorted(EXPECTED))
    def test_misuse_is_a_clear_error(outcomes, case):
        assert outcomes[case] is not None, f"{case} raised nothing"
        name, mro, message = outcomes[case]
        kind, words = EXPECTED[case]
        assert kind in mro, (name, message)
        for word in words:
            assert word in message, (word, message)

    def test_every_case_is_checked():
        assert sorted(CASES) == sorted(EXPECTED)


if __name__ == "__main__":
    main(sys.argv[1])
