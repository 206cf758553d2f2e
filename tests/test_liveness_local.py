"""Liveness and the root cause under `eddis-train --local`: real ranks, a real smb-server, real signals.

Every run sets EDDIS_COMM_TIMEOUT and SMB_TIMEOUT to 600 s: a job that ends well within
120 s was ended by the liveness watch (EDDIS_LIVENESS_TIMEOUT=5), not by a timeout.
"""
import json
import os
import re
import signal
import subprocess
import time

import pytest
pytestmark = pytest.mark.mpi  # starts real Open MPI ranks

from conftest import REPO, python_env
from launch_helpers import TRAINER, current_rank_records, make_bin, processes_with_env, wait_until

import eddis.smb.server  # noqa: F401  (required: missing is a failure, not a skip)

SMB_TRAINER = REPO / "tests" / "launch_scripts" / "smb_trainer.py"
BOUND = 120  # seconds: far below the 600 s the job's own waits would take


def env_for(tmp_path, **extra):
    bin_dir = make_bin(tmp_path / "bin")
    return python_env({"PATH": f"{bin_dir}:{os.environ['PATH']}", "EDDIS_RUN_DIR": str(tmp_path / "run"),
                       "SMB_MEMORY": "64M", "EDDIS_LIVENESS_TIMEOUT": "5", "EDDIS_COMM_TIMEOUT": "600",
                       "SMB_TIMEOUT": "600", **extra})


def start(tmp_path, *args, **extra):
    return subprocess.Popen(["eddis-train", "--local", *map(str, args)], env=env_for(tmp_path, **extra),
                            cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc, timeout=BOUND):
    """(exit status, stdout, stderr, seconds it took from now); kills the run on timeout."""
    began = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the run did not end within {timeout} s\n--- stdout ---\n{out}\n--- stderr ---\n{err}")
    return proc.returncode, out, err, time.monotonic() - began


def started_ranks(tmp_path, ranks):
    """{rank: record} of the newest launch once its ``ranks`` records are there (a start retry
    leaves the crashed launch's records, whose processes are gone, beside them)."""
    return wait_until(lambda: current_rank_records(tmp_path / "run", ranks), 60, what=f"{ranks} ranks to start")


def server_record(tmp_path):
    path = tmp_path / "run" / "servers" / "0.json"
    wait_until(path.exists, 60, what="the smb-server to publish")
    return json.loads(path.read_text())


def assert_nothing_left(tmp_path):
    assert wait_until(lambda: processes_with_env("EDDIS_RUN_DIR", str(tmp_path / "run")) == [] or None, 15,
                      what="the run's processes to exit") is True


@pytest.mark.timeout(180)
def test_stopped_rank_is_named_within_seconds(tmp_path):
    proc = start(tmp_path, "-n", "2", TRAINER, "--steps", "3000", "--step-seconds", "0.05")
    started_ranks(tmp_path, 2)
    time.sleep(2)  # into the training loop, with heartbeats flowing
    ranks = started_ranks(tmp_path, 2)   # read now: a start retry would have replaced them
    os.kill(ranks[1]["trainer_pid"], signal.SIGSTOP)
    code, out, err, took = finish(proc)
    assert took < BOUND
    assert code == 137, err  # the hung rank was killed: its status is the job's
    report = err[err.index("ROOT CAUSE"):]
    assert re.search(r"ROOT CAUSE: rank 1 on host \S+ hung \(.*stopped by a signal \(SIGSTOP", report), report
    # its stack, fetched from the stopped process before it was killed
    assert "its Python stack when it was found hung (rank 1)" in report and "mpi_trainer.py" in report
    assert "stopped by the launcher: rank 0" in report
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig, how", [(signal.SIGSTOP, "hung"),
                                      (signal.SIGKILL, r"was killed by signal 9 \(SIGKILL\)")],
                         ids=["stopped", "killed"])
