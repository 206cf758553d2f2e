"""Which failures a Slurm job starts again for (EDDIS_START_RETRIES): a rank that crashed before
its eddis.init() returned, as Open MPI 4.1 does inside MPI_Init under Slurm's PMIx about once
in 250 starts; nothing else. The records are written by the launcher's own LaunchRecords and
read by eddis.launch.report.start_up_crash; the retry itself runs on the Slurm cluster in
test_restart_requeue.py."""
import signal
import time

import pytest

from eddis.launch.report import LaunchRecords, server_records, start_up_crash
from eddis.smb.rundir import write_json_atomic


def failed(records, rank, sig=None, code=None, why=None, at=None):
    record = {"rank": rank, "host": f"n{rank + 1}", "code": code, "signal": sig, "time": at or time.time()}
    if why:
        record["why"] = why
    records.fail(rank, record)
    return record


def initialized(records, rank):
    write_json_atomic(records.init_file(rank), {"pid": 1, "time": time.time()})


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE])
def test_a_rank_that_crashed_before_eddis_init_is_a_start_up_crash(tmp_path, sig):
    records = LaunchRecords(tmp_path, "5.0")
    initialized(records, 0)
    record = failed(records, 1, sig=int(sig))
    assert start_up_crash(tmp_path) == record


@pytest.mark.parametrize("sig,code", [(signal.SIGKILL, None), (signal.SIGTERM, None), (None, 1)])
def test_a_rank_killed_or_exiting_before_eddis_init_is_none(tmp_path, sig, code):
    # a node that died, a cancel, a script's own error: starting again would not help
    records = LaunchRecords(tmp_path, "5.0")
    failed(records, 1, sig=None if sig is None else int(sig), code=code)
    assert start_up_crash(tmp_path) is None


def test_a_crash_after_eddis_init_is_none(tmp_path):
    records = LaunchRecords(tmp_path, "5.0")
    initialized(records, 1)
    failed(records, 1, sig=int(signal.SIGSEGV))
    assert start_up_crash(tmp_path) is None


def test_a_hung_rank_is_none(tmp_path):
    records = LaunchRecords(tmp_path, "5.0")
    failed(records, 1, sig=int(signal.SIGABRT), why="hung")
    assert start_up_crash(tmp_path) is None


def test_a_failed_server_before_the_crash_is_the_root_cause_and_none(tmp_path):
    now = time.time()
    server_records(tmp_path).fail(0, {"server": 0, "host": "n1", "code": 1, "signal": None, "time": now - 1})
    failed(LaunchRecords(tmp_path, "5.0"), 1, sig=int(signal.SIGSEGV), at=now)
    assert start_up_crash(tmp_path) is None


def test_only_the_latest_failed_launch_counts(tmp_path):
    # the retry's launch failed after its init: no second retry for the first launch's crash
    first = LaunchRecords(tmp_path, "5.0")
    failed(first, 1, sig=int(signal.SIGSEGV))
    time.sleep(0.01)   # launches are ordered by their folder's time
    second = LaunchRecords(tmp_path, "5.1")
    initialized(second, 1)
    failed(second, 1, sig=int(signal.SIGSEGV))
    assert start_up_crash(tmp_path) is None


def test_no_failure_is_none(tmp_path):
    LaunchRecords(tmp_path, "5.0").start(0, {"rank": 0, "host": "n1"})
    assert start_up_crash(tmp_path) is None
