"""Runs that lose their ranks (a killed rank, Slurm's time limit, a lost node, preemption)
continue from their last checkpoint: a sync run ends with the parameters of one uninterrupted
run (relative error below 1e-5), an easgd run with the global learning counter at exactly its
total and the held-out accuracy of an uninterrupted run within one point.

- ``EDDIS_MAX_RESTARTS``: ``eddis-train --local`` reports the killed rank, starts a fresh
  server and ranks, and the script's ``eddis.resume()`` continues from the periodic checkpoint.
- Requeue: a job on the local Slurm cluster (2 nodes, 1 rank each) gets Slurm's warning
  signal twice; each time the trainers write a checkpoint and stop, the job requeues itself
  and its next run resumes. The test sends the warning as Slurm's ``--signal=B:USR1@N``
  does (``scancel --batch --signal=USR1``) at chosen steps, so that the runs' lengths, and
  with them the sync math, are the same every time.
- A node set DOWN under a ``--no-kill`` job with a spare node: the job restarts without it;
  with its spare drained too, it ends naming both nodes. A job whose script sets
  EDDIS_SPARE_NODES without ``--no-kill`` warns at its start.
- Preemption: the same job, in the dev cluster's preemptable partition ``all``, is preempted
  by a job in partition ``urgent`` that needs both nodes; the trainers answer Slurm's SIGTERM
  with a checkpoint, the job requeues itself, and its next run resumes at that step.
- Time limit, easgd: a job with ``--time=1`` and ``--signal=B:USR1@10`` trains far longer
  than a minute. slurmctld itself sends the warning, at its first time-limit check (every
  30 s) at which the limit is at most 10 + 30 s away: 20 to 50 s into each run, so that a
  run trains at least 20 s less its start-up, and at most 50 s, at most 20 steps a second on
  each of the 2 ranks (a 0.05 s pause a step): 2000 iterations, and the total of 4100 needs
  at least three runs. Each run resumes every rank at its own step of the checkpoint before.

Slurm holds a requeued job for AuthInfo's cred_expire + 1 s; the dev cluster sets 10 s, and
Slurm releases it itself.
"""
import json
import os
import re

import numpy as np
import pytest

from conftest import PYTHON, REPO, run_process_group
from launch_helpers import (job_state, last_start_attempt, make_bin, requeue_hold_seconds, wait_job_end,
                            wait_requeued_job_end, wait_until)
from test_checkpoint_resume import RACE_TOTAL, complete, env_for as local_env, race_launch, requested_checkpoint

SCRIPT = REPO / "tests" / "launch_scripts" / "resumable_sync.py"
HETERO_SCRIPT = REPO / "tests" / "launch_scripts" / "resumable_hetero.py"
STEPS = 20
TOLERANCE = 1e-5
MAX_HOLD_SECONDS = 30
STALE_CLUSTER = ("the dev cluster holds a requeued job for longer than 30 s (Slurm's default: 121 s): it "
                 "was set up by an older scripts/eddis-dev-cluster; run `scripts/eddis-dev-cluster down` "
                 "and `up` to rebuild it with AuthInfo=...,cred_expire=10")
# easgd under the time limit: less than 50 s of training a run (see above), 20 steps a second
# at most on each of 2 ranks
WARNING_LEAD_SECONDS = 10
STEP_SECONDS = 0.05
EASGD_TOTAL = 4100
ACCURACY_POINT = 0.01


