"""Checkpoint and resume on real ranks (eddis-train --local, real smb-servers, torch CPU).

Stated figures: a sync run of 10 steps and one checkpointed after step 7 (inside its second
epoch) and resumed by a new launch end with the same parameters (relative error below 1e-5)
and every rank trained the same samples in the same order; in easgd the global learning
counter of the resumed launch ends at exactly the total, the checkpoint's unused iterations
plus the resumed launch's steps make the total, and the centre variable read from the new
job's servers equals the saved one; periodic checkpoints every 2 steps with keep 2 leave
exactly the newest 2; a rank killed between writing a checkpoint and committing it leaves no
complete-looking checkpoint and the resume takes the one before; SIGUSR1 on rank 1 makes both
ranks write one checkpoint after the same step and exit with status 75; a sync checkpoint of 2
ranks is refused by 3 ranks with a message saying why, while one trained on a fixed global batch
(BalancedBatchSampler) resumes on 3 ranks and ends with the parameters of the uninterrupted
2-rank run; hybrid on 4 ranks in 2 groups of 2: a checkpoint requested on rank 0 stops both
ranks of each group after the same step, the resumed launch starts every rank at its step of
the checkpoint with the centre of its training.h5 in the new servers, the counter ends at
exactly the total and the held-out accuracy is within a point of an uninterrupted run's;
easgd at the end of training, both orders forced through SMB counters: a request begun just
after rank 1's last step boundary checkpoints both ranks (rank 1 at its end of training, 75),
and in the resumed run, where one rank has no iteration left, a request that comes after that
rank ended is refused (status 0, "training is complete") with the counter at the total.
"""
import json
import os
import signal
import subprocess
import time

import h5py
import numpy as np
import pytest

from conftest import PYTHON, REPO, python_env, run_process_group
from launch_helpers import make_bin

pytestmark = pytest.mark.mpi  # starts real Open MPI ranks

TRAINER = REPO / "tests" / "launch_scripts" / "ckpt_trainer.py"
TOLERANCE = 1e-5


def env_for(tmp_path, **settings):
    bin_dir = make_bin(tmp_path / "bin")
    env = python_env({"PATH": f"{bin_dir}:{os.environ['PATH']}", "EDDIS_RUN_DIR": str(tmp_path / "run"),
                      "SMB_MEMORY": "64M", "OMP_NUM_THREADS": "1"})
    env.update({k: str(v) for k, v in settings.items()})
    return env


def launch(tmp_path, out, *args, ranks=2, timeout=150, **settings):
    argv = ["eddis-train", "--local", "-n", str(ranks), PYTHON, str(TRAINER), "--out", str(out), *map(str, args)]
    return run_process_group(argv, env_for(tmp_path, **settings), timeout)


def results(out, ranks=2):
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(ranks)]


