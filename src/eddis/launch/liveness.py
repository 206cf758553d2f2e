"""Liveness of the processes a supervisor runs: trainers and smb-servers.

A process that is stopped (SIGSTOP), deadlocked or wedged in the kernel makes no
error and no exit: its peers would only notice when their own wait times out
(``EDDIS_COMM_TIMEOUT``), and then blame themselves. So every process that
``eddis-train`` supervises sends heartbeats to its supervisor, and the
supervisor, not the process, decides that it has stopped making progress.

- The child: :func:`start_in_child` (called first thing by :mod:`.child` and by
  the smb-server step) starts a daemon thread that writes one byte per beat into
  a pipe inherited from the supervisor. The thread needs the interpreter: it
  stops when the process is stopped, and when a thread holds the GIL for good.
  It also answers two dump signals by writing every thread's Python stack into a
  file the supervisor opened: :data:`STACK_DUMP_SIGNAL`, a Python handler that
  runs on the main thread with the GIL held, so no other thread's frames change
  under it; and :data:`NATIVE_STACK_DUMP_SIGNAL`, :mod:`faulthandler`'s handler,
  which writes even when the main thread never returns to the interpreter (a C
  call holding the GIL) but walks the other threads' frames while they run, and
  so can crash the process it dumps.
- The supervisor: :class:`LivenessWatch` drains the pipe without blocking (the
  watched process is never waited on) and calls a process hung when no beat came
  for ``EDDIS_LIVENESS_TIMEOUT`` seconds, or when the kernel has shown it stopped
  that long (which also covers children that send no beats: not Python, or not
  yet started). It can then fetch the process's stack: the safe dump signal,
  then SIGCONT so that a stopped process runs its handler, then a bounded wait
  for the file; the native dump only where the safe one wrote nothing.

The heartbeat is a pipe to the parent, not a file in the run directory: both ends
are on one node, and thousands of ranks beating into a shared file system would
load its metadata server for nothing.
"""
import ctypes
import faulthandler
import os
import signal
import tempfile
import threading
import time

from .. import settings

HEARTBEAT_FD_VARIABLE = "EDDIS_HEARTBEAT_FD"
STACK_FD_VARIABLE = "EDDIS_STACK_FD"
BEAT_INTERVAL_VARIABLE = "EDDIS_HEARTBEAT_INTERVAL"
# Real-time signals: SIGUSR1/2 are the user's (sbatch --signal) and reach the trainer as they are.
STACK_DUMP_SIGNAL = signal.SIGRTMIN + 7
NATIVE_STACK_DUMP_SIGNAL = signal.SIGRTMIN + 6
# A main thread in Python or in a system call runs the safe handler within milliseconds.
SAFE_STACK_WAIT_SECONDS = 1.0
STACK_WAIT_SECONDS = 3.0

_PROCESS_STATES = {"R": "running", "S": "sleeping (waiting for an event)",
                   "D": "in uninterruptible sleep (blocked in the kernel, e.g. on I/O)",
                   "T": "stopped by a signal (SIGSTOP/SIGTSTP)", "t": "stopped by a debugger",
                   "Z": "a zombie (exited, not reaped)", "X": "dead"}


def beat_interval(timeout):
    """Seconds between two beats: several beats a timeout, so one late beat is no alarm."""
    return max(0.1, min(1.0, timeout / 5.0))


def process_state(pid, tid=None):
    """The kernel's one-letter state of ``pid`` (R, S, D, T, ...), or of its thread ``tid``;
    None once it is gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def describe_state(state):
    return _PROCESS_STATES.get(state, f"in state {state!r}") if state else "gone"


def _signal_main_thread(pid, sig):
    """A dump signal to the main thread (tid == pid): faulthandler walking every thread's
    frames from a native thread of the process (UCX's, the SMB core's) crashed it (SIGSEGV
    in _Py_DumpTracebackThreads), while on the main thread it is what faulthandler expects;
    a Python handler runs on the main thread whichever thread took the signal.
    False when the thread is gone: there is no stack to wait for."""
    tgkill = getattr(ctypes.CDLL(None, use_errno=True), "tgkill", None)  # glibc >= 2.30
    if tgkill is None:
        os.kill(pid, sig)
        return True
    return tgkill(pid, pid, sig) == 0


def start_in_child():
    """Beat to the supervisor and answer stack dumps; a no-op unless a supervisor asked for it.

    The variables are removed from the environment: the settings check of the
    runtime would not know them, and the user's subprocesses must not beat for us."""
    beat_fd = os.environ.pop(HEARTBEAT_FD_VARIABLE, None)
    stack_fd = os.environ.pop(STACK_FD_VARIABLE, None)
    interval = float(os.environ.pop(BEAT_INTERVAL_VARIABLE, "1.0") or 1.0)
    if stack_fd is not None:
        stack_file = int(stack_fd)
        faulthandler.register(NATIVE_STACK_DUMP_SIGNAL, file=stack_file, all_threads=True)

        def dump_stacks_under_the_gil(signum, frame):
            faulthandler.dump_traceback(file=stack_file, all_threads=True)

        signal.signal(STACK_DUMP_SIGNAL, dump_stacks_under_the_gil)
    if beat_fd is None:
        return
    fd = int(beat_fd)
    os.set_blocking(fd, False)

    def beat():
        while True:
            try:
                os.write(fd, b".")
            except BlockingIOError:
                pass  # the supervisor is behind; a full pipe already says we are alive
            except OSError:
                return  # the supervisor is gone
            time.sleep(interval)

    threading.Thread(target=beat, name="eddis-heartbeat", daemon=True).start()


