"""examples/torch_train.py trains the digits classifier to the stated accuracy on 2 ranks.

Stated: at least 0.95 test accuracy after 8 epochs (global batch 64), in mode
sync through SMB, both under a plain ``mpirun`` (embedded SMB server) and under
``eddis-train --local`` (an smb-server started by the launcher), the latter
with unequal per-rank shares of every batch.
"""
import re

import pytest
pytestmark = pytest.mark.mpi  # starts real Open MPI ranks

from conftest import PYTHON, REPO, python_env, run_process_group

EXAMPLE = REPO / "examples" / "torch_train.py"
TARGET = 0.95


def _accuracy(output):
    found = re.findall(r"test accuracy: ([0-9.]+)", output)
    assert found, output
    return float(found[-1])


@pytest.mark.timeout(300)
def test_example_reaches_target_accuracy_under_mpirun(run_mpi):
    import sklearn  # noqa: F401  (required: missing is a failure, not a skip)
    proc = run_mpi(2, [PYTHON, EXAMPLE, "--epochs", "8"], env={"EDDIS_MODE": "sync"}, timeout=280, check=True)
    assert "mode sync" in proc.stdout
    assert _accuracy(proc.stdout) >= TARGET, proc.stdout


@pytest.mark.timeout(300)
def test_example_with_unequal_shares_under_eddis_train_local():
    import sklearn  # noqa: F401  (required: missing is a failure, not a skip)
    env = python_env({"EDDIS_MODE": "sync", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                      "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    proc = run_process_group([PYTHON, "-m", "eddis.launch.train", "--local", "-n", "2", str(EXAMPLE),
                              "--epochs", "8", "--shares", "1,3"], env, 280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[0@" in proc.stdout and "mode sync" in proc.stdout
    assert _accuracy(proc.stdout) >= TARGET, proc.stdout
