"""``eddis-train --smb-server INDEX``: one smb-server, run as the child of a supervisor.

Why not ``exec smb-server``: a server that dies or hangs must be named as the
job's root cause (index, host, signal, its stack), and no one else on its node
can know how it ended: its parent is slurmstepd (or ``eddis-train --local``).
So the job script and ``--local`` run this supervisor, which

- runs ``eddis.smb.server`` in a child process that beats to it (:mod:`.liveness`);
- records the server's start, and its exit under ``<run dir>/launch/smb-servers/``;
- passes the server's stderr on to its own, keeping the first traceback and the last
  lines (a dead thread's ``SMBServerError``, say) for the failure record the report quotes;
- when the server dies (anything but the stop it was asked for) or hangs (stack
  dumped, then killed), records a failure and asks every rank of the run dir to
  stop (``launch/stop``), so the job ends with the server as its root cause;
- ignores SIGINT, and starts the server ignoring it: an interrupt (``scancel
  --signal=INT``, which reaches every process of every step) is for the trainers'
  KeyboardInterrupt handlers, which may still need the servers; the job ends the
  servers after the trainers;
- passes SIGTERM on to the server, and kills it when it does not stop within
  SERVER_STOP_SECONDS (a stopped server would keep the job waiting otherwise);
- but in a job with EDDIS_CHECKPOINT_DIR, where the first SIGTERM is Slurm's notice of a
  preemption and the trainers answer it with a checkpoint that reads the servers' state
  (:mod:`.preemption`), starts the server ignoring SIGTERM and keeps it up until the job
  asks for its stop (after the trainers), a second SIGTERM comes, or
  :func:`.preemption.server_wait_seconds` have passed; it stops the server with SIGUSR2;
- stops the server the same way when the job asks for it in the run dir
  (``launch/smb-servers-stop``, once the trainers have ended), and then exits 0, so
  that its Slurm step ends COMPLETED by itself: a step ended with ``scancel`` makes
  slurmstepd print ``error: *** STEP ... CANCELLED ***`` into every successful job's output.
"""
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time

from .. import identity
from . import mpishm
from .liveness import LivenessWatch
from .output import LinePump, TracebackCatcher
from .preemption import checkpoint_on_sigterm, server_wait_seconds
from .report import describe_failure, request_stop, server_records, servers_stop_requested
from .status import exit_status
from .verdict import supervisor_verdict

SERVER_STOP_SECONDS = 10.0
WATCH_SECONDS = 1.0
TAIL_LINES = 10          # of the server's stderr in its failure record, as of a rank's
PUMP_END_SECONDS = 10.0  # for the last lines of its stderr once it ended (a child of it may hold the pipe)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# the server's stop whether or not it ignores SIGTERM (UCX takes SIGHUP for its debug signal)
SERVER_STOP_SIGNAL = signal.SIGUSR2
PR_SET_PDEATHSIG = 1
_CHILD_CODE = ("import sys; from eddis.launch.liveness import start_in_child; start_in_child(); "
               "from eddis.smb.server import main; sys.exit(main())")


def server_child_command(run_dir, index, memory=None):
    cmd = [sys.executable, "-c", _CHILD_CODE, "--run-dir", str(run_dir), "--index", str(index)]
    if memory:
        cmd += ["--memory", str(memory)]
    return cmd


def supervisor_command(run_dir, index, memory=None):
    """The command line of this supervisor, for a launcher that starts it with this Python."""
    cmd = [sys.executable, "-m", "eddis.launch.train", "--run-dir", str(run_dir), "--smb-server", str(index)]
    if memory:
        cmd += ["--memory", str(memory)]
    return cmd


def _die_with_parent():
    # a server must not outlive a supervisor killed with SIGKILL (srun --kill-on-bad-exit)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _die_with_parent_and_ignore_sigterm():
    _die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # Slurm's reaches every process of the step