def checked(proc):
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def relative_error(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def complete(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("ckpt-"))


@pytest.mark.timeout(600)
def test_sync_resume_continues_the_same_run_and_another_size_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    # the uninterrupted run writes the checkpoint on its way (--go-on): one launch less
    checked(launch(tmp_path, tmp_path / "full", "--steps", 10, "--ckpt", ckpt, "--checkpoint-at", 7, "--go-on"))
    assert complete(ckpt) == ["ckpt-00000007"]
    manifest = json.loads((ckpt / "ckpt-00000007" / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["mode"], manifest["step"]) == (2, "sync", 7)
    assert (manifest["epoch"], manifest["batch"]) == (1, 2)     # 5 batches an epoch per rank
    # sync: rank 0's model and optimizer suffice, every rank's RNG is there
    assert {"rank-00000.pt", "rank-00001.pt", "rank-00000.h5", "rank-00001.h5"} <= set(manifest["files"])
    assert [r["model"] for r in manifest["per_rank"]] == [True, False]
    checked(launch(tmp_path, tmp_path / "second", "--steps", 10, "--ckpt", ckpt))
    full, second = results(tmp_path / "full"), results(tmp_path / "second")
    for rank in (0, 1):
        assert second[rank]["start"]["step"] == 7 and second[rank]["start"]["extra"] == {"note": "explicit"}
        assert full[rank]["steps_at_checkpoint"] == 7
        assert second[rank]["order"] == full[rank]["order"][7:]   # the same samples in the same order
        assert relative_error(second[rank]["params"], full[rank]["params"]) < TOLERANCE

    proc = launch(tmp_path, tmp_path / "three", "--steps", 10, "--ckpt", ckpt, ranks=3)
    assert proc.returncode != 0
    assert "was written by 2 ranks in mode sync, this job has 3" in proc.stdout + proc.stderr
    assert "Resume with 2 ranks" in proc.stdout + proc.stderr


@pytest.mark.timeout(400)
def test_sync_on_a_fixed_global_batch_resumes_on_another_number_of_ranks(tmp_path):
    ckpt = tmp_path / "ckpt"
    checked(launch(tmp_path, tmp_path / "full", "--balanced", "--steps", 10, "--ckpt", ckpt,
                   "--checkpoint-at", 7, "--go-on"))
    checked(launch(tmp_path, tmp_path / "three", "--balanced", "--steps", 10, "--ckpt", ckpt, ranks=3))
    full, three = results(tmp_path / "full"), results(tmp_path / "three", ranks=3)
    for rank in range(3):
        assert three[rank]["start"]["step"] == 7 and three[rank]["steps"] == 3
        assert relative_error(three[rank]["params"], full[0]["params"]) < TOLERANCE


@pytest.mark.timeout(400)
@pytest.mark.parametrize("overlap", ["0", "1"])
def test_easgd_resume_restores_the_centre_and_the_counter_ends_at_the_total(tmp_path, overlap):
    """With EDDIS_EASGD_OVERLAP the checkpoint comes right after an exchange was begun (its
    6th step, tau 2): the move is applied and the centre update waited for before it is written."""
    ckpt, total = tmp_path / "ckpt", 40
    settings = {"EDDIS_TOTAL_ITERATIONS": total, "EDDIS_EASGD_TAU": 2, "EDDIS_EASGD_OVERLAP": overlap}
    checked(launch(tmp_path, tmp_path / "first", "--mode", "easgd", "--ckpt", ckpt, "--checkpoint-at", 6,
                   **settings))
    [folder] = [ckpt / name for name in complete(ckpt)]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["mode"] == "easgd" and [r["step"] for r in manifest["per_rank"]] == [6, 6]
    assert manifest["per_rank"][1]["model"]          # easgd: every worker's own parameters
    with h5py.File(folder / "training.h5", "r") as h5:
        centre = h5["centre"][()]
        consumed = int(h5["progress"].attrs["consumed"])
    assert consumed == 12
    checked(launch(tmp_path, tmp_path / "second", "--mode", "easgd", "--ckpt", ckpt, **settings))
    second = results(tmp_path / "second")
    for rank in (0, 1):
        assert second[rank]["start"]["step"] == 6
        assert np.array_equal(np.asarray(second[rank]["centre_after_resume"], dtype=np.float32), centre)
        assert second[rank]["counter"] == total
    assert consumed + sum(r["steps_done"] for r in second) == total

    # three workers from a checkpoint of two: every worker starts from the centre
    checked(launch(tmp_path, tmp_path / "three", "--mode", "easgd", "--ckpt", folder, ranks=3, **settings))
    three = results(tmp_path / "three", ranks=3)
    for rank in range(3):
        assert np.array_equal(np.asarray(three[rank]["params_after_resume"], dtype=np.float32), centre)
        assert three[rank]["start"]["step"] == 0 and three[rank]["counter"] == total
    assert consumed + sum(r["steps_done"] for r in three) == total


@pytest.mark.timeout(400)
def test_periodic_checkpoints_keep_the_newest_and_survive_a_crash_before_the_commit(tmp_path):
    periodic = tmp_path / "periodic"
    checked(launch(tmp_path, tmp_path / "p", "--steps", 9, EDDIS_CHECKPOINT_DIR=periodic,
                   EDDIS_CHECKPOINT_INTERVAL=2, EDDIS_CHECKPOINT_KEEP=2))
    assert sorted(os.listdir(periodic)) == ["ckpt-00000006", "ckpt-00000008"]
    assert json.loads((periodic / "ckpt-00000008" / "manifest.json").read_text())["reason"] == "periodic"

    # by rank 0's clock, every 1 ms: a request at nearly every step, each taken after one step by all
    timed = tmp_path / "timed"
    checked(launch(tmp_path, tmp_path / "t", "--steps", 6, EDDIS_CHECKPOINT_DIR=timed,
                   EDDIS_CHECKPOINT_INTERVAL="0.001s", EDDIS_CHECKPOINT_KEEP=0))
    assert complete(timed), "no checkpoint by time"
    for name in complete(timed):
        manifest = json.loads((timed / name / "manifest.json").read_text())
        assert [r["step"] for r in manifest["per_rank"]] == [manifest["step"]] * 2
        assert name == f"ckpt-{manifest['step']:08d}"

    crashed = tmp_path / "crashed"
    proc = launch(tmp_path, tmp_path / "c", "--steps", 9, "--crash-commit-at", 6,
                  EDDIS_CHECKPOINT_DIR=crashed, EDDIS_CHECKPOINT_INTERVAL=2)
    assert proc.returncode != 0
    assert complete(crashed) == ["ckpt-00000002", "ckpt-00000004"]
    left = [name for name in os.listdir(crashed) if name.startswith(".ckpt-00000006.tmp-")]
    assert len(left) == 1 and (crashed / left[0] / "manifest.json").exists()   # written, not committed
    checked(launch(tmp_path, tmp_path / "r", "--steps", 9, EDDIS_CHECKPOINT_DIR=crashed,
                   EDDIS_CHECKPOINT_INTERVAL=2))
    assert [r["start"]["step"] for r in results(tmp_path / "r")] == [4, 4]
    assert complete(crashed) == ["ckpt-00000004", "ckpt-00000006", "ckpt-00000008"]
    assert not [name for name in os.listdir(crashed) if name.startswith(".")]


@pytest.mark.timeout(300)
def test_sigusr1_on_one_rank_checkpoints_both_at_the_same_step_and_exits_75(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    argv = ["eddis-train", "--local", "-n", "2", PYTHON, str(TRAINER), "--out", str(out), "--steps", "100000",
            "--step-seconds", "0.05"]
    proc = subprocess.Popen(argv, env=env_for(tmp_path, EDDIS_CHECKPOINT_DIR=ckpt), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "pid-1").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert (out / "pid-1").exists(), "rank 1 never started"
        time.sleep(2)   # let it train a few steps; the request is taken at any boundary
        os.kill(int((out / "pid-1").read_text()), signal.SIGUSR1)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 75, stdout[-3000:] + stderr[-3000:]
    [name] = complete(ckpt)
    manifest = json.loads((ckpt / name / "manifest.json").read_text())
    assert manifest["reason"] == "requested"
    steps = [r["step"] for r in manifest["per_rank"]]
    assert steps[0] == steps[1] == manifest["step"] > 0


@pytest.mark.timeout(600)
def test_tensorflow_sync_resume_ends_with_the_parameters_of_the_uninterrupted_run(tmp_path):
    trainer = REPO / "tests" / "launch_scripts" / "ckpt_tf_trainer.py"
    ckpt = tmp_path / "ckpt"

    def tf_launch(out, *args, **settings):
        argv = ["eddis-train", "--local", "-n", "2", PYTHON, str(trainer), "--out", str(out), *map(str, args)]
        return checked(run_process_group(argv, env_for(tmp_path, **settings), 240))

    # one launch for the checkpoint and the uninterrupted run (TF on 2 ranks starts slowly):
    # the checkpoint must not disturb the run that writes it, nor the one that resumes it
    tf_launch(tmp_path / "full", "--steps", 8, "--ckpt", ckpt, "--checkpoint-at", 3, "--go-on")
    manifest = json.loads((ckpt / "ckpt-00000003" / "manifest.json").read_text())
    assert manifest["framework"] == "tensorflow" and "rank-00000.keras.h5" in manifest["files"]
    periodic = tmp_path / "periodic"   # eager steps take the periodic checkpoints too
    tf_launch(tmp_path / "second", "--steps", 8, "--ckpt", ckpt, EDDIS_CHECKPOINT_DIR=periodic,
              EDDIS_CHECKPOINT_INTERVAL=2)
    # (step 4 is the first boundary of the resumed run: a request there is taken one step on)
    assert complete(periodic) == ["ckpt-00000006", "ckpt-00000008"]
    full, second = results(tmp_path / "full"), results(tmp_path / "second")
    for rank in (0, 1):
        assert second[rank]["start"] == 3
        assert second[rank]["iterations"] == full[rank]["iterations"] == 8   # the optimizer's own state
        assert relative_error(second[rank]["params"], full[rank]["params"]) < TOLERANCE


@pytest.mark.timeout(300)
def test_hybrid_resume_restores_the_centre_and_every_rank_resumes_at_its_step(tmp_path):
    script, total = REPO / "tests" / "launch_scripts" / "resumable_hetero.py", 1200
    settings = {"EDDIS_MODE": "hybrid", "EDDIS_TOTAL_ITERATIONS": total}

    def hybrid_launch(out, folder, *args):
        argv = ["eddis-train", "--local", "-n", "4", PYTHON, str(script), str(out), "--mode", "hybrid",
                "--groups", "2", *map(str, args)]
        return run_process_group(argv, env_for(tmp_path, EDDIS_CHECKPOINT_DIR=folder, **settings), 240)

    checked(hybrid_launch(tmp_path / "full.json", tmp_path / "uninterrupted"))
    full = json.loads((tmp_path / "full.json").read_text())
    ckpt = tmp_path / "ckpt"
    # rank 0 asks after its step 50: every rank stops at its group's next step boundary
    first = hybrid_launch(tmp_path / "first.json", ckpt, "--request-at", 50)
    assert first.returncode == 75, first.stdout[-3000:] + first.stderr[-3000:]
    [name] = complete(ckpt)
    manifest = json.loads((ckpt / name / "manifest.json").read_text())
    steps = [r["step"] for r in manifest["per_rank"]]
    assert manifest["mode"] == "hybrid" and manifest["reason"] == "requested"
    assert steps[0] == steps[1] > 50 and steps[2] == steps[3] > 0, steps   # groups {0, 1} and {2, 3}
    with h5py.File(ckpt / name / "training.h5", "r") as h5:
        centre = h5["centre"][()]
        consumed = int(h5["progress"].attrs["consumed"])
    assert consumed == sum(steps)     # one iteration per rank and group step

    checked(hybrid_launch(tmp_path / "second.json", ckpt))
    second = json.loads((tmp_path / "second.json").read_text())
    assert [r["start"] for r in second["ranks"]] == steps
    assert np.array_equal(np.asarray(second["centre_after_resume"], dtype=np.float32), centre)
    assert second["counter"] == full["counter"] == total
    assert consumed + sum(r["this_run"] for r in second["ranks"]) == total
    assert abs(second["accuracy"] - full["accuracy"]) < 0.01, (second["accuracy"], full["accuracy"])


RACE_SCRIPT = REPO / "tests" / "launch_scripts" / "resumable_hetero.py"
RACE_TOTAL = 40


def race_launch(tmp_path, out, *args, mode="easgd", ranks=2):
    """resumable_hetero.py on ``ranks`` ranks of ``eddis-train --local`` (hybrid: 2 groups), the
    counter's total RACE_TOTAL claimed 2 at a time, checkpoints in ``tmp_path/ckpt``. The steps
    force one order of claims, so no claim is made ahead (EDDIS_CLAIM_AHEAD=0): one would race
    with the other rank's last claims."""
    settings = {"EDDIS_MODE": mode, "EDDIS_TOTAL_ITERATIONS": RACE_TOTAL, "EDDIS_CLAIM_CHUNK": 2,
                "EDDIS_CLAIM_AHEAD": 0,
                "EDDIS_CHECKPOINT_DIR": tmp_path / "ckpt"}
    groups = ["--mode", "hybrid", "--groups", "2"] if mode == "hybrid" else []
    argv = ["eddis-train", "--local", "-n", str(ranks), PYTHON, str(RACE_SCRIPT), str(out), *groups,
            *map(str, args)]
    return run_process_group(argv, env_for(tmp_path, **settings), 200)


def requested_checkpoint(proc, ckpt):
    """The only checkpoint in ``ckpt``, which the launch ``proc`` wrote when asked and then
    stopped for (status 75): its name, every rank's step in it and the launch's output."""
    text = proc.stdout + proc.stderr
    assert proc.returncode == 75, text[-4000:]
    [name] = complete(ckpt)
    manifest = json.loads((ckpt / name / "manifest.json").read_text())
    assert manifest["reason"] == "requested", manifest
    assert "FinalModelWarning" not in text, text[-4000:]   # a stop to be requeued is not the end
    return name, [r["step"] for r in manifest["per_rank"]], text


@pytest.mark.timeout(300)
def test_easgd_requests_at_the_end_of_training_checkpoint_every_rank_or_none(tmp_path):
    """The two orders of a request and another rank's end of training, forced: rank 0 asks
    right after rank 1's last step boundary, so rank 1 joins the save at its end of training;
    the resumed run has one iteration left, one rank none (it must not wait for the other's
    set-up), and the rank with the step asks once the other has ended: refused, complete."""
    total, ckpt = RACE_TOTAL, tmp_path / "ckpt"
    # step 3 is the first of rank 0's second claim of 2: one iteration claimed, not run
    first = race_launch(tmp_path, tmp_path / "first.json", "--end-race", "begun-first", "--request-at", 3)
    name, steps, text = requested_checkpoint(first, ckpt)
    assert steps == [3, total - 4], steps
    assert "stopped after step 3" in text and f"stopped after step {total - 4}" in text, text[-4000:]
    with h5py.File(ckpt / name / "training.h5", "r") as h5:
        assert int(h5["progress"].attrs["consumed"]) == total - 1

    second = race_launch(tmp_path, tmp_path / "second.json", "--end-race", "ended-first")
    text = second.stdout + second.stderr
    assert second.returncode == 0, text[-4000:]
    assert "training is complete, nothing to checkpoint" in text, text[-4000:]
    assert complete(ckpt) == [name]
    result = json.loads((tmp_path / "second.json").read_text())
    assert [r["start"] for r in result["ranks"]] == steps
    assert sorted(r["this_run"] for r in result["ranks"]) == [0, 1]
    assert result["counter"] == total


@pytest.mark.timeout(300)
def test_hybrid_request_at_a_groups_end_of_training_checkpoints_every_rank(tmp_path):
    """The begun-first order in hybrid, 2 groups of 2: group 0 asks after its step 3 once group
    1 is past its last step boundary, so group 1 joins the save at its end of training: every
    rank writes the checkpoint, nothing of the counter is lost, and the resumed run has nothing
    left to train (no rank waits for another's set-up)."""
    total, ckpt = RACE_TOTAL, tmp_path / "ckpt"
    first = race_launch(tmp_path, tmp_path / "first.json", "--end-race", "begun-first", "--request-at", 3,
                        mode="hybrid", ranks=4)
    name, steps, text = requested_checkpoint(first, ckpt)
    assert steps[:2] == [4, 4] and steps[2] == steps[3] > 4, steps
    assert text.count("stopped after step 4") == 2 and text.count(f"stopped after step {steps[2]}") == 2, \
        text[-4000:]
    with h5py.File(ckpt / name / "training.h5", "r") as h5:
        assert int(h5["progress"].attrs["consumed"]) == total
        centre = h5["centre"][()]

    second = race_launch(tmp_path, tmp_path / "second.json", mode="hybrid", ranks=4)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    result = json.loads((tmp_path / "second.json").read_text())
    assert [r["start"] for r in result["ranks"]] == steps
    assert [r["this_run"] for r in result["ranks"]] == [0, 0, 0, 0] and result["counter"] == total
    assert np.array_equal(np.asarray(result["centre_after_resume"], dtype=np.float32), centre)
