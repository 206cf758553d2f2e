"""The Slurm launch path on the local cluster: real sbatch/srun, hetjob over n1 (a100) and n2 (v100),
real Open MPI ranks (pmix), real smb-servers. Every wait is bounded."""
import os
import re
import signal
from pathlib import Path

import pytest

from conftest import PYTHON, REPO
from launch_helpers import (TRAINER, environ_of, last_start_attempt, make_bin, peers_ended_after_root_cause,
                            processes_with_env, shm_leftovers,
                            wait_for_training, wait_job_end, wait_until)

import eddis.smb.server  # noqa: F401  (required: missing is a failure, not a skip)

JOB_SCRIPT = REPO / "scripts" / "eddis_job.sh"
EXPECTED = {0: ("n1", 0, 0, "a100", "0"), 1: ("n1", 1, 0, "a100", "1"),
            2: ("n2", 0, 1, "v100", "0"), 3: ("n2", 1, 1, "v100", "1")}


@pytest.fixture
def job_env(slurm_cluster, tmp_path):
    bin_dir = make_bin(tmp_path / "bin")
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "EDDIS_RUN_DIR": str(tmp_path / "run"),
            "SMB_MEMORY": "64M", "OMP_NUM_THREADS": "1"}


def sbatch(cluster, env, out, *args):
    proc = cluster.run(["sbatch", "--parsable", f"--output={out}", JOB_SCRIPT, *map(str, args)], env=env,
                       timeout=60)
    return proc.stdout.strip().split(";")[0]


def assert_rank_lines(text):
    for rank, (host, local, group, gpu_type, gpu) in EXPECTED.items():
        assert re.search(rf"^\[{rank}@{host}\] eddis-train: rank {rank}/4 local {local}/2 group {group}/2 "
                         rf"host {host} gpu {gpu_type}:{gpu} CUDA_VISIBLE_DEVICES={gpu}$", text, re.M), text
        env = re.search(rf"^\[{rank}@{host}\] ENV (.*)$", text, re.M).group(1)
        for want in (f"EDDIS_RANK={rank}", "EDDIS_SIZE=4", f"EDDIS_LOCAL_RANK={local}", "EDDIS_LOCAL_SIZE=2",
                     f"EDDIS_GROUP={group}", "EDDIS_NUM_GROUPS=2", f"EDDIS_GPU_TYPE={gpu_type}",
                     f"EDDIS_HOSTNAME={host}", f"CUDA_VISIBLE_DEVICES={gpu}", f"MPI_RANK={rank}", "MPI_SIZE=4"):
            assert want in env.split(), (want, env)


def assert_job_left_nothing(run_dir, job_id):
    # Slurm reports the job ended only after its steps' processes are gone; ours must be gone too.
    assert wait_until(lambda: processes_with_env("EDDIS_RUN_DIR", str(run_dir)) == [] or None, 15,
                      what="the job's processes to exit") is True
    assert shm_leftovers(run_dir, f"eddis-{job_id}.") == []
    assert list(Path(run_dir, "servers").glob("*.json")) == []


@pytest.mark.timeout(300)
def test_submit_hetjob_trains_and_exits_zero(slurm_cluster, job_env, tmp_path):
    """eddis submit (for real) of a100:2 + v100:2: four ranks, one MPI world, right groups and GPUs."""
    out = tmp_path / "job-%j.out"
    proc = slurm_cluster.run([PYTHON, "-m", "eddis.cli", "submit", "--gpus", "a100:2,v100:2", "--time", "00:10:00",
                              "--output", out, TRAINER, "--steps", "4"], env=job_env, timeout=60)
    job_id = re.search(r"Submitted EDDIS job (\d+)", proc.stdout).group(1)
    state, code = wait_job_end(slurm_cluster, job_id, 180, out)
    text = Path(str(out).replace("%j", job_id)).read_text()
    assert (state, code) == ("COMPLETED", "0:0"), text
    assert_rank_lines(text)
    for rank in range(4):
        assert re.search(rf"^\[{rank}@n[12]\] DONE$", text, re.M)
    assert "smb-servers ready: 0@" in text and "eddis_job: done, status 0" in text
    assert_job_left_nothing(job_env["EDDIS_RUN_DIR"], job_id)
    assert not Path(job_env["EDDIS_RUN_DIR"], "token").exists()   # the job's secret ended with it
    assert_server_steps_ended_by_themselves(job_env["EDDIS_RUN_DIR"], text, servers=2)


