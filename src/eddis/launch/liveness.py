"""Liveness of the processes a supervisor runs (trainers, smb-servers), and of the supervisors.

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

The supervisors are watched the same way, from below: a supervisor that is stopped
or wedged would keep its child (and the job) waiting for ever, and nothing above it
may be on its node. So a supervisor also beats to its child, through a second pipe
(``LivenessWatch(verdict=...)``, or ``watched=True``), and the child's beat thread
watches it by the same rule (:class:`ParentWatch`: no beat, or kernel-stopped, for
``EDDIS_LIVENESS_TIMEOUT``). Finding it hung, the child carries out the verdict the
supervisor handed it at the start (:mod:`.verdict`): it writes the records that
name the supervisor as the failure, as the supervisor would have named the child, asks
the run dir's ranks to stop where the verdict says so, and kills the supervisor, which
takes the child with it (``PR_SET_PDEATHSIG``; an smb-server stops itself cleanly
first, freeing its shared memory). A child that was handed no verdict (the sentinel of
the top ``eddis-train``, :mod:`.topwatch`) polls the watch itself. A supervisor is so
watched while its child runs: one stopped in the moment before its child started, or
after the child ended and before its own exit, is not found this way.

A watcher that was itself stopped as long as half the timeout (stopped with the process
it watches: Ctrl-Z on a process group, ``scontrol suspend``) counts the time from when it
runs again, so that a pause of the whole group kills nothing.

The heartbeat is a pipe to the parent, not a file in the run directory: both ends
are on one node, and thousands of ranks beating into a shared file system would
load its metadata server for nothing.
"""
import ctypes
import faulthandler
import json
import os
import select
import signal
import tempfile
import threading
import time

from .. import settings
from .verdict import end_hung_parent

HEARTBEAT_FD_VARIABLE = "EDDIS_HEARTBEAT_FD"
STACK_FD_VARIABLE = "EDDIS_STACK_FD"
BEAT_INTERVAL_VARIABLE = "EDDIS_HEARTBEAT_INTERVAL"
# the other direction: the supervisor's beats to its child, its pid, and what to do when it hangs
PARENT_BEAT_FD_VARIABLE = "EDDIS_PARENT_HEARTBEAT_FD"
PARENT_PID_VARIABLE = "EDDIS_PARENT_PID"
PARENT_TIMEOUT_VARIABLE = "EDDIS_PARENT_LIVENESS_TIMEOUT"
VERDICT_VARIABLE = "EDDIS_PARENT_VERDICT"
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
    Where the supervisor beats to us too, watch it: with its verdict (trainers, smb-servers)
    in the beat thread, which carries the verdict out when the supervisor hangs; without one,
    the :class:`ParentWatch` is returned, for the caller to poll (else None).

    The variables are removed from the environment: the settings check of the
    runtime would not know them, and the user's subprocesses must not beat for us."""
    beat_fd = os.environ.pop(HEARTBEAT_FD_VARIABLE, None)
    stack_fd = os.environ.pop(STACK_FD_VARIABLE, None)
    interval = float(os.environ.pop(BEAT_INTERVAL_VARIABLE, "1.0") or 1.0)
    parent = ParentWatch.from_environment()
    verdict = os.environ.pop(VERDICT_VARIABLE, None)
    verdict = json.loads(verdict) if verdict and parent is not None else None
    if stack_fd is not None:
        stack_file = int(stack_fd)
        faulthandler.register(NATIVE_STACK_DUMP_SIGNAL, file=stack_file, all_threads=True)

        def dump_stacks_under_the_gil(signum, frame):
            faulthandler.dump_traceback(file=stack_file, all_threads=True)

        signal.signal(STACK_DUMP_SIGNAL, dump_stacks_under_the_gil)
    if beat_fd is None and verdict is None:
        return parent
    fd = int(beat_fd) if beat_fd is not None else None
    if fd is not None:
        os.set_blocking(fd, False)

    def beat():
        while True:
            if fd is not None:
                try:
                    os.write(fd, b".")
                except BlockingIOError:
                    pass  # the supervisor is behind; a full pipe already says we are alive
                except OSError:
                    return  # the supervisor is gone
            if verdict is not None:
                why = parent.hung()
                if why is not None:
                    end_hung_parent(verdict, parent.pid, why)
                    return
            time.sleep(interval)

    threading.Thread(target=beat, name="eddis-heartbeat", daemon=True).start()
    return None if verdict is not None else parent


