"""The PyTorch example through the whole Slurm path: eddis submit -> hetjob over n1 (a100) and
n2 (v100) -> smb-servers on both nodes -> 4 ranks in sync mode through SMB. Then the same job
with one rank SIGKILLed mid-training."""
import os
import re
import signal
from pathlib import Path

import pytest

from conftest import PYTHON, REPO
from launch_helpers import current_rank_records, wait_job_end, wait_until
from test_launch_slurm import EXPECTED, assert_job_left_nothing, job_env  # noqa: F401 (fixture)

EXAMPLE = REPO / "examples" / "torch_train.py"
import torch  # noqa: F401  (required: missing is a failure, not a skip)
import sklearn  # noqa: F401  (required: missing is a failure, not a skip)


def submit(cluster, env, out, *train_args):
    proc = cluster.run([PYTHON, "-m", "eddis.cli", "submit", "--gpus", "a100:2,v100:2", "--time", "00:10:00",
                        "--mode", "sync", "--output", out, EXAMPLE, *map(str, train_args)], env=env, timeout=60)
    return re.search(r"Submitted EDDIS job (\d+)", proc.stdout).group(1)


@pytest.mark.timeout(420)
def test_hetjob_trains_the_pytorch_example(slurm_cluster, job_env, tmp_path):
    out = tmp_path / "job.out"
    job_id = submit(slurm_cluster, job_env, out, "--epochs", "2")
    state, code = wait_job_end(slurm_cluster, job_id, 360, out)
    text = out.read_text()
    assert (state, code) == ("COMPLETED", "0:0"), text
    for rank, (host, local, group, gpu_type, gpu) in EXPECTED.items():
        assert re.search(rf"^\[{rank}@{host}\] eddis-train: rank {rank}/4 local {local}/2 group {group}/2 "
                         rf"host {host} gpu {gpu_type}:{gpu} CUDA_VISIBLE_DEVICES={gpu}$", text, re.M), text
    losses = [float(x) for x in re.findall(r"^\[0@n1\] epoch +\d+ +train loss ([\d.]+)", text, re.M)]
    assert len(losses) == 2 and losses[1] < losses[0], text
    assert re.search(r"^\[0@n1\] ranks 4  mode sync ", text, re.M), text
    assert "smb-servers ready: 0@" in text and ", 1@" in text
    assert_job_left_nothing(job_env["EDDIS_RUN_DIR"], job_id)


@pytest.mark.timeout(420)
def test_killing_one_pytorch_rank_ends_the_job_with_a_report(slurm_cluster, job_env, tmp_path):
    out = tmp_path / "job.out"
    job_id = submit(slurm_cluster, job_env, out, "--epochs", "200")
    run_dir = Path(job_env["EDDIS_RUN_DIR"])
    wait_until(lambda: out.exists() and re.search(r"^\[0@n1\] epoch  1 ", out.read_text(), re.M), 300,
               interval=1, what="the first epoch")
    victim = wait_until(lambda: current_rank_records(run_dir, 4), 30, what="the ranks' records")[3]
    os.kill(victim["trainer_pid"], signal.SIGKILL)
    state, code = wait_job_end(slurm_cluster, job_id, 60, out)  # the acceptance bound: under 60 s
    text = out.read_text()
    assert state == "FAILED" and code != "0:0", text
    assert re.search(r"ROOT CAUSE: rank 3 on host n2 was killed by signal 9 \(SIGKILL\)", text), text
    assert "epoch 200" not in text
    assert_job_left_nothing(run_dir, job_id)
