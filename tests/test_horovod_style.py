"""Horovod-style scripts (tests/horovod_style/, written here in the way Horovod's documentation
shows, not Horovod's code) run under `eddis-train --local -n 2` with only the import changed:
eddis.torch, eddis.tensorflow and eddis.tensorflow.keras as hvd. Each script checks what it
uses (the ranks' models agree, metrics are averaged, the *_built answers) and prints a line."""
import pytest
pytestmark = pytest.mark.mpi  # starts real Open MPI ranks

from conftest import REPO
from test_launch_local import eddis_train

import eddis.smb.server  # noqa: F401  (required: missing is a failure, not a skip)

SCRIPTS = REPO / "tests" / "horovod_style"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("script", ["torch_style.py", "tensorflow_style.py", "keras_style.py",
                                    "torch_join_style.py"])
def test_horovod_style_script_runs_on_two_ranks(tmp_path, script):
    proc = eddis_train(tmp_path, "--local", "-n", "2", SCRIPTS / script, timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    for rank in (0, 1):
        assert f"HOROVOD-STYLE OK rank {rank}" in output, output[-6000:]
