"""A damaged elastic commit is never restored: the commit before it is (issue 44), on real
ranks (eddis-train --local -n 2, sync, the Horovod-style torch script of
tests/horovod_style/torch_elastic_sync_style.py, which commits at steps 4, 8, 14, 18 and 20).

Stated figures: rank 1 flips 64 bytes of the newest commit's rank-00000.pt (step 14) and dies;
the restart (EDDIS_MAX_RESTARTS=1) names that commit, why it fails and that it was set aside,
restores the commit of step 8 (epoch 0, batch 8) on both ranks and ends with the parameters of
the uninterrupted run. A new job given the commits in EDDIS_CHECKPOINT_DIR does the same; with
every commit damaged it fails with CheckpointCorruptError on both ranks, naming each commit,
before any rank trained a batch, and leaves the commits in place.
"""
import re
import shutil

import pytest

from conftest import PYTHON, run_process_group
from test_checkpoint_corrupt import flipped, missing, truncated
from test_checkpoint_resume import complete, env_for
from test_restart_requeue import ELASTIC_SYNC_SCRIPT, assert_same_parameters, launch_elastic_sync

pytestmark = pytest.mark.mpi  # starts real Open MPI ranks

STARTS = r"attempt (\d) starts at epoch (\d) batch (\d)"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final parameters of the run that nothing interrupted."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    return launch_elastic_sync(tmp_path, ELASTIC_SYNC_SCRIPT, "reference")[1]


def assert_took_the_commit_before(text, commits):
    assert f"checkpoint {commits / 'ckpt-00000014'} fails verification, skipped (set aside as " \
           "ckpt-00000014.corrupt)" in text, text[-6000:]
    assert "rank-00000.pt has SHA-256" in text, text[-6000:]
    assert f"resuming from {commits / 'ckpt-00000008'} (step 8), the newest elastic commit that verifies" in text


@pytest.mark.timeout(400)
def test_a_restart_whose_newest_commit_is_damaged_goes_on_from_the_one_before(tmp_path, uninterrupted):
    commits = tmp_path / "killed" / "run" / "elastic-commits"
    text, got = launch_elastic_sync(tmp_path, ELASTIC_SYNC_SCRIPT, "killed", ELASTIC_TEST_KILL_AFTER="1:4",
                                    ELASTIC_TEST_DAMAGE_NEWEST=commits)
    assert re.search(r"ROOT CAUSE: rank 1 on host \S+ was killed by signal 9 \(SIGKILL\)", text), text[-6000:]
    assert text.count("restarting the smb-server and the ranks (restart 1 of 1)") == 1, text[-6000:]
    assert_took_the_commit_before(text, commits)
    assert sorted(re.findall(STARTS, text)) == [("0", "0", "0"), ("0", "0", "0"), ("1", "0", "8"),
                                                 ("1", "0", "8")], text[-6000:]
    assert_same_parameters(got, uninterrupted)
    assert not commits.exists()    # the finished run removed them, the set-aside one too


@pytest.mark.timeout(500)
def test_a_new_job_resumes_the_commit_before_a_damaged_one_and_fails_on_every_rank_without_one(
        tmp_path, uninterrupted):
    commits = tmp_path / "commits"
    first = run_process_group(["eddis-train", "--local", "-n", "2", PYTHON, str(ELASTIC_SYNC_SCRIPT),
                               str(tmp_path / "first.npz")],
                              env_for(tmp_path / "first", EDDIS_MODE="sync", EDDIS_CHECKPOINT_DIR=commits,
                                      EDDIS_CHECKPOINT_KEEP=0, ELASTIC_TEST_KILL_AFTER="1:4"), 150)
    assert first.returncode != 0, first.stderr[-4000:]
    assert complete(commits) == ["ckpt-00000004", "ckpt-00000008", "ckpt-00000014"]

    damaged_newest = tmp_path / "damaged-newest"
    shutil.copytree(commits, damaged_newest)
    flipped(damaged_newest / "ckpt-00000014")
    text, got = launch_elastic_sync(tmp_path, ELASTIC_SYNC_SCRIPT, "resumed", EDDIS_CHECKPOINT_DIR=damaged_newest)
    assert_took_the_commit_before(text, damaged_newest)
    assert sorted(re.findall(STARTS, text)) == [("0", "0", "8"), ("0", "0", "8")], text[-6000:]
    assert_same_parameters(got, uninterrupted)

    said = [damage(commits / name) for damage, name in ((flipped, "ckpt-00000014"), (truncated, "ckpt-00000008"),
                                                         (missing, "ckpt-00000004"))]
    proc = run_process_group(["eddis-train", "--local", "-n", "2", PYTHON, str(ELASTIC_SYNC_SCRIPT),
                              str(tmp_path / "none.npz")],
                             env_for(tmp_path / "none", EDDIS_MODE="sync", EDDIS_CHECKPOINT_DIR=commits), 150)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-6000:]
    for rank in (0, 1):
        assert re.search(rf"^\[{rank}@\S+\] \S*CheckpointCorruptError: none of the 3 checkpoints in "
                         rf"{re.escape(str(commits))} verifies", text, re.M), text[-6000:]
    assert all(s in text for s in said), text[-6000:]
    assert not re.findall(STARTS, text), text[-6000:]          # no rank got to train
    assert not (tmp_path / "none.npz").exists()
    assert complete(commits) == ["ckpt-00000004", "ckpt-00000008", "ckpt-00000014"]   # all left in place
