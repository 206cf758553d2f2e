"""The Keras example through the Slurm path: ``sbatch scripts/eddis_job.sh
examples/tf_train.py`` on the local two-node cluster -> hetjob over n1 (a100)
and n2 (v100) -> one smb-server per node -> 4 TensorFlow ranks under
``srun eddis-train``, in mode sync (gradients averaged through the SMB servers
of both nodes) and in mode hybrid (sync inside each hetjob component, elastic
averaging between them).

Stated figure: after 2 epochs (sync) or as many iterations (hybrid) the test
accuracy printed by rank 0 is at least 0.80 (the example reaches about 0.97
after its default 15 epochs)."""
import re

import pytest

from conftest import REPO
from launch_helpers import wait_job_end
from test_launch_slurm import EXPECTED, assert_job_left_nothing, job_env, sbatch  # noqa: F401 (fixture)

EXAMPLE = REPO / "examples" / "tf_train.py"
import tensorflow  # noqa: F401  (required: missing is a failure, not a skip)
import sklearn  # noqa: F401  (required: missing is a failure, not a skip)

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
          "TF_ENABLE_ONEDNN_OPTS": "0"}


@pytest.mark.timeout(480)
@pytest.mark.parametrize("mode", ["sync", "hybrid"])
def test_keras_example_trains_in_a_hetjob(slurm_cluster, job_env, tmp_path, mode):
    out = tmp_path / "job.out"
    env = dict(job_env, **TF_ENV)
    job_id = sbatch(slurm_cluster, env, out, EXAMPLE, "--epochs", "2", "--mode", mode)
    state, code = wait_job_end(slurm_cluster, job_id, 420, out)
    text = out.read_text()
    assert (state, code) == ("COMPLETED", "0:0"), text
    for rank, (host, _, group, gpu_type, _) in EXPECTED.items():
        assert re.search(rf"^\[{rank}@{host}\] eddis-train: rank {rank}/4 .* group {group}/2 .*"
                         rf"gpu {gpu_type}:", text, re.M), text
    assert re.search(rf"^\[0@n1\] ranks 4  mode {mode}  loop fit ", text, re.M), text
    accuracy = float(re.search(r"^\[0@n1\] test accuracy: ([\d.]+)", text, re.M).group(1))
    assert accuracy >= 0.80, text
    if mode == "hybrid":
        counts = re.search(r"^\[0@n1\] iterations by rank: \[(\d+), (\d+), (\d+), (\d+)\]", text, re.M)
        c = [int(x) for x in counts.groups()]
        assert c[0] == c[1] and c[2] == c[3], text   # each hetjob component steps together
        assert sum(c) == 2 * (1437 // 64) * 4, text  # the example's default total for 2 epochs
    assert_job_left_nothing(job_env["EDDIS_RUN_DIR"], job_id)
