"""The watch of the watchers, process by process: a supervisor and its child watch each other,
the top eddis-train and its sentinel too. Real processes, real signals; the whole jobs are in
test_liveness_local.py and test_liveness_slurm.py."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import SRC, python_env
from launch_helpers import wait_until

from eddis.launch.liveness import process_state
from eddis.launch.topwatch import TopWatch

pytestmark = pytest.mark.slow  # the liveness timeouts are seconds of real time

TIMEOUT = 2  # EDDIS_LIVENESS_TIMEOUT of these tests

# A supervisor as eddis-train's are to the watch: it hands its child a verdict, beats to it,
# watches it and says when it finds it hung. ``wedge``: its main thread then holds the GIL for
# good (a C call through ctypes.PyDLL: a mutex locked twice), which stops its beat thread.
SUPERVISOR = textwrap.dedent("""
    import ctypes, subprocess, sys, time
    from eddis.launch.liveness import LivenessWatch
    from eddis.launch.verdict import supervisor_verdict
    from eddis.launch.report import LaunchRecords
    run_dir, mode = sys.argv[1], sys.argv[2]
    watch = LivenessWatch(timeout=%(timeout)s, verdict=supervisor_verdict(LaunchRecords(run_dir, "test"), 0,
                                                                       {"rank": 0, "host": "here"}))
    child = subprocess.Popen([sys.executable, "-c", "from eddis.launch.liveness import start_in_child; "
                              "start_in_child(); import time; time.sleep(600)"],
                             env=watch.child_env() | dict(__import__("os").environ), pass_fds=watch.pass_fds,
                             stdout=subprocess.DEVNULL)
    watch.started(child.pid)
    print(child.pid, flush=True)
    if mode == "wedge":
        time.sleep(1.0)   # beats both ways first
        libc = ctypes.PyDLL(None)
        mutex = ctypes.create_string_buffer(64)
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)
    for _ in range(int(sys.argv[3]) * 4):
        hung = watch.hung()
        if hung is not None:
            print("child hung:", hung, flush=True)
        time.sleep(0.25)
    print("done", flush=True)
""") % {"timeout": TIMEOUT}


def start_supervisor(tmp_path, mode, seconds=60):
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path / "run"), mode, str(seconds)],
                            env=python_env(), stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def gone(pid):
    return process_state(pid) in (None, "Z")


@pytest.mark.timeout(60)
def test_a_wedged_supervisor_is_recorded_and_killed_by_its_child(tmp_path):
    proc, child = start_supervisor(tmp_path, "wedge")
    assert proc.wait(timeout=30) == -signal.SIGKILL
    record = json.loads((tmp_path / "run" / "launch" / "test" / "failures" / "0.json").read_text())
    assert record["why"] == "hung" and record["hung"].startswith("no heartbeat for"), record
    assert record["supervisor"] == "eddis-train supervisor" and record["pid"] == proc.pid
    assert record["signal"] == signal.SIGKILL and record["rank"] == 0 and record["host"] == "here"
    exit_record = json.loads((tmp_path / "run" / "launch" / "test" / "exits" / "0.json").read_text())
    assert exit_record == record   # the launcher counts the rank as ended
    wait_until(lambda: gone(child), 10, what="the child to end with its supervisor")


@pytest.mark.timeout(60)
def test_a_pause_of_the_whole_group_kills_nothing(tmp_path):
    """Ctrl-Z (or scontrol suspend) stops a supervisor and its child together, for longer than
    the timeout; continued, neither takes the other for hung."""
    proc, child = start_supervisor(tmp_path, "watch", seconds=4 * TIMEOUT + 2)
    time.sleep(1.0)
    for pid in (proc.pid, child):
        os.kill(pid, signal.SIGSTOP)
    time.sleep(2.5 * TIMEOUT)
    for pid in (child, proc.pid):   # the watched one first or last: both ways must hold
        os.kill(pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "hung" not in out and out.strip().endswith("done"), out
    assert not (tmp_path / "run" / "launch").exists()
    os.kill(child, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_a_stopped_sentinel_is_replaced_and_none_outlives_the_top(tmp_path, monkeypatch):
    monkeypatch.setenv("EDDIS_LIVENESS_TIMEOUT", str(TIMEOUT))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p))
    watch = TopWatch("the test's top", tmp_path / "run").start()
    try:
        first = watch.proc.pid
        time.sleep(1.0)
        os.kill(first, signal.SIGSTOP)
        wait_until(lambda: watch.restarts == 1 and watch.proc.pid != first, 30, what="a new sentinel")
        assert gone(first)
        second = watch.proc.pid
        time.sleep(2 * TIMEOUT)   # the new one and this process watch each other quietly
        assert watch.proc.pid == second and watch.restarts == 1 and watch.proc.poll() is None
    finally:
        watch.close()
    assert watch.proc.returncode == 0   # it ended by itself at the end of the beats
    assert not (tmp_path / "run").exists()   # no verdict on this process was written
