"""``eddis-train --job`` in parts: the allocation read from Slurm's variables, the steps' command
lines, stop_steps against stub squeue/scancel, the signal handling. The whole job runs on the
real cluster in test_launch_slurm.py and test_liveness_slurm.py."""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import PYTHON, python_env

from eddis.errors import ConfigError
from eddis.launch import jobsteps, stepcommands, stepcontrol
from eddis.launch.allocation import Component, components, fewest_cpus
from eddis.launch.jobsteps import trainers_status
from eddis.launch.status import exit_status, run_status
from eddis.launch.stepcommands import server_step_command, trainer_step_command
from eddis.launch.stepcontrol import stop_steps

HETJOB = {"SLURM_JOB_ID": "41", "SLURM_HET_SIZE": "2",
          "SLURM_JOB_ID_HET_GROUP_0": "41", "SLURM_JOB_ID_HET_GROUP_1": "42",
          "SLURM_JOB_NUM_NODES_HET_GROUP_0": "2", "SLURM_JOB_NUM_NODES_HET_GROUP_1": "1",
          "SLURM_JOB_CPUS_PER_NODE_HET_GROUP_0": "16(x2)", "SLURM_JOB_CPUS_PER_NODE_HET_GROUP_1": "8"}


@pytest.mark.parametrize("text, fewest", [("16(x2),8", 8), ("4", 4), ("2(x3)", 2), ("12,6(x2),9", 6),
                                          ("", 1), (None, 1), ("junk", 1)])
def test_fewest_cpus(text, fewest):
    assert fewest_cpus(text) == fewest


def test_components_of_a_hetjob_and_of_a_plain_job():
    assert components(HETJOB) == [Component(0, 2, 16), Component(1, 1, 8)]
    plain = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_CPUS_PER_NODE": "4(x2),2"}
    assert components(plain) == [Component(None, 3, 2)]
    with pytest.raises(ConfigError, match="SLURM_JOB_NUM_NODES_HET_GROUP_1 is not set"):
        components({k: v for k, v in HETJOB.items() if k != "SLURM_JOB_NUM_NODES_HET_GROUP_1"})
    with pytest.raises(ConfigError, match="not a whole number"):
        components(dict(plain, SLURM_JOB_NUM_NODES="three"))


def test_job_ids_name_every_component():
    assert jobsteps.job_ids(HETJOB) == ["41", "42"]
    assert jobsteps.job_ids({"SLURM_JOB_ID": "7"}) == ["7"]


def test_server_steps_one_per_node_indexed_over_all_components():
    first, second = components(HETJOB)
    assert server_step_command(second, 2) == [
        "srun", "--het-group=1", "--job-name=smb-server", "--overlap", "--nodes=1", "--ntasks=1",
        "--ntasks-per-node=1", "--cpus-per-task=8", "--gres=none", "--kill-on-bad-exit=1",
        "bash", "-c", "exec eddis-train --smb-server $((2 + SLURM_NODEID))"]
    assert server_step_command(Component(None, 2, 4), 0)[1:3] == ["--job-name=smb-server", "--overlap"]
    assert stepcommands.server_count([first, second]) == 3


def test_server_index_is_offset_by_the_node_id():
    command = server_step_command(Component(1, 1, 8), 2)
    proc = subprocess.run(command[-3:-1] + [command[-1].replace("exec eddis-train", "echo")],
                          capture_output=True, text=True, timeout=30, env={"SLURM_NODEID": "1"})
    assert proc.stdout.strip() == "--smb-server 3"


def test_trainer_step_spans_every_component():
    parts = components(HETJOB)
    assert trainer_step_command(parts, ["train.py", "--epochs", "3"]) == [
        "srun", "--het-group=0,1", "--job-name=eddis-train", "--mpi=pmix", "--kill-on-bad-exit=1",
        "eddis-train", "train.py", "--epochs", "3"]
    assert trainer_step_command([Component(None, 1, 1)], ["t.py"])[1] == "--job-name=eddis-train"


def test_exit_status_is_the_shells():
    assert [exit_status(c) for c in (0, 3, -9, -15)] == [0, 3, 137, 143]
    assert [exit_status(None, s) for s in (9, 15)] == [137, 143] and exit_status(None) == 1


def test_a_runs_status_is_its_root_causes_and_never_0():
    assert run_status(None, 137) == 137
    assert run_status({"code": 3, "signal": None}, 137) == 3
    assert run_status({"code": None, "signal": 11}, 0) == 139
    assert run_status({"code": None, "signal": None, "why": "vanished"}, 0) == 1


def test_steps_named_reads_squeue_lines():
    listing = "41.0 smb-server\n42.0 smb-server\n41.1 eddis-train\n41.batch batch\n"
    assert jobsteps.steps_named(listing, "smb-server") == ["41.0", "42.0"]
    assert jobsteps.steps_named(listing, "eddis-train") == ["41.1"]
    assert jobsteps.steps_named("", "eddis-train") == []


def test_trainers_status_file_overrides(tmp_path):
    assert trainers_status(tmp_path, 137) == 137
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / jobsteps.TRAINERS_STATUS_FILE).write_text("1\n")
    assert trainers_status(tmp_path, 137) == 1


