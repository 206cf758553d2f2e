"""An LBFGS script converted by docs/pytorch-conversion.md, with no line beyond what the manual
says (examples/torch_lbfgs.py: its closure as written for one process), trains to the loss of
one process through the whole Slurm path: eddis submit -> hetjob over n1 (a100) and n2 (v100)
-> smb-servers on both nodes -> 4 ranks in mode sync (the hierarchy across the two nodes).

The reference is the same script run as one plain process; every step's loss (the whole
training set's, printed by rank 0) and the final loss must agree to float32 rounding."""
import re
import subprocess

import pytest

from conftest import PYTHON, REPO, python_env
from launch_helpers import wait_job_end
from test_launch_slurm import assert_job_left_nothing, job_env  # noqa: F401 (fixture)

EXAMPLE = REPO / "examples" / "torch_lbfgs.py"
STEPS = 12
import torch  # noqa: F401,E402  (required: missing is a failure, not a skip)
import sklearn  # noqa: F401,E402  (required: missing is a failure, not a skip)


def losses(text, prefix=""):
    steps = [float(x) for x in re.findall(rf"^{re.escape(prefix)}step +\d+  train loss ([\d.]+)$", text, re.M)]
    final = re.search(rf"^{re.escape(prefix)}ranks (\d+)  final train loss ([\d.]+)  test accuracy", text, re.M)
    assert len(steps) == STEPS and final, text
    return steps, int(final.group(1)), float(final.group(2))


@pytest.mark.timeout(480)
def test_lbfgs_example_trains_to_the_single_process_loss(slurm_cluster, job_env, tmp_path):
    out = tmp_path / "job.out"
    proc = slurm_cluster.run([PYTHON, "-m", "eddis.cli", "submit", "--gpus", "a100:2,v100:2", "--time",
                              "00:10:00", "--mode", "sync", "--output", out, EXAMPLE, "--steps", str(STEPS)],
                             env=job_env, timeout=60)
    job_id = re.search(r"Submitted EDDIS job (\d+)", proc.stdout).group(1)
    state, code = wait_job_end(slurm_cluster, job_id, 360, out)
    text = out.read_text()
    assert (state, code) == ("COMPLETED", "0:0"), text
    steps, ranks, final = losses(text, "[0@n1] ")
    assert ranks == 4, text
    assert_job_left_nothing(job_env["EDDIS_RUN_DIR"], job_id)

    alone = subprocess.run([PYTHON, EXAMPLE, "--steps", str(STEPS)], capture_output=True, text=True,
                           timeout=240, cwd=tmp_path,
                           env=python_env({"OMP_NUM_THREADS": "1", "EDDIS_RUN_DIR": str(tmp_path / "alone"),
                                           "SMB_MEMORY": "64M"}))
    assert alone.returncode == 0, alone.stdout + alone.stderr
    ref_steps, ref_ranks, ref_final = losses(alone.stdout)
    assert ref_ranks == 1
    assert all(abs(a - b) <= 1e-5 for a, b in zip(steps, ref_steps)), (steps, ref_steps)
    assert abs(final - ref_final) <= 1e-5 * ref_final, (final, ref_final)
    assert steps[-1] < 0.2 * steps[0], steps   # it trained