def assert_server_steps_ended_by_themselves(run_dir, text, servers):
    """A successful job's smb-server steps are not cancelled: each server's supervisor stopped its
    server when asked and exited 0 (no accounting here, so not sacct: its output and records)."""
    from eddis.launch.report import read_records, server_records

    assert "CANCELLED" not in text, text
    assert not re.search(r"^slurmstepd.*error", text, re.M | re.I), text
    assert "did not end within" not in text, text
    ends = read_records(server_records(str(run_dir)).exits)
    assert sorted((r["server"], r["why"], r["code"]) for r in ends) == [
        (i, "stopped", 0) for i in range(servers)], ends


@pytest.mark.timeout(300)
def test_killed_rank_stops_the_job_with_a_report(slurm_cluster, job_env, tmp_path):
    out = tmp_path / "job.out"
    job_id = sbatch(slurm_cluster, job_env, out, TRAINER, "--steps", "3000", "--step-seconds", "0.1")
    run_dir = Path(job_env["EDDIS_RUN_DIR"])
    victim = wait_for_training(run_dir, out)[1]
    os.kill(victim["trainer_pid"], signal.SIGKILL)
    # the acceptance bound: the whole job ends within 60 s of the kill
    state, code = wait_job_end(slurm_cluster, job_id, 60, out)
    text = out.read_text()
    assert state == "FAILED" and code != "0:0", (state, code, text)
    assert re.search(r"ROOT CAUSE: rank 1 on host n1 was killed by signal 9 \(SIGKILL\)", text), text
    assert peers_ended_after_root_cause(text) == [0, 2, 3], text
    assert "step 2999" not in text
    assert_job_left_nothing(run_dir, job_id)


@pytest.mark.timeout(300)
def test_rank_exception_report_has_the_traceback(slurm_cluster, job_env, tmp_path):
    out = tmp_path / "job.out"
    job_id = sbatch(slurm_cluster, job_env, out, TRAINER, "--steps", "3000", "--step-seconds", "0.1",
                    "--fail-rank", "2", "--fail-step", "5")
    state, code = wait_job_end(slurm_cluster, job_id, 180, out)
    text = out.read_text()
    assert state == "FAILED", text
    report = text[text.index("ROOT CAUSE"):]
    assert re.search(r"ROOT CAUSE: rank 2 on host n2 exited with code 1", report)
    assert "RuntimeError: injected failure on rank 2 at step 5" in report
    assert_job_left_nothing(job_env["EDDIS_RUN_DIR"], job_id)


def assert_servers_hold_the_jobs_cpus(run_dir):
    """Each smb-server step may use every CPU its component holds on the node (for its reduction
    threads), not the one CPU a step's task gets by default."""
    servers = [pid for pid, cmd in processes_with_env("EDDIS_RUN_DIR", str(run_dir))
               if "eddis.smb.server import main" in cmd]
    assert len(servers) == 2, servers
    for pid in servers:
        env = environ_of(pid)
        group = env.get("SLURM_HET_JOB_OFFSET", "0")
        held = env.get(f"SLURM_JOB_CPUS_PER_NODE_HET_GROUP_{group}") or env["SLURM_JOB_CPUS_PER_NODE"]
        fewest = min(int(part.split("(")[0]) for part in held.split(","))
        assert fewest > 1, held  # the test jobs hold several CPUs per node
        assert env.get("SLURM_CPUS_PER_TASK") == str(fewest), (env.get("SLURM_CPUS_PER_TASK"), held)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpoints", [False, True], ids=["plain", "with-checkpoint-dir"])
def test_scancel_leaves_nothing_behind(slurm_cluster, job_env, tmp_path, checkpoints):
    # with EDDIS_CHECKPOINT_DIR the steps would outlive a SIGTERM that reached them alone (a
    # preemption); the job's own SIGTERM (scancel) stops them at once all the same
    out = tmp_path / "job.out"
    if checkpoints:
        job_env = dict(job_env, EDDIS_CHECKPOINT_DIR=str(tmp_path / "ckpt"))
    job_id = sbatch(slurm_cluster, job_env, out, TRAINER, "--steps", "3000", "--step-seconds", "0.1")
    run_dir = Path(job_env["EDDIS_RUN_DIR"])
    wait_for_training(run_dir, out)
    assert_servers_hold_the_jobs_cpus(run_dir)
    slurm_cluster.run(["scancel", job_id], timeout=30)
    state, _ = wait_job_end(slurm_cluster, job_id, 60, out)
    assert state == "CANCELLED", state
    assert_job_left_nothing(run_dir, job_id)
    text = out.read_text()
    assert "ROOT CAUSE" not in last_start_attempt(text)  # a cancelled job is not a rank failure
    assert "eddis_job: SIGTERM received, the trainers and smb-servers are stopping" in text, text
    assert not Path(run_dir, "token").exists()