def reference(tmp_path):
    """The parameters of the uninterrupted run."""
    out = tmp_path / "reference.npz"
    proc = run_process_group(["eddis-train", "--local", "-n", "2", PYTHON, str(SCRIPT), str(STEPS), str(out)],
                             local_env(tmp_path / "ref", EDDIS_CHECKPOINT_DIR=tmp_path / "ref" / "ckpt"), 180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(np.load(out))


def assert_same_parameters(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        error = np.linalg.norm(got[name] - want[name]) / np.linalg.norm(want[name])
        assert error < TOLERANCE, (name, error)


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_a_restart_after_a_killed_rank_resumes_from_the_last_checkpoint(tmp_path):
    want = reference(tmp_path)
    out = tmp_path / "restarted.npz"
    env = local_env(tmp_path, EDDIS_CHECKPOINT_DIR=tmp_path / "ckpt", EDDIS_CHECKPOINT_INTERVAL=5,
                    EDDIS_MAX_RESTARTS=2, TEST_CRASH_AFTER_STEP=12)
    proc = run_process_group(["eddis-train", "--local", "-n", "2", PYTHON, str(SCRIPT), str(STEPS), str(out)],
                             env, 300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert re.search(r"ROOT CAUSE: rank 1 on host \S+ was killed by signal 9 \(SIGKILL\)", text), text[-4000:]
    assert text.count("restarting the smb-server and the ranks (restart 1 of 2)") == 1, text[-4000:]
    assert "restart 2 of 2" not in text
    # the checkpoint after step 10 is the last one before the crash after step 12
    assert sorted(set(re.findall(r"run 0\.(\d) starts at step (\d+)", text))) == [("0", "0"), ("1", "10")], text
    assert_same_parameters(dict(np.load(out)), want)


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_restarts_are_bounded_and_say_so(tmp_path):
    env = local_env(tmp_path, EDDIS_MAX_RESTARTS=1)
    bad = tmp_path / "fails.py"
    bad.write_text("import sys\nsys.exit(3)\n")
    proc = run_process_group(["eddis-train", "--local", "-n", "2", PYTHON, str(bad)], env, 180)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 3, text[-3000:]
    assert text.count("restarting the smb-server and the ranks") == 1, text[-3000:]
    assert "the ranks failed again after 1 restart(s) (EDDIS_MAX_RESTARTS=1); giving up" in text, text[-3000:]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("crash", ["first", "always"])
def test_a_local_run_starts_again_once_after_a_rank_crashed_before_eddis_init(tmp_path, crash):
    """--local ends an attempt as a Slurm job does (the two tests below): a rank that crashed
    before eddis.init() returned starts the run once more (EDDIS_START_RETRIES, 1 by default)."""
    out = tmp_path / "trained.npz"
    env = local_env(tmp_path, EDDIS_CHECKPOINT_DIR=tmp_path / "ckpt", TEST_CRASH_BEFORE_INIT=crash)
    proc = run_process_group(["eddis-train", "--local", "-n", "2", PYTHON, str(SCRIPT), str(STEPS), str(out)],
                             env, 240)
    text = proc.stdout + proc.stderr
    assert re.search(r"ROOT CAUSE: rank 1 on host \S+ was killed by signal 11 \(SIGSEGV\)", text), text[-4000:]
    assert len(re.findall(r"^eddis-train: rank 1 on host \S+ was killed by signal 11 \(SIGSEGV\) before eddis.init\(\) "
                          r"returned: a crash in the start-up .*; starting the smb-server and the ranks again \(start "
                          r"retry 1 of 1, EDDIS_START_RETRIES\)$", text, re.M)) == 1, text[-4000:]
    assert "restarting the smb-server and the ranks" not in text, text[-4000:]
    if crash == "first":
        assert proc.returncode == 0, text[-4000:]
        assert re.search(r"^\[0@\S+\] finished 20 steps", text, re.M) and out.exists(), text[-4000:]
        assert "eddis-train: done, status 0" in text, text[-4000:]
    else:
        assert proc.returncode == 139, text[-4000:]
        assert "before eddis.init() returned, again after 1 start retry(ies) (EDDIS_START_RETRIES=1)" in text, \
            text[-4000:]
        assert "eddis-train: failed, status 139" in text, text[-4000:]


def submit_job(cluster, tmp_path, command, log, component=None, env=None, **options):
    """sbatch the job script render_job_script writes for ``component`` (by default 2 nodes x
    1 rank in partition all); returns the job id. sbatch's environment: this checkout's entry
    points, the job's run dir, ``env``."""
    from eddis.slurm.script import JobComponent, render_job_script

    component = component or JobComponent("all", nodes=2, tasks_per_node=1)
    script = tmp_path / "job.sh"
    script.write_text(render_job_script(components=[component], command=[PYTHON, *map(str, command)],
                                        output=str(log), **options))
    bin_dir = make_bin(tmp_path / "bin")
    environ = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "EDDIS_RUN_DIR": str(tmp_path / "run"),
               "SMB_MEMORY": "64M", "OMP_NUM_THREADS": "1", **(env or {})}
    return cluster.run(["sbatch", "--parsable", str(script)], env=environ, timeout=60).stdout.strip()


def submit_resumable_job(cluster, tmp_path, name, out, seconds_per_step, settings):
    """resumable_sync.py as a job that may be requeued (checkpoint signal); returns the job id
    and its output file."""
    assert requeue_hold_seconds(cluster) <= MAX_HOLD_SECONDS, STALE_CLUSTER
    log = tmp_path / "job.out"
    job_id = submit_job(cluster, tmp_path, [SCRIPT, STEPS, out, seconds_per_step], log, job_name=name,
                                 time="00:10:00", checkpoint_signal=120, settings=settings)
    return job_id, log


def follow_requeued_job(cluster, job_id, log, act, timeout):
    """Poll the job until it has ended for good, calling ``act(text of its output)`` at every
    poll; returns (state, exit code)."""
    return wait_requeued_job_end(cluster, job_id, timeout, log,
                                 on_poll=lambda: act(log.read_text(errors="replace") if log.exists() else ""))


def rank0_steps_done(text):
    return [int(s) for s in re.findall(r"^\[0@\S+\] step (\d+) done", text, re.M)]


def rank0_run_starts(text):
    """The step rank 0 started at in each Slurm run (``run R.E``), in order. A start retry
    (E > 0: a rank crashed before eddis.init() returned, as Open MPI under PMIx does about
    once in 250 starts) replaces the attempt it retries, which trained nothing."""
    starts = {}
    for run, _, step in re.findall(r"^\[0@\S+\] run (\d+)\.(\d+) starts at step (\d+)", text, re.M):
        starts[int(run)] = int(step)
    return [starts[run] for run in sorted(starts)]


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_a_job_warned_of_its_time_limit_requeues_itself_and_resumes(slurm_cluster, tmp_path):
    want = reference(tmp_path)
    out = tmp_path / "requeued.npz"
    job_id, log = submit_resumable_job(slurm_cluster, tmp_path, "eddis-requeue-test", out, 1.0,
                                       {"EDDIS_CHECKPOINT_DIR": str(tmp_path / "ckpt")})
    warned = []

    def warn(text):
        done = rank0_steps_done(text)
        # the warning once after step 4 of the first run and once after step 10 of the second
        if len(warned) < 2 and done and done[-1] >= (4, 10)[len(warned)] \
                and text.count("requeued job") == len(warned):
            slurm_cluster.run(["scancel", "--batch", "--signal=USR1", job_id], timeout=30)
            warned.append(done[-1])

    state = follow_requeued_job(slurm_cluster, job_id, log, warn, 600)
    text = log.read_text(errors="replace")
    assert state[:2] == ("COMPLETED", "0:0"), text[-4000:]
    assert text.count("asking the trainers for a checkpoint") == 2, text[-4000:]
    requeues = re.findall(r"eddis_job: wrote checkpoint (\S+) \(step (\d+)\); requeued job", text)
    assert len(requeues) == 2, text[-4000:]
    # each run starts where the last one's checkpoint was taken: no step lost beyond it
    starts = rank0_run_starts(text)
    assert starts == [0, *[int(step) for _, step in requeues]], text[-4000:]
    assert re.search(r"^\[0@\S+\] finished 20 steps", text, re.M), text[-4000:]
    assert_same_parameters(dict(np.load(out)), want)


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_job_restarts_its_failed_trainers_in_the_allocation(slurm_cluster, tmp_path):
    want = reference(tmp_path)
    out, log = tmp_path / "restarted.npz", tmp_path / "job.out"
    job_id = submit_job(slurm_cluster, tmp_path, [SCRIPT, STEPS, out], log,
                                 env={"TEST_CRASH_AFTER_STEP": "12"}, job_name="eddis-restart-test", time="00:10:00",
                                 settings={"EDDIS_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
                                           "EDDIS_CHECKPOINT_INTERVAL": "5", "EDDIS_MAX_RESTARTS": "1"})
    state = wait_job_end(slurm_cluster, job_id, 400, log)
    text = log.read_text(errors="replace")
    assert state == ("COMPLETED", "0:0"), text[-4000:]
    assert re.search(r"ROOT CAUSE: rank 1 on host n2 was killed by signal 9 \(SIGKILL\)", text), text[-4000:]
    assert text.count("restarting the smb-servers and trainers in this allocation (restart 1 of 1)") == 1, \
        text[-4000:]
    assert re.findall(r"^\[0@n1\] run 0\.(\d) starts at step (\d+)", text, re.M) == [("0", "0"), ("1", "10")], \
        text[-4000:]
    assert_same_parameters(dict(np.load(out)), want)


@pytest.mark.slurm
@pytest.mark.timeout(400)
def test_a_job_starts_again_once_after_a_rank_crashed_before_eddis_init(slurm_cluster, tmp_path):
    # as Open MPI 4.1 under Slurm's PMIx does about once in 250 starts: EDDIS_MAX_RESTARTS is
    # not set, the retry is EDDIS_START_RETRIES' (1 by default)
    out, log = tmp_path / "trained.npz", tmp_path / "job.out"
    job_id = submit_job(slurm_cluster, tmp_path, [SCRIPT, STEPS, out], log, env={"TEST_CRASH_BEFORE_INIT": "first"},
                        job_name="eddis-start-retry-test", time="00:10:00",
                        settings={"EDDIS_CHECKPOINT_DIR": str(tmp_path / "ckpt")})
    state = wait_job_end(slurm_cluster, job_id, 300, log)
    text = log.read_text(errors="replace")
    assert state == ("COMPLETED", "0:0"), text[-4000:]
    assert re.search(r"ROOT CAUSE: rank 1 on host n2 was killed by signal 11 \(SIGSEGV\)", text), text[-4000:]
    assert text.count("rank 1 on host n2 was killed by signal 11 (SIGSEGV) before eddis.init() returned: "
                      "a crash in the start-up") == 1, text[-4000:]
    assert "(start retry 1 of 1, EDDIS_START_RETRIES)" in text, text[-4000:]
    # the crashed attempt's report ends where the retry begins (what other tests rely on)
    assert "ROOT CAUSE" not in last_start_attempt(text), text[-4000:]
    assert "restarting the smb-servers and trainers in this allocation" not in text, text[-4000:]
    assert re.search(r"^\[0@n1\] finished 20 steps", text, re.M), text[-4000:]
    assert out.exists()


@pytest.mark.slurm
@pytest.mark.timeout(400)
def test_a_job_whose_rank_crashes_before_eddis_init_every_time_fails_after_one_retry(slurm_cluster, tmp_path):
    log = tmp_path / "job.out"
    job_id = submit_job(slurm_cluster, tmp_path, [SCRIPT, STEPS, tmp_path / "never.npz"], log,
                        env={"TEST_CRASH_BEFORE_INIT": "always"}, job_name="eddis-start-retry-test",
                        time="00:10:00", settings={"EDDIS_CHECKPOINT_DIR": str(tmp_path / "ckpt")})
    state = wait_job_end(slurm_cluster, job_id, 300, log)
    text = log.read_text(errors="replace")
    assert state[0] == "FAILED" and state[1] == "139:0", (state, text[-4000:])
    assert text.count("(start retry 1 of 1, EDDIS_START_RETRIES)") == 1, text[-4000:]
    assert "before eddis.init() returned, again after 1 start retry(ies) (EDDIS_START_RETRIES=1)" in text, \
        text[-4000:]


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_job_restarts_on_its_spare_node_without_the_node_that_went_down(slurm_cluster, tmp_path):
    """Two nodes allocated with --no-kill, the trainers (2 ranks) on n2 and n1 (the batch host)
    spare; n2 set DOWN mid-training: Slurm removes it from the job, and the job restarts its
    server and trainers on n1 from the last checkpoint. The trainers start on n2 because the
    batch host is the first spare (eddis.launch.placement): a node that fails under the job's
    own script ends the job with it."""
    from eddis.slurm.script import JobComponent

    want = reference(tmp_path)
    out, log = tmp_path / "restarted.npz", tmp_path / "job.out"
    job_id = submit_job(slurm_cluster, tmp_path, [SCRIPT, STEPS, out, "0.5"], log,
                        component=JobComponent("all", nodes=1, tasks_per_node=2, spare_nodes=1),
                        job_name="eddis-spare-node-test", time="00:10:00", checkpoint_signal=0,
                        settings={"EDDIS_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "EDDIS_CHECKPOINT_INTERVAL": "5",
                                  "EDDIS_MAX_RESTARTS": "1"})
    try:
        wait_until(lambda: re.search(r"^\[0@n2\] step 6 done", log.read_text(errors="replace") if log.exists()
                                     else "", re.M), 300, what="step 6 on n2")
        slurm_cluster.run(["scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=eddis test: node lost"],
                          timeout=30)
        state = wait_job_end(slurm_cluster, job_id, 300, log)
    finally:
        slurm_cluster.run(["scontrol", "update", "NodeName=n2", "State=RESUME"], timeout=30, check=False)
    text = log.read_text(errors="replace")
    assert state == ("COMPLETED", "0:0"), text[-4000:]
    assert "the smb-servers and trainers run on n2; spare node(s) n1 (EDDIS_SPARE_NODES)" in text, text[-4000:]
    # Slurm removed n2 from the job; ReturnToService=2 may have brought it back by then
    assert re.search(r"node\(s\) n2 \((DOWN: eddis test: node lost; )?removed from the job\) failed: the "
                     r"smb-servers and trainers restart on n1, without n2", text), text[-4000:]
    assert text.count("restarting the smb-servers and trainers in this allocation (restart 1 of 1)") == 1, \
        text[-4000:]
    # the first run, on n2, ended after its last printed step; the second resumes at the last
    # checkpoint before it, on n1, with both ranks
    done_on_n2 = [int(s) for s in re.findall(r"^\[0@n2\] step (\d+) done", text, re.M)]
    starts = re.findall(r"^\[(\d)@(n\d)\] run 0\.(\d) starts at step (\d+)", text, re.M)
    resumed = 5 * (max(done_on_n2) // 5)
    assert sorted(starts) == [("0", "n1", "1", str(resumed)), ("0", "n2", "0", "0"),
                              ("1", "n1", "1", str(resumed)), ("1", "n2", "0", "0")], text[-4000:]
    assert resumed >= 5, text[-4000:]
    assert re.search(r"^\[0@n1\] finished 20 steps", text, re.M), text[-4000:]
    assert_same_parameters(dict(np.load(out)), want)


@pytest.mark.slurm
@pytest.mark.timeout(400)
def test_a_job_whose_spare_node_failed_too_ends_naming_the_failed_nodes(slurm_cluster, tmp_path):
    """The trainers on n2, n1 (the batch host) spare, as above; n1 drained (a DRAIN node keeps
    its running jobs) and then n2 set DOWN: no healthy node is left for the restart, and the
    job ends saying which nodes failed and the fixes (NodeFailureError), without restarting.
    Its script asks for --no-kill, which the job reads back: no warning about spares."""
    from eddis.slurm.script import JobComponent

    out, log = tmp_path / "never.npz", tmp_path / "job.out"
    job_id = submit_job(slurm_cluster, tmp_path, [SCRIPT, STEPS, out, "0.5"], log,
                        component=JobComponent("all", nodes=1, tasks_per_node=1, spare_nodes=1),
                        job_name="eddis-no-healthy-node-test", time="00:05:00", checkpoint_signal=0,
                        settings={"EDDIS_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "EDDIS_MAX_RESTARTS": "1"})
    try:
        wait_until(lambda: re.search(r"^\[0@n2\] step 2 done", log.read_text(errors="replace") if log.exists()
                                     else "", re.M), 300, what="step 2 on n2")
        slurm_cluster.run(["scontrol", "update", "NodeName=n1", "State=DRAIN", "Reason=eddis test: spare drained"],
                          timeout=30)
        slurm_cluster.run(["scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=eddis test: node lost"],
                          timeout=30)
        state = wait_job_end(slurm_cluster, job_id, 300, log)
    finally:
        for node in ("n1", "n2"):
            slurm_cluster.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], timeout=30, check=False)
    text = log.read_text(errors="replace")
    assert state[0] == "FAILED", (state, text[-4000:])
    assert "the smb-servers and trainers run on n2; spare node(s) n1 (EDDIS_SPARE_NODES)" in text, text[-4000:]
    assert re.search(r"eddis_job: error: node\(s\) n1 \(DRAIN: eddis test: spare drained\); n2 \([^)]*\) of this "
                     r"job failed, and its trainers need 1 node\(s\) where 0 healthy one\(s\) remain: not "
                     r"restarted\. Fixes: submit with spare nodes", text), text[-4000:]
    assert "restarting the smb-servers" not in text and not out.exists(), text[-4000:]
    assert "did not ask for --no-kill" not in text, text[-4000:]


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_a_job_with_spare_nodes_but_without_no_kill_warns_at_its_start(slurm_cluster, tmp_path):
    """EDDIS_SPARE_NODES set by hand in a script without --no-kill: Slurm would end the job at
    a node's failure, so its spare is useless; the job finds its script's #SBATCH lines
    through scontrol and says so, then trains as asked."""
    from eddis.slurm.script import JobComponent

    log, trainer = tmp_path / "job.out", tmp_path / "trains.py"
    trainer.write_text("print('trained', flush=True)\n")
    job_id = submit_job(slurm_cluster, tmp_path, [trainer], log, component=JobComponent("all", nodes=2,
                        tasks_per_node=1), job_name="eddis-spare-without-no-kill-test", time="00:05:00",
                        checkpoint_signal=0, settings={"EDDIS_SPARE_NODES": "1"})
    state = wait_job_end(slurm_cluster, job_id, 200, log)
    text = log.read_text(errors="replace")
    assert state == ("COMPLETED", "0:0"), text[-4000:]
    assert "#SBATCH --no-kill" not in (tmp_path / "job.sh").read_text()
    assert text.count("eddis_job: WARNING: EDDIS_SPARE_NODES=1, but this job did not ask for --no-kill") == 1, \
        text[-4000:]
    assert re.search(r"^\[0@n2\] trained$", text, re.M), text[-4000:]


ELASTIC_SYNC_SCRIPT = REPO / "tests" / "horovod_style" / "torch_elastic_sync_style.py"
TF_ELASTIC_SYNC_SCRIPT = REPO / "tests" / "horovod_style" / "tensorflow_elastic_sync_style.py"
KERAS_ELASTIC_SYNC_SCRIPT = REPO / "tests" / "horovod_style" / "keras_elastic_sync_style.py"


def launch_elastic_sync(tmp_path, script, name, timeout=150, script_args=(), **extra):
    """A Horovod-style elastic script in sync with EDDIS_MAX_RESTARTS=1; its output and the
    final parameters rank 0 wrote."""
    out = tmp_path / f"{name}.npz"
    env = local_env(tmp_path / name, EDDIS_MODE="sync", EDDIS_MAX_RESTARTS=1, **extra)
    proc = run_process_group(["eddis-train", "--local", "-n", "2", PYTHON, str(script), str(out), *script_args],
                             env, timeout)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert text.count("HOROVOD-STYLE ELASTIC SYNC OK") == 2, text[-4000:]
    return text, dict(np.load(out))


def assert_restarted_from_the_commit_at_epoch_1_batch_4(text, run_dir):
    assert re.search(r"ROOT CAUSE: rank 1 on host \S+ was killed by signal 9 \(SIGKILL\)", text), text[-4000:]
    assert text.count("restarting the smb-server and the ranks (restart 1 of 1)") == 1, text[-4000:]
    assert sorted(re.findall(r"attempt (\d) starts at epoch (\d) batch (\d)", text)) == [
        ("0", "0", "0"), ("0", "0", "0"), ("1", "1", "4"), ("1", "1", "4")], text[-4000:]
    # one commit every 4 batches and the last one: steps 4, 8, 14, 18 and 20, the newest 3 kept,
    # and removed once the training finished
    assert re.search(rf"removed its 3 elastic commit\(s\) from {re.escape(str(run_dir))}/elastic-commits$",
                     text, re.M), text[-4000:]
    assert not (run_dir / "elastic-commits").exists()


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_a_horovod_elastic_script_in_sync_restarts_from_its_last_commit(tmp_path):
    """Without EDDIS_CHECKPOINT_DIR, the commits go into the run directory's elastic-commits
    folder because EDDIS_MAX_RESTARTS > 0; rank 1 dies after the commit at epoch 1, batch 4."""
    uninterrupted, want = launch_elastic_sync(tmp_path, ELASTIC_SYNC_SCRIPT, "reference")
    assert "restarting" not in uninterrupted
    text, got = launch_elastic_sync(tmp_path, ELASTIC_SYNC_SCRIPT, "killed", ELASTIC_TEST_KILL_AFTER="1:4")
    assert_restarted_from_the_commit_at_epoch_1_batch_4(text, tmp_path / "killed" / "run")
    assert_same_parameters(got, want)


def replay_keras_sgd_momentum(initial, ranks, epochs, batches, lr=0.05, momentum=0.9):
    """tensorflow_elastic_sync_style.py's training in one process, in float64: each step the
    Dense(1) layer's gradients of the mean squared error averaged over the ranks' batches,
    then Keras's SGD with momentum (m = momentum m - lr g; w += m)."""
    weights = [w.astype(np.float64) for w in initial]
    velocities = [np.zeros_like(w) for w in weights]
    for epoch in range(epochs):
        for batch in range(batches):
            grads = [np.zeros_like(w) for w in weights]
            for rank in range(ranks):
                x = np.random.default_rng(1000 * epoch + 10 * batch + rank).normal(size=(16, 8)).astype("float32")
                y = x.sum(axis=1, keepdims=True).astype(np.float64)
                x = x.astype(np.float64)
                error = x @ weights[0] + weights[1] - y
                grads[0] += 2 * x.T @ error / len(x) / ranks
                grads[1] += 2 * error.sum(axis=0) / len(x) / ranks
            for w, m, g in zip(weights, velocities, grads):
                m *= momentum
                m -= lr * g
                w += m
    return weights


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("reduce_by", ["optimizer", "tape"])
def test_a_horovod_elastic_tensorflow_script_in_sync_restarts_from_its_last_commit(tmp_path, reduce_by):
    """TensorFlowKerasState's commits are checkpoints too, with an eddis.DistributedOptimizer
    and with a plain optimizer beside a DistributedGradientTape (Horovod's TF2 pattern): the
    same kill as above, one launch each (TensorFlow's import costs seconds a process); the
    uninterrupted run it must equal is replayed here from the weights rank 0 started from."""
    text, got = launch_elastic_sync(tmp_path, TF_ELASTIC_SYNC_SCRIPT, "killed", timeout=240,
                                    script_args=[reduce_by], ELASTIC_TEST_KILL_AFTER="1:4")
    assert "stays in memory" not in text, text[-4000:]
    assert_restarted_from_the_commit_at_epoch_1_batch_4(text, tmp_path / "killed" / "run")
    initial = np.load(tmp_path / "killed-initial.npz")
    want = replay_keras_sgd_momentum([initial[k] for k in sorted(initial)], ranks=2, epochs=2, batches=10)
    assert_same_parameters(got, dict(zip(sorted(initial), want)))


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_a_horovod_elastic_keras_fit_in_sync_restarts_from_its_last_commit(tmp_path):
    """hvd.elastic for model.fit (KerasState, its three callbacks): rank 1 is killed right after
    the commit at the end of epoch 0; the restarted fit runs epoch 1 only and ends with the
    weights of the uninterrupted run, replayed here."""
    text, got = launch_elastic_sync(tmp_path, KERAS_ELASTIC_SYNC_SCRIPT, "killed", timeout=240,
                                    ELASTIC_TEST_KILL_AFTER="1:0")
    assert re.search(r"ROOT CAUSE: rank 1 on host \S+ was killed by signal 9 \(SIGKILL\)", text), text[-4000:]
    assert text.count("restarting the smb-server and the ranks (restart 1 of 1)") == 1, text[-4000:]
    assert sorted(re.findall(r"attempt (\d) starts at epoch (\d) batch (\d)", text)) == [
        ("0", "0", "0"), ("0", "0", "0"), ("1", "1", "0"), ("1", "1", "0")], text[-4000:]
    assert text.count("trained epochs 2") == 2, text[-4000:]
    # commits after batches 4 and 8 and at each epoch's end: steps 4, 8, 10, then 14, 18, 20;
    # the newest 3 kept, and removed once the training finished
    run_dir = tmp_path / "killed" / "run"
    assert re.search(rf"removed its 3 elastic commit\(s\) from {re.escape(str(run_dir))}/elastic-commits$",
                     text, re.M), text[-4000:]
    initial = np.load(tmp_path / "killed-initial.npz")
    want = replay_keras_sgd_momentum([initial[k] for k in sorted(initial)], ranks=2, epochs=2, batches=10)
    assert_same_parameters(got, dict(zip(sorted(initial), want)))


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_preempted_job_checkpoints_is_requeued_and_resumes(slurm_cluster, tmp_path):
    """A job in partition all is preempted by one in partition urgent (PriorityTier 2,
    PreemptMode=REQUEUE, GraceTime on all: scripts/eddis-dev-cluster) that needs both nodes."""
    want = reference(tmp_path)
    out = tmp_path / "preempted.npz"
    # EDDIS_MAX_REQUEUES=0: a requeue the job counted as its own would be refused
    job_id, log = submit_resumable_job(slurm_cluster, tmp_path, "eddis-preempt-test", out, 0.5,
                                       {"EDDIS_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "EDDIS_MAX_REQUEUES": "0"})
    urgent = []

    def preempt(text):
        done = rank0_steps_done(text)
        if not urgent and done and done[-1] >= 4:
            urgent.append(slurm_cluster.run(
                ["sbatch", "--parsable", "--partition=urgent", "--nodes=2", "--exclusive", "--job-name=urgent",
                 f"--output={tmp_path / 'urgent.out'}", "--wrap", "sleep 2; echo urgent job ran"],
                timeout=60).stdout.strip())

    state = follow_requeued_job(slurm_cluster, job_id, log, preempt, 400)
    text = log.read_text(errors="replace")
    assert state[:2] == ("COMPLETED", "0:0"), text[-4000:]
    # the urgent job ran to its end; slurmctld forgets it MinJobAge (30 s) after, which a slow
    # resumed run can outlast
    assert urgent and job_state(slurm_cluster, urgent[0]) in (("COMPLETED", "0:0"), None), text[-4000:]
    assert (tmp_path / "urgent.out").read_text().strip() == "urgent job ran", text[-4000:]
    preempted = re.findall(r"eddis_job: preempted by Slurm: wrote checkpoint (\S+) \(step (\d+)\)", text)
    assert len(preempted) == 1, text[-4000:]
    step = int(preempted[0][1])
    assert f"requeued job {job_id} (run 2; preemption 1, not counted against EDDIS_MAX_REQUEUES)" in text, \
        text[-4000:]
    assert "asking the trainers for a checkpoint" not in text  # no time-limit warning came
    # the run after the preemption starts at the checkpoint's step, and every step is trained
    # once: none after the checkpoint in the preempted run, none lost
    starts = rank0_run_starts(text)
    assert starts == [0, step], text[-4000:]
    first, _, second = text.partition("eddis_job: preempted by Slurm")
    assert rank0_steps_done(first) == list(range(1, step)), text[-4000:]
    assert rank0_steps_done(second) == list(range(step + 1, STEPS + 1)), text[-4000:]
    assert re.search(r"^\[0@\S+\] finished 20 steps", text, re.M), text[-4000:]
    assert_same_parameters(dict(np.load(out)), want)


def easgd_reference(tmp_path):
    """The held-out accuracy of one uninterrupted easgd run of the same total (no pauses)."""
    out = tmp_path / "easgd-reference.json"
    proc = run_process_group(["eddis-train", "--local", "-n", "2", PYTHON, str(HETERO_SCRIPT), str(out)],
                             local_env(tmp_path / "ref", EDDIS_CHECKPOINT_DIR=tmp_path / "ref" / "ckpt",
                                       EDDIS_MODE="easgd", EDDIS_TOTAL_ITERATIONS=EASGD_TOTAL), 180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["counter"] == EASGD_TOTAL and sum(r["steps"] for r in result["ranks"]) == EASGD_TOTAL
    return result


def rank_lines(text, rank, pattern):
    return [int(v) for v in re.findall(rf"^\[{rank}@\S+\] {pattern}", text, re.M)]


@pytest.mark.slurm
@pytest.mark.timeout(720)
def test_an_easgd_job_ended_by_its_time_limit_resumes_until_the_counter_reaches_the_total(
        slurm_cluster, tmp_path):
    assert requeue_hold_seconds(slurm_cluster) <= MAX_HOLD_SECONDS, STALE_CLUSTER
    want = easgd_reference(tmp_path)
    out, ckpt, log = tmp_path / "requeued.json", tmp_path / "ckpt", tmp_path / "job.out"
    job_id = submit_job(
        slurm_cluster, tmp_path, [HETERO_SCRIPT, out, "--step-seconds", STEP_SECONDS], log,
        job_name="eddis-time-limit-test", time="1", checkpoint_signal=WARNING_LEAD_SECONDS, mode="easgd",
        settings={"EDDIS_CHECKPOINT_DIR": str(ckpt), "EDDIS_CHECKPOINT_KEEP": "0",
                  "EDDIS_TOTAL_ITERATIONS": str(EASGD_TOTAL)})
    state = wait_requeued_job_end(slurm_cluster, job_id, 600, log)
    text = log.read_text(errors="replace")
    assert state[:2] == ("COMPLETED", "0:0"), text[-4000:]
    requeues = re.findall(r"eddis_job: wrote checkpoint (\S+) \(step (\d+)\); requeued job", text)
    assert len(requeues) >= 2, text[-4000:]
    # every warning was Slurm's own, and none came too late: the limit never ended a run itself
    # (the last run's may come once its trainers are done, and then asks nothing of them)
    warnings = text.count("(SIGUSR1 from Slurm): asking the trainers for a checkpoint")
    assert warnings - len(requeues) in (0, 1), text[-4000:]
    assert "DUE TO TIME LIMIT" not in text, text[-4000:]
    for rank in (0, 1):
        starts = rank_lines(text, rank, r"run \d+\.0 starts at step (\d+)")
        stops = rank_lines(text, rank, r"stopped after step (\d+)")
        # each run starts where its rank's last step before the checkpoint was: none lost
        assert len(stops) == len(requeues) and starts == [0, *stops], (rank, starts, stops, text[-4000:])
        for (path, _), stop in zip(requeues, stops):
            manifest = json.loads((ckpt / os.path.basename(path) / "manifest.json").read_text())
            assert manifest["per_rank"][rank]["step"] == stop, (rank, manifest["per_rank"], stops)
    got = json.loads(out.read_text())
    assert got["counter"] == EASGD_TOTAL, got["counter"]
    # every iteration of the total was trained once, by one rank in one run
    assert sum(r["steps"] for r in got["ranks"]) == EASGD_TOTAL, got["ranks"]
    assert abs(got["accuracy"] - want["accuracy"]) < ACCURACY_POINT, (got["accuracy"], want["accuracy"])


@pytest.mark.slurm
@pytest.mark.timeout(420)
def test_a_job_whose_checkpoint_request_comes_after_training_ended_completes(slurm_cluster, tmp_path):
    """A request refused as "training is complete" ends the Slurm job COMPLETED, neither
    requeued nor checkpointed: the job resumes a checkpoint with one iteration left (written
    here first, by eddis-train --local), and its rank at that last step asks once the other
    rank has ended its training (resumable_hetero.py --end-race ended-first)."""
    from eddis.launch.jobsteps import COMPLETE_BEFORE_CHECKPOINT

    ckpt = tmp_path / "first" / "ckpt"
    name, _, _ = requested_checkpoint(race_launch(tmp_path / "first", tmp_path / "first.json", "--end-race",
                                                  "begun-first", "--request-at", 3), ckpt)
    assert requeue_hold_seconds(slurm_cluster) <= MAX_HOLD_SECONDS, STALE_CLUSTER
    out, log = tmp_path / "second.json", tmp_path / "job.out"
    job_id = submit_job(slurm_cluster, tmp_path, [HETERO_SCRIPT, out, "--end-race", "ended-first"], log,
                        job_name="eddis-refused-test", time="00:05:00", checkpoint_signal=120, mode="easgd",
                        settings={"EDDIS_TOTAL_ITERATIONS": str(RACE_TOTAL), "EDDIS_CLAIM_CHUNK": "2",
                                  "EDDIS_CLAIM_AHEAD": "0", "EDDIS_CHECKPOINT_DIR": str(ckpt)})
    state = wait_requeued_job_end(slurm_cluster, job_id, 240, log)
    text = log.read_text(errors="replace")
    assert state[:2] == ("COMPLETED", "0:0"), text[-4000:]
    assert f"eddis_job: {COMPLETE_BEFORE_CHECKPOINT}" in text and "eddis_job: done, status 0" in text, text[-4000:]
    assert "requeued job" not in text and "stopped after step" not in text, text[-4000:]
    assert complete(ckpt) == [name]
    result = json.loads(out.read_text())
    assert result["counter"] == RACE_TOTAL and sorted(r["this_run"] for r in result["ranks"]) == [0, 1], result