class ServerSupervisor:
    def __init__(self, run_dir, index, memory=None):
        self.run_dir = str(run_dir)
        self.index = int(index)
        self.memory = memory
        self.host = identity.node_name()
        self.records = server_records(self.run_dir)
        self.stop_signal = None
        self.child = None
        self.outlive_sigterm = checkpoint_on_sigterm()
        self.term_at = None  # the first SIGTERM, when the server outlives it
        self.err_lock = threading.Lock()   # the server's lines and ours, each whole

    def _on_signal(self, signum, frame):
        first = self.stop_signal is None
        if first and signum == signal.SIGTERM and self.outlive_sigterm and self.term_at is None:
            self.term_at = time.monotonic()
            return
        self.stop_signal = signum
        if first and self.child is not None and self.child.poll() is None:
            self.child.send_signal(SERVER_STOP_SIGNAL)

    def _outlived_sigterm_long_enough(self):
        """Past the wait a SIGTERM that asked for a checkpoint grants; says so."""
        waited = server_wait_seconds()
        if self.term_at is None or time.monotonic() - self.term_at <= waited:
            return False
        self.say(f"the job did not ask for the server's stop within {waited:.0f} s of SIGTERM; stopping it")
        return True

    def _remove_launch_leftovers(self):
        """The job's Open MPI segment folders on this node: its server is the job's last EDDIS
        process here, so what a killed rank's supervisor could not remove goes now."""
        for path in mpishm.remove_job_folders(os.environ, self.host):
            self.say(f"removed {path}, which a launch of this job left")

    def say(self, text):
        with self.err_lock:
            print(f"eddis-train: smb-server {self.index}@{self.host}: {text}", file=sys.stderr, flush=True)

    def run(self):
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # inherited by the server (see above)
        # the server watches this supervisor in turn: hung, it is the root cause, as a hung server is
        verdict = supervisor_verdict(self.records, self.index, {"server": self.index, "host": self.host},
                                     stop_run_dir=self.run_dir, stop_signal=SERVER_STOP_SIGNAL)
        liveness = LivenessWatch(verdict=verdict)
        env = dict(os.environ, **liveness.child_env())
        try:
            self.child = subprocess.Popen(
                server_child_command(self.run_dir, self.index, self.memory), env=env, stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE, pass_fds=liveness.pass_fds,
                preexec_fn=_die_with_parent_and_ignore_sigterm if self.outlive_sigterm else _die_with_parent)
        except OSError as exc:
            liveness.close()
            self.say(f"cannot start the server: {exc}")
            return 127
        # its lines unprefixed, as before: they name the server themselves
        catcher = TracebackCatcher()
        pump = LinePump(self.child.stderr, sys.stderr.buffer, "", self.err_lock, catcher)
        pump.start()
        liveness.started(self.child.pid)
        self.records.start(self.index, {"server": self.index, "host": self.host, "pid": self.child.pid,
                                        "supervisor_pid": os.getpid(), "time": time.time()})
        hung = stack = None
        stop_deadline = None
        try:
            exit_fd = os.pidfd_open(self.child.pid)
        except (AttributeError, OSError):
            exit_fd = None
        while self.child.poll() is None:
            if exit_fd is not None:
                try:
                    select.select([exit_fd], [], [], WATCH_SECONDS)
                except InterruptedError:
                    pass
            else:
                time.sleep(0.25)
            if self.child.poll() is not None:
                break
            if self.stop_signal is None and (servers_stop_requested(self.run_dir)
                                             or self._outlived_sigterm_long_enough()):
                self.stop_signal = signal.SIGTERM   # as if signalled: the same bounded stop
                self.child.send_signal(SERVER_STOP_SIGNAL)
            if self.stop_signal is not None:
                stop_deadline = stop_deadline or time.monotonic() + SERVER_STOP_SECONDS
                if time.monotonic() > stop_deadline:
                    self.say(f"did not stop within {SERVER_STOP_SECONDS:.0f} s of "
                             f"{signal.Signals(self.stop_signal).name}; killing it")
                    self.child.kill()
                    self.child.wait(timeout=30)
                    break
                continue  # stopping as asked: its hang is not the job's failure any more
            hung = liveness.hung()
            if hung is not None:
                self.say(f"(pid {self.child.pid}) stopped making progress: {hung}; dumping its stack and killing it")
                stack = liveness.stack()
                if stack:
                    self.say("its Python stack:\n" + stack)
                self.child.kill()
                try:
                    self.child.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.say(f"the server (pid {self.child.pid}) did not die of SIGKILL within 30 s")
                break
        ended = time.time()
        pump.join(timeout=PUMP_END_SECONDS)
        if exit_fd is not None:
            os.close(exit_fd)
        liveness.close()
        self._remove_launch_leftovers()
        rc = self.child.returncode if self.child.returncode is not None else -signal.SIGKILL
        code, sig = (rc, None) if rc >= 0 else (None, -rc)
        if hung is None and self.stop_signal is None and (rc == 0 or sig in STOP_SIGNALS):
            # scancel signals every process of the step at once: the server may be gone
            # before our own handler has run. Not a failure then.
            deadline = time.monotonic() + 1.0
            while self.stop_signal is None and time.monotonic() < deadline:
                time.sleep(0.05)
        record = {"server": self.index, "host": self.host, "pid": self.child.pid, "code": code, "signal": sig,
                  "time": ended, "why": "exited"}
        asked_to_stop = self.stop_signal is not None and hung is None
        if hung is not None:
            record.update(why="hung", hung=hung, stack=stack)
        elif not asked_to_stop and rc != 0:
            record["why"] = "failed"
        elif asked_to_stop:
            record["why"] = "stopped"
        if record["why"] in ("hung", "failed"):
            record.update(traceback=catcher.result(), tail=list(catcher.tail)[-TAIL_LINES:])
            self.records.fail(self.index, record)
            self.say(f"{describe_failure(record)}; stopping every rank")
            request_stop(self.run_dir, describe_failure(record))
        self.records.finish(self.index, record)
        if asked_to_stop:
            return 0 if rc == 0 else exit_status(None, self.stop_signal)
        return exit_status(code, sig)


def serve(run_dir, index, memory=None):
    return ServerSupervisor(run_dir, index, memory).run()