@pytest.mark.timeout(300)
def test_servers_that_cannot_start_fail_the_job_clearly(slurm_cluster, job_env, tmp_path):
    out = tmp_path / "job.out"
    # a value that parses and lies in its range (the job script's first check lets it through), and
    # that the server refuses: more memory than the node has
    job_id = sbatch(slurm_cluster, dict(job_env, SMB_MEMORY="64T"), out, TRAINER, "--steps", "1")
    state, code = wait_job_end(slurm_cluster, job_id, 120, out)
    text = out.read_text()
    assert state == "FAILED", text
    assert "SMB_MEMORY=65536.0 GiB (70368744177664 bytes) is more than" in text, text
    assert re.search(r"the smb-server step \(pid [\d, ]+\) ended before all 2 servers published", text), text
    assert "eddis-train: rank" not in text  # no trainer was started
    assert_job_left_nothing(job_env["EDDIS_RUN_DIR"], job_id)


@pytest.mark.timeout(300)
def test_dead_server_stops_the_trainers(slurm_cluster, job_env, tmp_path):
    out = tmp_path / "job.out"
    job_id = sbatch(slurm_cluster, job_env, out, TRAINER, "--steps", "3000", "--step-seconds", "0.1")
    run_dir = Path(job_env["EDDIS_RUN_DIR"])
    wait_for_training(run_dir, out)
    server = __import__("json").loads((run_dir / "servers" / "1.json").read_text())
    os.kill(server["pid"], signal.SIGKILL)
    state, code = wait_job_end(slurm_cluster, job_id, 60, out)
    text = out.read_text()
    assert state == "FAILED", text
    # the supervisor sees the server's step end first, or the trainers that lost the server do
    assert re.search(r"an smb-server step ended \(status \S+\) during training; "
                     r"(stopping the trainers|the trainers stopped with status)", text), text
    assert "step 2999" not in text
    # the killed server could not remove its own files; everything else must be gone
    assert wait_until(lambda: processes_with_env("EDDIS_RUN_DIR", str(run_dir)) == [] or None, 15,
                      what="the job's processes to exit") is True
    from eddis.smb.server import arena_name

    killed_arena = "/dev/shm" + arena_name(run_dir, 1)
    assert [p for p in shm_leftovers(run_dir, f"eddis-{job_id}.") if p != killed_arena] == []
    if os.path.exists(killed_arena):  # ours to tidy (a SIGKILLed server cannot)
        os.unlink(killed_arena)


INTERRUPTIBLE = REPO / "tests" / "launch_scripts" / "interruptible_trainer.py"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("whom", ["--batch", "--full", "every step"])
def test_interrupted_job_runs_every_ranks_keyboard_interrupt_handler(slurm_cluster, job_env, tmp_path, whom):
    """SIGINT to the job: --batch, as Ctrl-C on an interactive eddis-train --job; --full, the
    job shell and its sruns; every step (plain scancel --signal=INT): Slurm signals every
    process of every step, so a trainer gets SIGINT from slurmstepd and from its supervisor,
    and the servers get it too. Each rank's script handles one KeyboardInterrupt (a barrier,
    then a marker file), the servers outlive the handlers, and the job exits 130."""
    out = tmp_path / "job.out"
    markers = tmp_path / "markers"
    markers.mkdir()
    job_id = sbatch(slurm_cluster, job_env, out, INTERRUPTIBLE, markers)
    wait_until(lambda: out.exists() and all(re.search(rf"^\[{r}@\S+\] step 3$", out.read_text(), re.M)
                                            for r in range(4)), 120, interval=0.5, what="all ranks to step")
    slurm_cluster.run(["scancel", *([] if whom == "every step" else [whom]), "--signal=INT", job_id], timeout=30)
    state, code = wait_job_end(slurm_cluster, job_id, 120, out)
    text = out.read_text()
    for rank in range(4):
        assert re.search(rf"^\[{rank}@n[12]\] rank {rank}: saved$", text, re.M), text
        assert (markers / f"interrupted.{rank}").exists(), text
    if whom == "every step":
        assert "eddis_job: the trainers were interrupted (SIGINT)" in text, text
        assert "an smb-server step ended" not in text, text
    else:
        assert "eddis_job: interrupted (SIGINT)" in text and "eddis_job: interrupted by SIGINT, status 130" in text, text
        assert_server_steps_ended_by_themselves(job_env["EDDIS_RUN_DIR"], text, servers=2)
    assert code == "130:0", (state, code, text)
    assert "ROOT CAUSE" not in last_start_attempt(text) and "never interrupted" not in text, text
    assert "sending SIGTERM" not in text and "Traceback" not in text, text
    assert_job_left_nothing(job_env["EDDIS_RUN_DIR"], job_id)
