"""Elastic runs: the supervisors' beats before the training started, and the guard's verdict
on a rank whose beat stood still (eddis.launch.startbeats).

The records are the launcher's own LaunchRecords in a temporary run dir; the watch's clock
is passed in (``now``), so no test sleeps through a bound. The Slurm side (a node killed
before its ranks' training started) is in test_elastic_slurm.py.
"""
import subprocess
import sys
import time

import pytest

from eddis.launch import jobsteps, startbeats
from eddis.launch.report import VANISHED, LaunchRecords, format_report, root_cause
from eddis.launch.startbeats import StartBeat, StartWatch, announce, silence_bound


def _records(run_dir, size, hosts=None):
    records = LaunchRecords(run_dir, "12.0")
    for rank in range(size):
        records.start(rank, {"rank": rank, "host": (hosts or {}).get(rank, "n1"), "size": size,
                             "time": time.time()})
    return records


def _starts(records):
    from eddis.launch.report import read_records

    return read_records(records.ranks)


def _started(records, rank):
    records.started_file(rank).parent.mkdir(parents=True, exist_ok=True)
    records.started_file(rank).write_text("{}\n")


def test_a_beat_that_stands_still_fails_the_start_and_names_the_rank(tmp_path):
    records = _records(tmp_path, 3, hosts={2: "n2"})
    beats = [StartBeat(records, rank, enabled=True) for rank in range(3)]
    watch = StartWatch(records, lost_after=15.0)
    for beat in beats:
        beat.beat(now=0.0)
    assert watch.look(_starts(records), [], 3, now=0.0) == []
    # ranks 0 and 1 go on beating; rank 2's node is gone
    for t in (6.0, 12.0):
        beats[0].beat(now=t)
        beats[1].beat(now=t)
        assert watch.look(_starts(records), [], 3, now=t) == []
    found = watch.look(_starts(records), [], 3, now=18.0)
    assert [r["rank"] for r in found] == [2] and watch.vanished == {2}
    failure = found[0]
    assert failure["why"] == VANISHED and failure["host"] == "n2" and failure["lost"] is False
    assert failure["waited"] == 18
    # recorded where the supervisors look for a peer's failure, and the report names it
    assert records.first_failure(exclude_rank=0, lost=False)["rank"] == 2
    first, failures, exits = root_cause(tmp_path)
    assert first["rank"] == 2
    assert "rank 2 on host n2 was lost before its training started (no sign of life from its eddis-train " \
           "supervisor for 18 s: lost with its node?)" in format_report(first, failures, exits)
    assert announce(found) == [
        "eddis-train: rank 2 on host n2 gave no sign of life for 18 s before its training started (lost with "
        "its node?); failing the start: the other ranks may be waiting for it in a start-up collective"]
    # one verdict: the supervisors stop the rest
    assert watch.look(_starts(records), [], 3, now=60.0) == []


def test_ranks_that_started_or_ended_are_not_watched_and_beats_stop_at_the_start(tmp_path):
    records = _records(tmp_path, 3)
    beats = [StartBeat(records, rank, enabled=True) for rank in range(3)]
    for beat in beats:
        beat.beat(now=0.0)
    watch = StartWatch(records, lost_after=5.0)
    assert watch.look(_starts(records), [], 3, now=0.0) == []
    _started(records, 0)
    beats[0].beat(now=3.0)
    assert not beats[0].active   # from its start on, the SMB heartbeats say whether it lives
    exits = [{"rank": 1, "why": "exited", "code": 0}]
    beats[2].beat(now=3.0)
    beats[2].beat(now=6.0)
    assert watch.look(_starts(records), exits, 3, now=6.0) == []
    _started(records, 2)
    assert watch.look(_starts(records), exits, 3, now=30.0) == [] and watch.done
    assert not records.failure_names()


def test_a_rank_not_seen_alive_yet_is_not_judged(tmp_path):
    """A supervisor that has not beaten once may still be starting: only a beat that stops counts."""
    records = LaunchRecords(tmp_path, "12.0")   # rank 1 of 2 has neither a start record nor a beat
    records.start(0, {"rank": 0, "host": "n1", "size": 2, "time": time.time()})
    beat0 = StartBeat(records, 0, enabled=True)
    watch = StartWatch(records, lost_after=5.0)
    for t in range(0, 60, 5):
        beat0.beat(now=float(t))
        assert watch.look(_starts(records), [], 2, now=float(t)) == []
    beat1 = StartBeat(records, 1, enabled=True)
    beat1.beat(now=60.0)
    beat0.beat(now=60.0)
    assert watch.look(_starts(records), [], 2, now=60.0) == []
    beat0.beat(now=65.0)
    found = watch.look(_starts(records), [], 2, now=65.0)
    assert [(r["rank"], r["host"], r["waited"]) for r in found] == [(1, None, 5)]


def test_a_run_that_is_not_elastic_writes_no_beats(tmp_path):
    records = _records(tmp_path, 1)
    StartBeat(records, 0, enabled=False).beat(now=0.0)
    assert not records.beats.exists()


@pytest.mark.parametrize("lost_after, liveness, bound", [("30", "30", 15.0), ("5", "30", 5.0), ("30", "0", 30.0)])
def test_the_bound_comes_before_the_liveness_watch_kills_the_waiting_ranks(lost_after, liveness, bound):
    env = {"EDDIS_ELASTIC_LOST_AFTER": lost_after, "EDDIS_LIVENESS_TIMEOUT": liveness}
    assert silence_bound(env) == bound


@pytest.mark.timeout(60)
def test_the_guard_records_a_silent_rank_and_ends_a_launcher_left_waiting_for_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(startbeats, "WATCH_SECONDS", 0.05)
    records = _records(tmp_path, 2, hosts={1: "n2"})
    StartBeat(records, 1, enabled=True).beat()   # once: then its node is gone
    # rank 0 was stopped by its supervisor (the failure above), exit 0
    records.finish(0, {"rank": 0, "host": "n1", "code": 0, "signal": None, "why": "stopped", "time": time.time()})
    srun = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    env = {"EDDIS_ELASTIC_LOST_AFTER": "0.3"}
    try:
        assert jobsteps.guard_trainer_step(tmp_path, srun.pid, grace=0.5, poll=0.05, env=env,
                                           watch_start=True) == 0
        assert srun.wait(timeout=10) == -9
    finally:
        srun.kill()
    err = capsys.readouterr().err
    assert "rank 1 on host n2 gave no sign of life" in err and "1 of 2 ranks exited" in err, err
    assert records.first_failure()["why"] == VANISHED
    # the job's status, the root cause's (a vanished rank: 1), not the exit records' alone (0)
    assert (tmp_path / "launch" / "trainers.status").read_text().strip() == "1"
    assert "Job status 1," in err
