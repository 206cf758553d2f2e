"""The stack a supervisor fetches from a hung child: real child processes, real signals.

The child is a Python process that calls :func:`start_in_child` as `eddis-train`'s
trainers and smb-servers do; the watch asks it for its stack as the supervisors do
before they kill a hung process.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import python_env
from launch_helpers import wait_until

from eddis.launch.liveness import LivenessWatch, process_state

# Threads that keep running Python, and threads that come and go (as the thread states of
# native threads calling into Python do), while the main thread is dumped: faulthandler's
# native dump walks their frames and thread states as they change.
BUSY_THREADS = """
import threading
def churn():
    def inner(n):
        return [str(i) for i in range(n)]
    while True:
        inner(50)
def come_and_go():
    while True:
        t = threading.Thread(target=lambda: None, daemon=True)
        t.start()
        t.join()
for target in (churn, churn, come_and_go):
    threading.Thread(target=target, daemon=True).start()
"""

CHILDREN = {
    # the main thread in Python (a sleeping loop, like the smb-server's), others busy
    "sleeping": BUSY_THREADS + """
def wait_in_the_main_loop():
    while True:
        time.sleep(0.2)
wait_in_the_main_loop()
""",
    # the main thread deadlocked in a C call that holds the GIL (ctypes.PyDLL keeps it): a
    # mutex locked twice, whose wait no signal ends
    "holding the GIL": """
import ctypes
def lock_for_ever():
    libc = ctypes.PyDLL(None)
    mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER, a normal mutex
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)
lock_for_ever()
""",
}


def start_child(tmp_path, body):
    watch = LivenessWatch(timeout=30, stack_dir=tmp_path)
    code = textwrap.dedent("""
        import sys, time
        from eddis.launch.liveness import start_in_child
        start_in_child()
        time.sleep(0.3)  # the first heartbeats, before a main thread that holds the GIL starts
        print("ready", flush=True)
    """) + body
    child = subprocess.Popen([sys.executable, "-c", code], env=python_env(watch.child_env()),
                             pass_fds=watch.pass_fds, stdout=subprocess.PIPE, text=True)
    watch.started(child.pid)
    assert child.stdout.readline().strip() == "ready"
    wait_until(lambda: watch.hung() is None and watch.beats > 0 or None, 30, what="the first heartbeat")
    return watch, child


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", sorted(CHILDREN))
def test_the_stack_of_a_stopped_child_names_its_main_thread_and_leaves_it_alive(tmp_path, how):
    function = {"sleeping": "wait_in_the_main_loop", "holding the GIL": "lock_for_ever"}[how]
    # a main thread that returns to the interpreter is dumped by the handler that holds the GIL;
    # one stuck in C only by faulthandler's native handler
    under_the_gil = how == "sleeping"
    watch, child = start_child(tmp_path, CHILDREN[how])
    try:
        time.sleep(0.5)
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(lambda: process_state(child.pid) == "T" or None, 10, what="the child to stop")
        stack = watch.stack()
        assert stack is not None
        assert f"in {function}" in stack, stack
        assert ("in dump_stacks_under_the_gil" in stack) == under_the_gil, stack
        time.sleep(0.5)
        # the dump did not end the child: its status is the supervisor's SIGKILL, not a crash
        assert child.poll() is None, f"the child ended with {child.returncode} while it was dumped:\n{stack}"
    finally:
        child.kill()
        child.wait(timeout=30)
        watch.close()
    assert child.returncode == -signal.SIGKILL


@pytest.mark.timeout(300)
def test_repeated_dumps_of_a_child_with_busy_threads_never_crash_it(tmp_path):
    # faulthandler's native dump once crashed a stopped smb-server (SIGSEGV in
    # _Py_DumpTracebackThreads, walking threads that ran on); the dump under the GIL
    # must not, however often it runs
    watch, child = start_child(tmp_path, CHILDREN["sleeping"])
    try:
        time.sleep(0.5)  # into its main loop
        for attempt in range(25):
            stack = watch.stack()
            assert stack is not None and "in wait_in_the_main_loop" in stack, (attempt, stack)
            assert "in dump_stacks_under_the_gil" in stack, (attempt, stack)
            assert child.poll() is None, f"dump {attempt} ended the child with status {child.returncode}"
    finally:
        child.kill()
        child.wait(timeout=30)
        watch.close()