class _BeatReader:
    """One end of a heartbeat pipe: the beats of process ``pid``, and its kernel state."""

    def __init__(self, read_fd, pid, timeout):
        self.timeout = timeout
        self._read_fd = read_fd
        self.pid = pid
        self.beats = 0
        self._last_sign = None  # monotonic time of the last beat (or of the start)
        self._stopped_since = None
        self._beating = True
        self._last_look = None  # monotonic time of the last hung()

    @property
    def enabled(self):
        return self.timeout > 0

    def _drain(self):
        while self._beating:
            try:
                data = os.read(self._read_fd, 4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # the other end closed (it exec'd, closed its fds, or ended the watch)
                self._beating = False
                return
            self.beats += len(data)
            self._last_sign = time.monotonic()

    def hung(self):
        """None while the process shows signs of life; else why it counts as hung (a sentence)."""
        if not self.enabled or self.pid is None:
            return None
        self._drain()
        now = time.monotonic()
        if self._last_look is not None and now - self._last_look > self.timeout / 2:
            # the watcher did not run for that long itself: stopped with the watched process
            # (Ctrl-Z on a process group, scontrol suspend) and continued before it; time
            # counts from now, or the watched process would be killed for the pause
            self._last_sign, self._stopped_since = now, None
        self._last_look = now
        state = process_state(self.pid)
        if state in ("T", "t"):
            self._stopped_since = self._stopped_since or now
        else:
            self._stopped_since = None
        if self._stopped_since is not None and now - self._stopped_since > self.timeout:
            return (f"{describe_state(state)} for {now - self._stopped_since:.0f} s, "
                    f"EDDIS_LIVENESS_TIMEOUT={self.timeout:g}")
        # Before its first beat a process is still starting (or sends none): only the state counts.
        if self._beating and self.beats and now - self._last_sign > self.timeout:
            return (f"no heartbeat for {now - self._last_sign:.0f} s, EDDIS_LIVENESS_TIMEOUT={self.timeout:g}; "
                    f"it is {describe_state(state)}")
        return None


class ParentWatch(_BeatReader):
    """A child's end of its supervisor's beats (see :func:`start_in_child`)."""

    def __init__(self, read_fd, pid, timeout):
        super().__init__(read_fd, pid, timeout)
        os.set_blocking(read_fd, False)
        os.set_inheritable(read_fd, False)  # the user's subprocesses must not hold it open
        self._last_sign = time.monotonic()

    @classmethod
    def from_environment(cls):
        fd = os.environ.pop(PARENT_BEAT_FD_VARIABLE, None)
        pid = os.environ.pop(PARENT_PID_VARIABLE, None)
        timeout = os.environ.pop(PARENT_TIMEOUT_VARIABLE, None)
        if fd is None or pid is None or timeout is None:
            return None
        return cls(int(fd), int(pid), float(timeout))

    @property
    def closed(self):
        """Whether the supervisor closed its end: it has ended the watch (or is gone)."""
        self._drain()
        return not self._beating

    def wait(self, seconds):
        """Sleep ``seconds``, or until a beat or the end of the beats comes."""
        if not self._beating:
            time.sleep(seconds)
            return
        try:
            select.select([self._read_fd], [], [], seconds)
        except (InterruptedError, OSError, ValueError):
            time.sleep(seconds)


class LivenessWatch(_BeatReader):
    """The supervisor's end of one child's heartbeat.

    Use: ``env = watch.child_env()`` and ``pass_fds=watch.pass_fds`` for Popen,
    then ``watch.started(pid)``; ``watch.hung()`` once in a while, ``watch.stack()``
    before killing a hung child, ``watch.close()`` at the end.

    With ``verdict`` (see :func:`.verdict.supervisor_verdict`) or ``watched``, this process beats to
    the child too, from a thread, and the child watches it (:func:`start_in_child`)."""

    def __init__(self, timeout=None, stack_dir=None, verdict=None, watched=False):
        timeout = settings.get("EDDIS_LIVENESS_TIMEOUT") if timeout is None else float(timeout)
        read_fd, self._write_fd = os.pipe()
        super().__init__(read_fd, None, timeout)
        os.set_blocking(self._read_fd, False)
        self._stack = tempfile.TemporaryFile(dir=stack_dir, prefix="eddis-stack-")
        self._verdict = verdict
        # this process's beats to the child: (read end, the child's; write end, our beat thread's)
        self._to_child = os.pipe() if self.enabled and (watched or verdict is not None) else None
        self._beater = None
        self._stop_beating = threading.Event()

    @property
    def pass_fds(self):
        fds = (self._write_fd, self._stack.fileno())
        return fds + ((self._to_child[0],) if self._to_child else ())

    def child_env(self):
        env = {HEARTBEAT_FD_VARIABLE: str(self._write_fd), STACK_FD_VARIABLE: str(self._stack.fileno()),
               BEAT_INTERVAL_VARIABLE: f"{beat_interval(self.timeout or 30.0):g}"}
        if self._to_child:
            env.update({PARENT_BEAT_FD_VARIABLE: str(self._to_child[0]), PARENT_PID_VARIABLE: str(os.getpid()),
                        PARENT_TIMEOUT_VARIABLE: f"{self.timeout:g}"})
            if self._verdict is not None:
                env[VERDICT_VARIABLE] = json.dumps(self._verdict)
        return env

    def started(self, pid):
        self.pid = pid
        self._last_sign = time.monotonic()
        os.close(self._write_fd)  # so that the pipe ends (EOF) when the child and its heirs are gone
        self._write_fd = -1
        if self._to_child:
            os.close(self._to_child[0])
            self._beater = threading.Thread(target=self._beat_to_child, args=(self._to_child[1],),
                                            name="eddis-heartbeat-to-child", daemon=True)
            self._to_child = None
            self._beater.start()

    def _beat_to_child(self, fd):
        """This process's beats to the child; the thread closes its fd itself (no other thread
        may close a descriptor that it could still write to: the number may be reused)."""
        os.set_blocking(fd, False)
        interval = beat_interval(self.timeout)
        try:
            while True:
                try:
                    os.write(fd, b".")
                except BlockingIOError:
                    pass  # the child is behind; a full pipe already says we are alive
                except OSError:
                    return  # the child and its heirs are gone
                if self._stop_beating.wait(interval):
                    return
        finally:
            os.close(fd)

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
        """Ends the watch both ways: the child, if it still runs, reads the end of our beats."""
        self._stop_beating.set()
        if self._beater is not None:
            self._beater.join(timeout=5.0)
        for fd in (self._to_child or ()):
            os.close(fd)
        self._to_child = None
        for fd in (self._read_fd, self._write_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._read_fd = self._write_fd = -1
        self._stack.close()