class LivenessWatch:
    """The supervisor's end of one child's heartbeat.

    Use: ``env = watch.child_env()`` and ``pass_fds=watch.pass_fds`` for Popen,
    then ``watch.started(pid)``; ``watch.hung()`` once in a while, ``watch.stack()``
    before killing a hung child, ``watch.close()`` at the end."""

    def __init__(self, timeout=None, stack_dir=None):
        self.timeout = settings.get("EDDIS_LIVENESS_TIMEOUT") if timeout is None else float(timeout)
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self._stack = tempfile.TemporaryFile(dir=stack_dir, prefix="eddis-stack-")
        self.pid = None
        self.beats = 0
        self._last_sign = None  # monotonic time of the last beat (or of the start)
        self._stopped_since = None
        self._beating = True

    @property
    def enabled(self):
        return self.timeout > 0

    @property
    def pass_fds(self):
        return (self._write_fd, self._stack.fileno())

    def child_env(self):
        return {HEARTBEAT_FD_VARIABLE: str(self._write_fd), STACK_FD_VARIABLE: str(self._stack.fileno()),
                BEAT_INTERVAL_VARIABLE: f"{beat_interval(self.timeout or 30.0):g}"}

    def started(self, pid):
        self.pid = pid
        self._last_sign = time.monotonic()
        os.close(self._write_fd)  # so that the pipe ends (EOF) when the child and its heirs are gone
        self._write_fd = -1

    def _drain(self):
        while self._beating:
            try:
                data = os.read(self._read_fd, 4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # the child closed its end (exec'd or closed its fds): no beats to expect
                self._beating = False
                return
            self.beats += len(data)
            self._last_sign = time.monotonic()

    def hung(self):
        """None while the child shows signs of life; else why it counts as hung (a sentence)."""
        if not self.enabled or self.pid is None:
            return None
        self._drain()
        now = time.monotonic()
        state = process_state(self.pid)
        if state in ("T", "t"):
            self._stopped_since = self._stopped_since or now
        else:
            self._stopped_since = None
        if self._stopped_since is not None and now - self._stopped_since > self.timeout:
            return (f"{describe_state(state)} for {now - self._stopped_since:.0f} s, "
                    f"EDDIS_LIVENESS_TIMEOUT={self.timeout:g}")
        # Before its first beat a child is still starting (or sends none): only the state counts.
        if self._beating and self.beats and now - self._last_sign > self.timeout:
            return (f"no heartbeat for {now - self._last_sign:.0f} s, EDDIS_LIVENESS_TIMEOUT={self.timeout:g}; "
                    f"it is {describe_state(state)}")
        return None

    def stack(self):
        """Every thread's Python stack of the (hung) child, or None where it cannot be had.

        First the dump that runs with the GIL held; only if it wrote nothing (the main
        thread is stuck in C), faulthandler's, which may crash the child: it is killed next
        anyway, and a stack is what tells why it hung."""
        if self.pid is None or not self.beats:
            return None  # no dump handlers there (not Python, or it never got that far)
        self._stack.seek(0, os.SEEK_END)
        before = self._stack.tell()
        size = self._wait_for_dump(STACK_DUMP_SIGNAL, before, SAFE_STACK_WAIT_SECONDS)
        if size == before:
            size = self._wait_for_dump(NATIVE_STACK_DUMP_SIGNAL, before, STACK_WAIT_SECONDS)
        if size <= before:
            return None
        self._stack.seek(before)
        return self._stack.read(size - before).decode("utf-8", "replace").rstrip() or None

    def _wait_for_dump(self, signum, before, seconds):
        """Ask for a dump with ``signum``; the file's size once the writing settled, or
        ``before`` when nothing came within ``seconds`` (or the process is gone)."""
        try:
            if not _signal_main_thread(self.pid, signum):
                return before
            os.kill(self.pid, signal.SIGCONT)  # a stopped process runs its handler only when continued
        except OSError:
            return before
        deadline = time.monotonic() + seconds
        size, settled_at = before, None
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now_size = os.fstat(self._stack.fileno()).st_size
            if now_size != size:
                size, settled_at = now_size, time.monotonic()
            elif settled_at is not None and time.monotonic() - settled_at > 0.2:
                break
        return size

    def close(self):
        for fd in (self._read_fd, self._write_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._read_fd = self._write_fd = -1
        self._stack.close()
