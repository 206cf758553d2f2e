"""`eddis submit` against the real local Slurm cluster (partitions all, a100, v100 from sinfo)."""
import pytest

from conftest import PYTHON

GOLDEN = __import__("pathlib").Path(__file__).resolve().parent / "golden"


def eddis(cluster, *args, check=False):
    return cluster.run([PYTHON, "-m", "eddis.cli", *args], timeout=60, check=check)


@pytest.mark.timeout(120)
def test_dry_run_matches_golden_file(slurm_cluster):
    proc = eddis(slurm_cluster, "submit", "--gpus", "a100:2,v100:2", "--time", "00:10:00", "--mode", "sync",
                 "--dry-run", "train.py", "--epochs", "1", check=True)
    assert proc.stdout == (GOLDEN / "submit_a100_v100_dev_cluster.sh").read_text()


@pytest.mark.timeout(120)
def test_nonexistent_partition_fails_before_submitting_and_lists_partitions(slurm_cluster):
    name = "eddis-test-no-such-partition"
    proc = eddis(slurm_cluster, "submit", "--gpus", "h100:2", "--job-name", name, "train.py")
    assert proc.returncode != 0
    assert "no partition named 'h100'" in proc.stderr
    for listed in ("all (a100 x2/node, v100 x2/node; 2 nodes)", "a100 (a100 x2/node; 1 node)",
                   "v100 (v100 x2/node; 1 node)"):
        assert listed in proc.stderr
    queue = slurm_cluster.run(["squeue", "-h", "-n", name, "-o", "%i"], timeout=30)
    assert queue.stdout.strip() == "", "a job was submitted although the partition does not exist"


@pytest.mark.timeout(120)
def test_too_many_gpus_for_the_partition_is_refused(slurm_cluster):
    proc = eddis(slurm_cluster, "submit", "--gpus", "v100:4", "--dry-run", "train.py")
    assert proc.returncode != 0
    assert ("--gpus v100:4 is more than partition v100 has: 2 v100 GPUs (1 node x 2 per node); "
            "ask for one of 1, 2") in proc.stderr


@pytest.mark.timeout(120)
def test_far_too_many_gpus_names_the_partition_size_not_a_node_multiple(slurm_cluster):
    """a100:99 on the one-node, two-GPU a100 partition once asked for 'a multiple of 50 GPUs'."""
    proc = eddis(slurm_cluster, "submit", "--gpus", "a100:99", "--dry-run", "train.py")
    assert proc.returncode != 0
    assert ("--gpus a100:99 is more than partition a100 has: 2 a100 GPUs (1 node x 2 per node); "
            "ask for one of 1, 2") in proc.stderr
    assert "multiple of" not in proc.stderr


def _queued(cluster, name):
    return cluster.run(["squeue", "-h", "-n", name, "-o", "%i"], timeout=30).stdout.strip()


@pytest.mark.timeout(120)
def test_a_missing_training_script_is_refused_before_submitting(slurm_cluster, tmp_path):
    name = "eddis-test-missing-script"
    proc = slurm_cluster.run([PYTHON, "-m", "eddis.cli", "submit", "--gpus", "a100:1", "--job-name", name,
                              "no_such_train.py", "--epochs", "1"], timeout=60, check=False, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (f"the training script no_such_train.py does not exist (working directory {tmp_path}); "
            "nothing was submitted") in proc.stderr
    assert _queued(slurm_cluster, name) == "", "a job was submitted although its script does not exist"
    # a dry run prints the script, and says that the job would fail
    proc = slurm_cluster.run([PYTHON, "-m", "eddis.cli", "submit", "--gpus", "a100:1", "--dry-run",
                              "no_such_train.py"], timeout=60, check=False, cwd=tmp_path)
    assert proc.returncode == 0 and "exec eddis-train --job" in proc.stdout
    assert "warning: the training script no_such_train.py does not exist" in proc.stderr


@pytest.mark.timeout(120)
def test_a_job_name_with_a_newline_is_refused_and_nothing_is_submitted(slurm_cluster, tmp_path):
    name = "eddis-test-injected"
    (tmp_path / "train.py").write_text("print('never run')\n")
    proc = slurm_cluster.run([PYTHON, "-m", "eddis.cli", "submit", "--gpus", "a100:1", "--job-name",
                              f"{name}\necho INJECTED", "train.py"], timeout=60, check=False, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (f"job_name (eddis submit --job-name) '{name}\\necho INJECTED' holds the control character '\\n'"
            in proc.stderr)
    assert "Submitted" not in proc.stdout
    assert _queued(slurm_cluster, name) == "", "the job was submitted with the injected line"
