"""Liveness and the root cause of real Slurm jobs on the dev cluster (hetjob: n1 a100 + n2 v100).

The ranks wait 600 s (EDDIS_COMM_TIMEOUT, SMB_TIMEOUT) for anything; a job that ends well
within 120 s after a SIGSTOP was ended by the liveness watch (EDDIS_LIVENESS_TIMEOUT=5).
"""
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import REPO
from launch_helpers import (TRAINER, last_start_attempt, make_bin, processes_with_env, wait_for_training,
                            wait_job_end, wait_until)

import eddis.smb.server  # noqa: F401  (required: missing is a failure, not a skip)

JOB_SCRIPT = REPO / "scripts" / "eddis_job.sh"
SMB_TRAINER = REPO / "tests" / "launch_scripts" / "smb_trainer.py"
BOUND = 120


@pytest.fixture
def job_env(slurm_cluster, tmp_path):
    bin_dir = make_bin(tmp_path / "bin")
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "EDDIS_RUN_DIR": str(tmp_path / "run"),
            "SMB_MEMORY": "64M", "OMP_NUM_THREADS": "1", "EDDIS_LIVENESS_TIMEOUT": "5",
            "EDDIS_COMM_TIMEOUT": "600", "SMB_TIMEOUT": "600"}


def sbatch(cluster, env, out, *args):
    proc = cluster.run(["sbatch", "--parsable", f"--output={out}", JOB_SCRIPT, *map(str, args)], env=env,
                       timeout=60, cwd=str(REPO))
    return proc.stdout.strip().split(";")[0]


def assert_no_processes_left(run_dir):
    assert wait_until(lambda: processes_with_env("EDDIS_RUN_DIR", str(run_dir)) == [] or None, 30,
                      what="the job's processes to exit") is True


@pytest.mark.timeout(240)
def test_stopped_rank_is_named_and_ends_the_job(slurm_cluster, job_env, tmp_path):
    out = tmp_path / "job.out"
    job_id = sbatch(slurm_cluster, job_env, out, TRAINER, "--steps", "3000", "--step-seconds", "0.1")
    ranks = wait_for_training(job_env["EDDIS_RUN_DIR"], out, timeout=150)
    stopped_at = time.monotonic()
    os.kill(ranks[2]["trainer_pid"], signal.SIGSTOP)
    state, code = wait_job_end(slurm_cluster, job_id, BOUND, out)
    took = time.monotonic() - stopped_at
    text = last_start_attempt(out.read_text())
    assert state == "FAILED" and code == "137:0", (state, code, text)
    assert re.search(r"ROOT CAUSE: rank 2 on host n2 hung \(.*stopped by a signal \(SIGSTOP", text), text
    assert "its Python stack when it was found hung (rank 2)" in text and "mpi_trainer.py" in text
    assert text.count("ROOT CAUSE") == 1 and "eddis_job: failed, status 137" in text
    assert took < BOUND
    assert_no_processes_left(job_env["EDDIS_RUN_DIR"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig, how", [(signal.SIGSTOP, "hung"),
                                      (signal.SIGKILL, r"was killed by signal 9 \(SIGKILL\)")],
                         ids=["stopped", "killed"])
def test_a_stopped_or_killed_server_is_the_root_cause(slurm_cluster, job_env, tmp_path, sig, how):
    out = tmp_path / "job.out"
    job_id = sbatch(slurm_cluster, job_env, out, SMB_TRAINER, "--steps", "3000")
    run_dir = Path(job_env["EDDIS_RUN_DIR"])
    wait_for_training(run_dir, out, timeout=150)
    server = json.loads((run_dir / "servers" / "1.json").read_text())
    os.kill(server["pid"], sig)
    state, code = wait_job_end(slurm_cluster, job_id, BOUND, out)
    text = last_start_attempt(out.read_text())
    assert state == "FAILED" and code == "137:0", (state, code, text)
    assert re.search(rf"ROOT CAUSE: smb-server 1 on host n2 \(pid {server['pid']}\) {how}", text), text
    if sig == signal.SIGSTOP:
        assert "its Python stack when it was found hung (smb-server 1)" in text
    assert "ROOT CAUSE: rank" not in text
    assert_no_processes_left(run_dir)
    if sig == signal.SIGKILL:
        from eddis.smb.server import arena_name

        killed_arena = "/dev/shm" + arena_name(run_dir, 1)
        if os.path.exists(killed_arena):  # ours to tidy (a SIGKILLed server cannot)
            os.unlink(killed_arena)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("trainer", [[TRAINER, "--steps", "50", "--fail-rank", "-2", "--fail-step", "2"],
                                     [SMB_TRAINER, "--steps", "50", "--fail-all"]], ids=["mpi", "eddis"])