def _stubs(tmp_path, squeue_output):
    """squeue printing ``squeue_output``; scancel logging its arguments to scancel.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(f"#!/bin/sh\nprintf '{squeue_output}'\n")
    (bin_dir / "scancel").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scancel.log\n')
    for tool in ("squeue", "scancel"):
        (bin_dir / tool).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "41"}


@pytest.mark.timeout(60)
def test_stop_steps_gives_up_on_an_srun_whose_step_has_ended(tmp_path):
    # Slurm 22.05's srun can miss the end of a hetjob step and wait forever; stop_steps must
    # notice that Slurm no longer lists the step and end that srun instead of waiting on it.
    env = _stubs(tmp_path, "")
    stuck = subprocess.Popen(["sleep", "300"])
    began = time.monotonic()
    stop_steps("eddis-train", [stuck], env=env)
    took = time.monotonic() - began
    assert stuck.poll() == -signal.SIGKILL
    assert jobsteps.STEP_GONE_GRACE <= took < 10, took
    assert not (tmp_path / "scancel.log").exists()  # no step of that name to cancel


@pytest.mark.timeout(60)
def test_stop_steps_sigterms_the_named_steps_then_cancels_what_is_left(tmp_path):
    env = _stubs(tmp_path, "41.0 smb-server\\n42.0 smb-server\\n41.1 eddis-train\\n")
    stubborn = subprocess.Popen([PYTHON, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"],
                                stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline().strip() == "ready"
    began = time.monotonic()
    stop_steps("smb-server", [stubborn], env=env, wait=2)
    assert time.monotonic() - began < 10
    assert stubborn.poll() == -signal.SIGKILL
    assert (tmp_path / "scancel.log").read_text().splitlines() == ["--signal=TERM 41.0 42.0", "41.0 42.0"]


def test_stop_steps_returns_at_once_for_sruns_that_ended(tmp_path):
    env = _stubs(tmp_path, "41.0 smb-server\\n")
    done = subprocess.Popen(["true"])
    done.wait(timeout=30)
    began = time.monotonic()
    stop_steps("smb-server", [done, None], env=env)
    assert time.monotonic() - began < 2
    stop_steps("smb-server", [], env=env)


@pytest.mark.timeout(120)
def test_server_steps_end_by_themselves_when_asked(tmp_path, capsys):
    # a real smb-server under its supervisor, as a server step runs it: asked in the run dir,
    # it stops its server and exits 0 (its step would end COMPLETED), and nothing is cancelled
    from conftest import SRC

    env = _stubs(tmp_path, "41.0 smb-server\\n")
    run_dir = jobsteps.create_run_dir(tmp_path / "run")
    server_env = python_env({"EDDIS_RUN_DIR": str(run_dir), "SMB_MEMORY": "16M"})
    server = subprocess.Popen([PYTHON, "-m", "eddis.launch.train", "--smb-server", "0"], env=server_env,
                              cwd=str(SRC), stdin=subprocess.DEVNULL)
    try:
        assert jobsteps.wait_servers(run_dir, 1, timeout=60, watch_pids=[server.pid]) == 0
        stepcontrol.end_server_steps(run_dir, [server], env=env, wait=60)
        assert server.poll() == 0
    finally:
        if server.poll() is None:
            server.kill()
    assert not (tmp_path / "scancel.log").exists()
    assert "did not end" not in capsys.readouterr().err
    from eddis.launch.report import read_records, server_records

    (record,) = read_records(server_records(str(run_dir)).exits)
    assert (record["why"], record["code"]) == ("stopped", 0), record


@pytest.mark.timeout(60)
def test_server_steps_that_do_not_end_are_cancelled_and_the_job_says_so(tmp_path, capsys):
    env = _stubs(tmp_path, "41.0 smb-server\\n")
    deaf = subprocess.Popen([PYTHON, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"],
                            stdout=subprocess.PIPE, text=True)
    assert deaf.stdout.readline().strip() == "ready"
    stepcontrol.end_server_steps(tmp_path, [deaf], env=env, wait=2)
    assert deaf.poll() == -signal.SIGKILL
    assert "1 smb-server step(s) did not end within 2 s of the request to stop; cancelling them" in \
        capsys.readouterr().err
    assert (tmp_path / "scancel.log").read_text().splitlines() == ["--signal=TERM 41.0", "41.0"]
    assert (tmp_path / "launch" / "smb-servers-stop").exists()


SIGNALS_PROBE = """
import os, signal, sys
from eddis.errors import JobSignalled
from eddis.launch.jobsignals import JobSignals
signals = JobSignals().install()
try:
    os.kill(os.getpid(), signal.SIGTERM)
    signal.pause()
