"""hybrid across the two partitions of the local Slurm cluster: ``eddis submit --gpus
a100:2,v100:2 --mode hybrid`` makes one hetjob component per GPU type (n1: a100, n2: v100),
so the hybrid groups are the components: sync inside each, EASGD between them through the
SMB servers of both nodes. The v100 group is slowed 4x (EDDIS_SIMULATE_SLOWDOWN=g1:4.0, the
testing aid), so the a100 group does more iterations; the job uses exactly the total and the
centre (the final model, written once by save_checkpoint) reaches 0.90 test accuracy."""
import re

import pytest

from conftest import PYTHON, REPO
from launch_helpers import wait_job_end
from test_launch_slurm import assert_job_left_nothing, job_env  # noqa: F401 (fixture)

EXAMPLE = REPO / "examples" / "hetero_train.py"
TOTAL = 800
import torch  # noqa: F401  (required: missing is a failure, not a skip)
import eddis.smb.server  # noqa: F401  (required: missing is a failure, not a skip)


@pytest.mark.timeout(480)
def test_hybrid_groups_are_the_hetjob_components(slurm_cluster, job_env, tmp_path):
    import torch

    out = tmp_path / "job.out"
    checkpoint = tmp_path / "model.pt"
    env = dict(job_env, EDDIS_SIMULATE_SLOWDOWN="g1:4.0")
    proc = slurm_cluster.run([PYTHON, "-m", "eddis.cli", "submit", "--gpus", "a100:2,v100:2",
                              "--time", "00:10:00", "--mode", "hybrid", "--output", out, EXAMPLE,
                              "--mode", "hybrid", "--iterations", TOTAL, "--checkpoint", checkpoint],
                             env=env, timeout=60)
    job_id = re.search(r"Submitted EDDIS job (\d+)", proc.stdout).group(1)
    state, code = wait_job_end(slurm_cluster, job_id, 420, out)
    text = out.read_text()
    assert (state, code) == ("COMPLETED", "0:0"), text
    for rank, group in ((0, 0), (1, 0), (2, 1), (3, 1)):
        assert re.search(rf"^\[{rank}@n{group + 1}\] eddis-train: rank {rank}/4 local \d/2 group {group}/2 ",
                         text, re.M), text
    assert re.search(r"^\[[23]@n2\] .*SimulatedSlowdownWarning.*testing aid", text, re.M), text
    line = re.search(r"^\[0@n1\] mode hybrid: [\d.]+ s, iterations per rank \[(\d+), (\d+), (\d+), (\d+)\], "
                     r"test accuracy ([\d.]+), model in (\S+)$", text, re.M)
    assert line, text
    counts = [int(line.group(i)) for i in range(1, 5)]
    assert counts[0] == counts[1] and counts[2] == counts[3], counts   # sync inside a group
    assert sum(counts) == TOTAL, counts                               # exactly the total
    assert counts[0] > counts[2], counts                              # the a100 group did more
    assert float(line.group(5)) >= 0.90
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["mode"] == "hybrid" and saved["iterations"] == TOTAL
    assert_job_left_nothing(job_env["EDDIS_RUN_DIR"], job_id)
