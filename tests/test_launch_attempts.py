"""The attempts of a run, their one end and the run's end, which ``--local`` and ``--job`` share
(eddis.launch.attempt, .restarts, .runend).

The launcher here starts nothing: each of its attempts writes the launch records that real
ranks write (eddis.launch.report.LaunchRecords) into a real run directory and hands its status
to the shared end, as local.LocalRun and jobrun.Job do once their trainers have ended. The
launches themselves run in test_launch_local.py, test_launch_slurm.py and
test_restart_requeue.py.
"""
import os
import signal
import time

import pytest

from eddis.launch import jobsteps
from eddis.launch.attempt import Launcher, end_attempt
from eddis.launch.report import LaunchRecords
from eddis.launch.restarts import run_attempts
from eddis.launch.runend import conclude
from eddis.smb import rundir


class RecordingLauncher(Launcher):
    """Attempts that end as ``outcomes`` say, one per attempt: (launcher status, per-rank
    (code, signal, why, initialized)); a rank with ``why`` "failed" records a failure."""

    def __init__(self, run_dir, outcomes, answer=None):
        self.run_dir = jobsteps.create_run_dir(run_dir)
        self.outcomes = list(outcomes)
        self.answer = answer
        self.restart_counts = []
        self.servers_ended = 0

    def attempt(self):
        self.restart_counts.append(os.environ["EDDIS_RESTART_COUNT"])
        status, ranks = self.outcomes.pop(0)
        records = LaunchRecords(self.run_dir, f"attempt-{len(self.restart_counts)}")
        now = time.time()
        for rank, (code, sig, why, initialized) in enumerate(ranks):
            records.start(rank, {"rank": rank, "host": "n1", "size": len(ranks), "time": now})
            if initialized:
                records.init_file(rank).parent.mkdir(parents=True, exist_ok=True)
                records.init_file(rank).write_text("{}\n")
            record = {"rank": rank, "host": "n1", "code": code, "signal": sig, "why": why, "time": now + rank,
                      "stop_signal": signal.SIGINT if why == "interrupted" else None}
            if why == "failed":
                records.fail(rank, record)
            records.finish(rank, dict(record, why="stopped" if why == "interrupted" else why))
        if self.answer is not None:
            rundir.answer_checkpoint_request(self.run_dir, *self.answer)
        return end_attempt(self, status)

    def end_servers(self):
        self.servers_ended += 1


def run(launcher):
    status, answer = run_attempts(launcher)
    return conclude(launcher, status, answer)


FINISHED = (0, [(0, None, "exited", True), (0, None, "exited", True)])
CRASHED_AT_START = (139, [(None, 11, "failed", False), (0, None, "stopped", False)])
FAILED = (3, [(0, None, "stopped", True), (3, None, "failed", True)])


@pytest.fixture(autouse=True)
def _settings(monkeypatch):
    for name in ("EDDIS_MAX_RESTARTS", "EDDIS_START_RETRIES", "EDDIS_ELASTIC", "EDDIS_RESTART_COUNT"):
        monkeypatch.setenv(name, "0")   # so that what the attempts set is undone too
        monkeypatch.delenv(name)


def test_a_crash_before_eddis_init_is_started_again_once_not_restarted(tmp_path, capsys):
    launcher = RecordingLauncher(tmp_path / "run", [CRASHED_AT_START, FINISHED])
    assert run(launcher) == 0
    assert launcher.restart_counts == ["0", "1"] and launcher.servers_ended == 2
    err = capsys.readouterr().err
    assert "ROOT CAUSE: rank 0 on host n1 was killed by signal 11 (SIGSEGV)" in err
    assert ("before eddis.init() returned: a crash in the start-up (Open MPI 4.1 under Slurm's PMIx crashes inside "
            "MPI_Init about once in 250 starts); starting the smb-server and the ranks again (start retry 1 of 1, "
            "EDDIS_START_RETRIES)") in err


def test_a_start_up_crash_every_time_ends_with_its_status_after_one_retry(tmp_path, capsys):
    launcher = RecordingLauncher(tmp_path / "run", [CRASHED_AT_START, CRASHED_AT_START, FINISHED])
    assert run(launcher) == 139 and len(launcher.outcomes) == 1
    err = capsys.readouterr().err
    assert "again after 1 start retry(ies) (EDDIS_START_RETRIES=1)" in err
    assert "eddis-train: failed, status 139" in err


def test_failed_trainers_restart_up_to_the_limit_with_the_root_causes_status(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EDDIS_MAX_RESTARTS", "1")
    launcher = RecordingLauncher(tmp_path / "run", [FAILED, FAILED, FINISHED])
    assert run(launcher) == 3 and launcher.restart_counts == ["0", "1"]
    err = capsys.readouterr().err
    assert err.count("restarting the smb-server and the ranks (restart 1 of 1)") == 1
    assert "the ranks failed again after 1 restart(s) (EDDIS_MAX_RESTARTS=1); giving up" in err


@pytest.mark.parametrize("status, ranks, said", [
    (143, [(None, 15, "stopped", True), (None, 15, "stopped", True)], "stopped by SIGTERM, status 143"),
    (143, [(0, None, "interrupted", True), (0, None, "interrupted", True)], "interrupted by SIGINT, status 130"),
])
def test_trainers_stopped_by_a_signal_are_not_restarted(tmp_path, capsys, monkeypatch, status, ranks, said):
    """A stop on purpose (a preemption's SIGTERM to the trainers, an interrupt every rank
    recorded) is no failure to run again, whichever launcher saw it."""
    monkeypatch.setenv("EDDIS_MAX_RESTARTS", "2")
    launcher = RecordingLauncher(tmp_path / "run", [(status, ranks), FINISHED])
    assert run(launcher) == int(said.rsplit(" ", 1)[1]) and len(launcher.restart_counts) == 1
    err = capsys.readouterr().err
    assert said in err and "restarting" not in err


def test_a_requested_checkpoint_without_a_queue_exits_75(tmp_path, capsys):
    launcher = RecordingLauncher(tmp_path / "run", [FINISHED], answer=("/ckpt/step-7", 7))
    assert run(launcher) == 75
    assert ("the ranks stopped after writing the requested checkpoint /ckpt/step-7 (step 7); run the same command "
            "again to resume from it (exit status 75)") in capsys.readouterr().err