except JobSignalled as stop:
    print("stopping on", stop, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # a second one while the job stops: ignored
    os.kill(os.getpid(), signal.SIGINT)
    print("still stopping", flush=True)
signals.disarm()
os.kill(os.getpid(), signal.SIGTERM)  # once the job is finishing: ignored too
print("finished", flush=True)
"""


@pytest.mark.timeout(60)
def test_the_first_stop_signal_stops_the_job_and_later_ones_do_not_interrupt_it():
    proc = subprocess.run([sys.executable, "-c", SIGNALS_PROBE], capture_output=True, text=True, timeout=30,
                          env=python_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["stopping on SIGTERM", "still stopping", "finished"]


CHECKPOINT_SIGNAL_PROBE = """
import os, signal
from eddis.launch.jobsignals import JobSignals
signals = JobSignals().install()
os.kill(os.getpid(), signal.SIGUSR1)
os.kill(os.getpid(), signal.SIGUSR1)
print("asked", signals.checkpoint_asked, "stopping", signals.stopping, flush=True)
"""


@pytest.mark.timeout(60)
def test_the_warning_signal_asks_for_a_checkpoint_and_does_not_stop_the_job():
    proc = subprocess.run([sys.executable, "-c", CHECKPOINT_SIGNAL_PROBE], capture_output=True, text=True,
                          timeout=30, env=python_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["asked True stopping None"]


def test_a_new_run_of_the_job_forgets_the_last_runs_checkpoint_request(tmp_path):
    from eddis.smb import rundir

    run = jobsteps.create_run_dir(tmp_path / "run")
    assert rundir.checkpoint_request(run) is None and rundir.checkpoint_answer(run) is None
    rundir.request_checkpoint(run, "the time limit is near")
    rundir.answer_checkpoint_request(run, tmp_path / "ckpt" / "step-00000040", 40, terminated=True)
    assert rundir.checkpoint_request(run) == "the time limit is near"
    assert rundir.checkpoint_answer(run) == {"checkpoint": str(tmp_path / "ckpt" / "step-00000040"), "step": 40,
                                             "terminated": True}
    # requeued: same job id, same run dir; the new run must not stop at once
    jobsteps.create_run_dir(run)
    assert rundir.checkpoint_request(run) is None and rundir.checkpoint_answer(run) is None
    rundir.request_checkpoint(run, "again")
    rundir.retire_run_dir(run)
    assert rundir.checkpoint_request(run) is None


def test_job_refuses_to_run_outside_slurm(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never')\n")
    env = {k: v for k, v in python_env().items() if not k.startswith("SLURM_")}
    proc = subprocess.run([PYTHON, "-m", "eddis.launch.train", "--job", "--", str(script)], capture_output=True,
                          text=True, timeout=60, env=env, cwd=tmp_path)
    assert proc.returncode == 2
    assert "SLURM_JOB_ID is not set: eddis-train --job runs as the command of a Slurm batch job" in proc.stderr
    assert not os.path.exists(tmp_path / "never")


def test_job_checks_the_script_before_anything(tmp_path):
    env = dict(python_env(), SLURM_JOB_ID="41", SLURM_JOB_NUM_NODES="1", PATH="/usr/bin:/bin",
               EDDIS_RUN_DIR=str(tmp_path / "run"))
    proc = subprocess.run([PYTHON, "-m", "eddis.launch.train", "--job", "--", "no_such_train.py"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert proc.returncode == 2
    assert "the training script no_such_train.py does not exist" in proc.stderr
    assert not (tmp_path / "run").exists()  # no run dir, no server, no srun


def test_preemptions_are_counted_across_requeues_and_forgotten_by_a_first_run(tmp_path, monkeypatch):
    from eddis.launch import preemption

    run = jobsteps.create_run_dir(tmp_path / "run")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert preemption.preemptions(run) == 0
    assert preemption.count_preemption(run) == 1
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the run Slurm started after the requeue
    jobsteps.create_run_dir(run)
    assert preemption.preemptions(run) == 1
    assert preemption.count_preemption(run) == 2
    # job ids start again on a rebuilt cluster: a first run's count is another job's
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert preemption.preemptions(run) == 0
    assert preemption.count_preemption(run) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("answers_sigterm", [True, False])
def test_an_elastic_mpirun_is_asked_in_the_run_dir_then_terminated_then_killed(tmp_path, monkeypatch,
                                                                                answers_sigterm):
    """A real process plays mpirun: the stop request reaches the run dir first; one that outlives
    it and SIGTERM is killed with everything below it."""
    import json

    from eddis.launch.stepcontrol import stop_mpirun
    from eddis.launch.report import LAUNCH_DIR, STOP_FILE

    monkeypatch.setenv("EDDIS_STOP_GRACE", "0.2")
    handler = "" if answers_sigterm else "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    mpirun = subprocess.Popen([sys.executable, "-c", f"{handler}import time; time.sleep(600)"])
    time.sleep(0.5)   # its handler in place
    try:
        stop_mpirun(tmp_path, mpirun, "an smb-server step ended (status 1)", env={}, wait=0.5, poll=0.05)
        assert mpirun.wait(timeout=10) == (-signal.SIGTERM if answers_sigterm else -signal.SIGKILL)
    finally:
        mpirun.kill()
    request = json.loads((tmp_path / LAUNCH_DIR / STOP_FILE).read_text())
    assert (request["reason"], request["signal"]) == ("an smb-server step ended (status 1)", "SIGTERM")