def test_every_rank_failing_at_once_reports_and_keeps_their_status(slurm_cluster, job_env, tmp_path, trainer):
    """Plain MPI ranks, and ranks of the EDDIS runtime on the job's smb-servers (whose exit
    would abort the MPI job, which under srun ends the supervisors too, if the trainer's
    runner did not end the process first)."""
    out = tmp_path / "job.out"
    # The old wait for the peers' exit records: EDDIS_STOP_GRACE + 10 s = 70 s, then PMIx killed them.
    env = dict(job_env, EDDIS_STOP_GRACE="60")
    began = time.monotonic()
    job_id = sbatch(slurm_cluster, env, out, *trainer)
    state, code = wait_job_end(slurm_cluster, job_id, BOUND, out)
    took = time.monotonic() - began
    text = out.read_text()
    assert state == "FAILED" and code == "1:0", (state, code, text)
    assert re.search(r"ROOT CAUSE: rank [0-3] on host n[12] exited with code 1", text), text
    assert "RuntimeError: injected failure" in text and "eddis_job: failed, status 1" in text
    assert took < 60, f"took {took:.0f} s"
    assert_no_processes_left(job_env["EDDIS_RUN_DIR"])


@pytest.mark.timeout(120)
def test_misspelt_setting_is_refused_once_before_the_servers(slurm_cluster, job_env, tmp_path):
    out = tmp_path / "job.out"
    job_id = sbatch(slurm_cluster, dict(job_env, EDDIS_MOED="sync"), out, TRAINER)
    state, code = wait_job_end(slurm_cluster, job_id, 60, out)
    text = out.read_text()
    assert state == "FAILED" and code == "2:0", (state, code, text)
    assert text.count("unknown setting EDDIS_MOED") == 1 and "Did you mean EDDIS_MODE?" in text, text
    assert "smb-server" not in text and "ROOT CAUSE" not in text and "eddis_job: job" not in text


@pytest.mark.timeout(120)
def test_missing_script_is_refused_before_the_servers(slurm_cluster, job_env, tmp_path):
    out = tmp_path / "job.out"
    job_id = sbatch(slurm_cluster, job_env, out, "no_such_train.py", "--epochs", "1")
    state, code = wait_job_end(slurm_cluster, job_id, 60, out)
    text = out.read_text()
    assert state == "FAILED" and code == "2:0", (state, code, text)
    assert text.count("the training script no_such_train.py does not exist") == 1, text
    assert "smb-server" not in text and "eddis-train: rank" not in text


def job_supervisor_pid(run_dir):
    """The pid of the job's eddis-train --job (the batch step's one command; not its sentinel's)."""
    found = wait_until(lambda: [pid for pid, cmd in processes_with_env("EDDIS_RUN_DIR", str(run_dir))
                                if "--job" in cmd.split() and "eddis.launch.topwatch" not in cmd], 30,
                       what="eddis-train --job")
    assert len(found) == 1, found
    return found[0]


def supervisor_pid(run_dir, which, ranks):
    if which == "rank":
        return ranks[2]["supervisor_pid"]
    if which == "server":
        return json.loads((Path(run_dir) / "launch" / "smb-servers" / "started" / "1.json").read_text())[
            "supervisor_pid"]
    return job_supervisor_pid(run_dir)


# a stopped supervisor, the report's name for it and Slurm's state and exit code of the job: a
# supervisor found hung is killed by its child (137, as a hung trainer or server); the --job
# supervisor by its sentinel (signal 9 ends the batch step)
SUPERVISORS = {"rank": (TRAINER, r"the eddis-train supervisor of rank 2 on host n2", ("FAILED", "137:0")),
               "server": (SMB_TRAINER, r"the eddis-train supervisor of smb-server 1 on host n2",
                          ("FAILED", "137:0")),
               "job": (TRAINER, r"eddis-train --job on host n1", ("FAILED", "0:9"))}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("which", sorted(SUPERVISORS),
                         ids=["eddis-train --job", "rank supervisor", "server supervisor"])
def test_a_stopped_supervisor_is_the_root_cause_and_the_job_ends(slurm_cluster, job_env, tmp_path, which):
    trainer, name, ended = SUPERVISORS[which]
    out = tmp_path / "job.out"
    job_id = sbatch(slurm_cluster, job_env, out, trainer, "--steps", "3000", "--step-seconds", "0.1")
    run_dir = Path(job_env["EDDIS_RUN_DIR"])
    ranks = wait_for_training(run_dir, out, timeout=150)
    pid = supervisor_pid(run_dir, which, ranks)
    os.kill(pid, signal.SIGSTOP)
    assert wait_job_end(slurm_cluster, job_id, BOUND, out) == ended, out.read_text()
    text = last_start_attempt(out.read_text())
    assert text.count("ROOT CAUSE") == 1, text
    assert re.search(rf"ROOT CAUSE: {name} \(pid {pid}\) hung \(.*stopped by a signal \(SIGSTOP", text), text
    listed = slurm_cluster.run(["squeue", "-h", "-j", job_id], check=False).stdout.strip()
    assert listed == "", listed   # the allocation is released
    assert_no_processes_left(run_dir)   # the stopped supervisor too