def test_a_stopped_or_killed_server_is_the_root_cause_not_a_rank(tmp_path, sig, how):
    proc = start(tmp_path, "-n", "2", SMB_TRAINER, "--steps", "3000")
    started_ranks(tmp_path, 2)
    server = server_record(tmp_path)
    time.sleep(3)
    os.kill(server["pid"], sig)
    code, out, err, took = finish(proc)
    assert took < BOUND
    assert code == 137, err
    report = err[err.index("ROOT CAUSE"):]
    assert re.search(rf"ROOT CAUSE: smb-server 0 on host \S+ \(pid {server['pid']}\) {how}", report), report
    if sig == signal.SIGSTOP:
        assert "its Python stack when it was found hung (smb-server 0)" in report
    assert "ROOT CAUSE: rank" not in err
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(180)
def test_every_rank_failing_at_once_ends_within_seconds(tmp_path):
    # The old wait for the peers' exit records took EDDIS_STOP_GRACE + 10 s = 70 s here.
    proc = start(tmp_path, "-n", "2", TRAINER, "--steps", "50", "--step-seconds", "0.05", "--fail-rank", "-2",
                 "--fail-step", "2", EDDIS_STOP_GRACE="60")
    code, out, err, took = finish(proc)
    assert code == 1, err  # the root cause's own status
    assert took < 45, f"took {took:.0f} s"
    assert re.search(r"ROOT CAUSE: rank [01] on host \S+ exited with code 1", err), err
    assert re.search(r"failed after it \(probably as a consequence\): rank [01]@\S+ \(exited with code 1\)", err)
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(60)
def test_misspelt_setting_is_refused_before_anything_starts(tmp_path):
    proc = start(tmp_path, "-n", "2", TRAINER, EDDIS_MOED="sync")
    code, out, err, took = finish(proc, timeout=30)
    assert code == 2
    assert err.count("unknown setting EDDIS_MOED") == 1 and "Did you mean EDDIS_MODE?" in err, err
    assert "smb-server" not in out + err and not (tmp_path / "run").exists()


@pytest.mark.timeout(60)
def test_missing_script_is_refused_before_anything_starts(tmp_path):
    proc = start(tmp_path, "-n", "2", "no_such_train.py")
    code, out, err, took = finish(proc, timeout=30)
    assert code == 2
    assert "the training script no_such_train.py does not exist" in err and "nothing was started" in err, err
    assert "smb-server" not in out + err and not (tmp_path / "run").exists()



# a stopped supervisor, the report's name for it and the run's status: a supervisor found hung is
# killed by its child (137, as a hung trainer or server); the top's sentinel kills the top (-9)
SUPERVISORS = {"rank": (TRAINER, r"the eddis-train supervisor of rank 1 on host \S+", 137),
               "server": (SMB_TRAINER, r"the eddis-train supervisor of smb-server 0 on host \S+", 137),
               "top": (TRAINER, r"eddis-train --local on host \S+", -signal.SIGKILL)}


def supervisor_pid(tmp_path, proc, which):
    if which == "rank":
        return started_ranks(tmp_path, 2)[1]["supervisor_pid"]
    if which == "server":
        path = tmp_path / "run" / "launch" / "smb-servers" / "started" / "0.json"
        return json.loads(path.read_text())["supervisor_pid"]
    return proc.pid


@pytest.mark.timeout(180)
@pytest.mark.parametrize("which", sorted(SUPERVISORS),
                         ids=["rank supervisor", "server supervisor", "eddis-train --local"])
def test_a_stopped_supervisor_is_the_root_cause_and_the_run_ends(tmp_path, which):
    trainer, name, status = SUPERVISORS[which]
    proc = start(tmp_path, "-n", "2", trainer, "--steps", "3000", "--step-seconds", "0.05")
    started_ranks(tmp_path, 2)
    time.sleep(2)  # into the training loop, with heartbeats flowing both ways
    pid = supervisor_pid(tmp_path, proc, which)
    os.kill(pid, signal.SIGSTOP)
    code, out, err, took = finish(proc)
    assert took < BOUND
    assert err.count("ROOT CAUSE") == 1, err
    report = err[err.index("ROOT CAUSE"):]
    assert re.search(rf"ROOT CAUSE: {name} \(pid {pid}\) hung \(.*stopped by a signal \(SIGSTOP", report), report
    assert code == status, err
    assert_nothing_left(tmp_path)   # the stopped supervisor too
