"""The per-rank supervisor: ``eddis-train`` runs the trainer as its child.

Why a child and not ``exec``: the supervisor must outlive the trainer to say why
it died. It prefixes the trainer's output with ``[rank@host]``, records the exit
(code, signal, first traceback) in the run directory, and watches the records of
the other ranks of the same launch: when a peer's trainer fails, it stops its own
trainer (SIGTERM, then SIGKILL after ``EDDIS_STOP_GRACE`` seconds) instead of
letting it wait forever in a collective. An interrupt (SIGINT to the supervisor, or a
stop request that names SIGINT: Ctrl-C on ``eddis-train --local`` or ``--job``) reaches
the trainer as SIGINT first, so that the script's own ``except KeyboardInterrupt``
runs; SIGTERM follows after ``EDDIS_INTERRUPT_GRACE`` seconds, SIGKILL after
``EDDIS_STOP_GRACE`` more, as torchrun does. An interrupted supervisor waits (bounded)
for its peers' trainers before it exits with 130 (0 when the launcher asked through
the run dir, and reports the interrupt itself), so that the launcher, which kills the
rest once one rank exits non-zero, cuts no peer's handler short. The failed rank's supervisor waits
(bounded) until its peers have stopped before it exits, so that the launcher
(``srun --kill-on-bad-exit``, or ``mpirun``), which kills hard, only meets
stragglers: a rank stopped because of a peer exits 0 for the same reason, and the
step's status is the failed rank's. The trainer gets ``PR_SET_PDEATHSIG``, so it cannot outlive a
supervisor killed with SIGKILL.

A trainer that stops making progress (stopped, deadlocked: no heartbeat for
``EDDIS_LIVENESS_TIMEOUT`` s, see :mod:`.liveness`) is a failure of its own: the
supervisor dumps its Python stack, kills it and records it as hung, so that the
rank that hangs is the one named, not a peer whose wait ran out later. The supervisor
beats to the trainer in turn, and the trainer, finding it stopped or wedged as long,
records this rank as failed by its hung supervisor and kills the supervisor (and so
itself): a stopped supervisor would hold its trainer's output, and the step, for ever.

In an elastic easgd/hybrid run (EDDIS_ELASTIC, :mod:`.elastic`) a failed rank is a lost
one: it is recorded the same way, its peers are not stopped, and its supervisor exits 0.

In a Slurm job step with EDDIS_CHECKPOINT_DIR the first SIGTERM is Slurm's notice of a
preemption (:mod:`.preemption`): Slurm delivers it to the trainer too, which writes a
checkpoint at its next step boundary and exits 75; the supervisor only waits, at most
EDDIS_CHECKPOINT_GRACE s, and stops it on a second SIGTERM or a stop request in the run dir.
"""
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time

from .. import settings
from ..errors import REQUEUE_EXIT_STATUS
from .elastic import elastic_run
from .liveness import LivenessWatch
from .mpishm import MpiShm
from .output import LinePump, TracebackCatcher
from .preemption import checkpoint_on_sigterm
from .report import LaunchRecords, describe_exit, describe_failure, launch_key, stop_request
from .startbeats import StartBeat
from .status import INTERRUPTED_STATUS, SIGNALLED_STATUS, exit_status
from .verdict import supervisor_verdict

PR_SET_PDEATHSIG = 1
POLL_SECONDS = 0.25
# How often a supervisor looks at the run dir for a peer's failure or a stop request. The run
# dir is on a shared file system: with thousands of ranks, a faster scan would load its
# metadata server; 1 s keeps the fail-fast bound far below 30 s. A trainer's own exit is seen
# at once (pidfd).
WATCH_SECONDS = 1.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def _die_with_parent():
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    os.setsid()  # own process group: stop the trainer and its workers together
    # A checkpoint request (Slurm's SIGUSR1) that comes before the trainer has installed
    # its handler must not kill it, which is what SIGUSR1 does by default; the request
    # also waits in the run dir, where eddis.init() finds it.
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _exit_notifier(pid):
    """A pidfd that becomes readable when ``pid`` exits (Linux >= 5.3), else None (we poll)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def trainer_command(argv):
    """``train.py args`` and ``-m pkg args`` run with this Python under :mod:`.child`; else as given."""
    if not argv:
        return []
    if argv[0] == "-m" or argv[0].endswith(".py"):
        return [sys.executable, "-m", "eddis.launch.child", *argv]
    return list(argv)


def default_threads(env, local_size):
    cpus = env.get("SLURM_CPUS_ON_NODE")
    total = int(cpus) if cpus and cpus.isdigit() else (os.cpu_count() or 1)
    return str(max(1, total // max(1, local_size)))


class Supervisor:
    def __init__(self, argv, info, run_dir, env=None, stop_grace=None, out=None, err=None):
        self.argv = list(argv)
        self.command = trainer_command(argv)
        self.info = info
        self.run_dir = str(run_dir)
        self.env = dict(os.environ if env is None else env)
        self.key = launch_key(self.env)
        self.records = LaunchRecords(self.run_dir, self.key)
        self.stop_grace = settings.get("EDDIS_STOP_GRACE") if stop_grace is None else stop_grace
        self.prefix = f"[{info.rank}@{info.hostname}] "
        self.out = out if out is not None else sys.stdout.buffer
        self.err = err if err is not None else sys.stderr.buffer
        self.out_lock = threading.Lock()
        self.err_lock = threading.Lock()
        self.interrupt_grace = settings.get("EDDIS_INTERRUPT_GRACE")
        # elastic (easgd/hybrid): a lost rank is recorded, but does not stop its peers
        self.elastic = elastic_run(self.env)
        self.stop_signal = None
        # SIGTERM is a checkpoint request first (see the module docstring); when it came
        self.checkpoint_on_term = checkpoint_on_sigterm(self.env)
        self.checkpoint_grace = settings.get("EDDIS_CHECKPOINT_GRACE")
        self.term_at = None
        self.term_announced = False
        self.child = None
        self.liveness = None
        self._sent = set()  # signals the trainer got: a second SIGINT would break into its handler
        self._lost_peers = set()  # failure records (names) of elastic peers lost after they started

    # ------------------------------------------------------------------ output
    def say(self, text, stream="err"):
        sink, lock = (self.err, self.err_lock) if stream == "err" else (self.out, self.out_lock)
        data = "".join(f"{self.prefix}{line}\n" for line in text.splitlines()).encode()
        with lock:
            try:
                sink.write(data)
                sink.flush()
            except (OSError, ValueError):
                pass

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum, frame):
        # Pass it on at once: on scancel srun follows with SIGKILL within moments, and the
        # trainer's exit must be seen and cleaned up before that. SIGINT stays SIGINT (the
        # script may catch KeyboardInterrupt); a SIGTERM after it ends the grace at once.
        first = self.stop_signal is None
        if first and signum == signal.SIGTERM and self.checkpoint_on_term and self.term_at is None:
            self.term_at = time.monotonic()  # the trainer got it too; a second SIGTERM stops it
            return
        if first:
            self.stop_signal = signum
        elif signum == signal.SIGINT:
            return
        if self.child is not None and self.child.returncode is None:
            self._signal_child_once(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    def _forward_signal(self, signum, frame):
        # e.g. sbatch --signal=USR1@120: the trainer's cue to checkpoint, not to stop
        if self.child is not None and self.child.returncode is None:
            self._signal_child(signum)

    def _install_signal_handlers(self):
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, self._forward_signal)

    def _signal_child(self, sig):
        try:
            os.killpg(self.child.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            self.child.send_signal(sig)

    def _signal_child_once(self, sig):
        if sig not in self._sent:
            self._sent.add(sig)
            self._signal_child(sig)

    def _child_ended_within(self, seconds):
        try:
            self.child.wait(timeout=seconds)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop_child(self, first=signal.SIGTERM):
        """Stop the trainer's process group: ``first`` (SIGINT: SIGTERM after the interrupt
        grace), then SIGKILL after the stop grace."""
        if self.child.poll() is not None:
            return
        if first == signal.SIGINT and signal.SIGTERM not in self._sent:
            self._signal_child_once(signal.SIGINT)
            if not self._child_ended_within(self.interrupt_grace):
                self.say(f"eddis-train: the trainer did not end within {self.interrupt_grace:g} s of "
                         "SIGINT (EDDIS_INTERRUPT_GRACE); sending SIGTERM")
        if self.child.poll() is None:
            self._signal_child_once(signal.SIGTERM)
            if not self._child_ended_within(self.stop_grace):
                self._signal_child(signal.SIGKILL)
                self.child.wait(timeout=30)
        # workers the trainer left in its group
        self._signal_child(signal.SIGKILL)

    # ------------------------------------------------------------------ main
    def _child_env(self, shm):
        env = dict(self.env)
        env.update(self.info.environ(self.run_dir))
        env["PYTHONUNBUFFERED"] = "1"
        # a Python trainer that dies of SIGSEGV/SIGABRT prints its stacks, which the report quotes
        env.setdefault("PYTHONFAULTHANDLER", "1")
        if self.checkpoint_on_term:
            env["EDDIS_CHECKPOINT_ON_SIGTERM"] = "1"
        env.setdefault("OMP_NUM_THREADS", default_threads(self.env, self.info.local_size))
        if self.elastic:
            env["EDDIS_STARTED_FILE"] = str(self.records.started_file(self.info.rank))
        env["EDDIS_INIT_FILE"] = str(self.records.init_file(self.info.rank))
        shm.prepare(env)
        return env

    def _peer_failure(self):
        """The first failure of another rank that stops this one: any, unless the run is elastic;
        then only that of a rank lost before its training started (the others may wait for it
        in a start-up collective that has no timeout, e.g. MPI_Init's)."""
        # records of ranks already read as lost are not read again at every look
        names = set(self.records.failure_names()) - {f"{self.info.rank}.json"} - self._lost_peers
        if not names:
            return None
        if not self.elastic:
            return self.records.first_failure(exclude_rank=self.info.rank)
        failure = self.records.first_failure(exclude_rank=self.info.rank, lost=False)
        if failure is None:
            self._lost_peers |= names
        return failure

    def _wait_for_peers(self, timeout, signalled=False):
        """After a failure (or an interrupt: ``signalled``): give the other ranks time to stop
        gracefully (bounded).

        Our own exit record is written already: when every rank fails at once, each one
        sees the others' and none waits for the others' wait."""
        others = set(range(self.info.size)) - {self.info.rank}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (signalled or self.stop_signal is None):
            if others <= self.records.exited_ranks():
                return True
            time.sleep(POLL_SECONDS)
        return False

    def run(self):
        if not self.command:
            self.say("eddis-train: no training script given (usage: eddis-train train.py [args])")
            return 2
        self._install_signal_handlers()
        shm = MpiShm(self.env, self.key, self.info.hostname)
        child_env = self._child_env(shm)
        self.say("eddis-train: " + self.info.describe()
                 + (f" CUDA_VISIBLE_DEVICES={self.info.gpu}" if self.info.gpu is not None else ""), "out")
        catcher = TracebackCatcher()
        # only the Python runner (.child) beats; other programs are watched by their state alone
        beats = self.command[1:3] == ["-m", "eddis.launch.child"]
        # and only it watches this supervisor in turn, which it names and kills when it hangs
        self.liveness = LivenessWatch(verdict=self._verdict() if beats else None)
        if beats:
            child_env.update(self.liveness.child_env())
        try:
            self.child = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, env=child_env, preexec_fn=_die_with_parent,
                                          pass_fds=self.liveness.pass_fds if beats else ())
        except OSError as exc:
            self.liveness.close()
            self.say(f"eddis-train: cannot start {self.command[0]}: {exc}")
            code, sig, ended = 127, None, time.time()
            self.records.fail(self.info.rank, self._record(code, sig, ended, "failed", None, [str(exc)]))
            self.records.finish(self.info.rank, self._record(code, sig, ended, "failed", None, []))
            return code
        pumps = [LinePump(self.child.stdout, self.out, self.prefix, self.out_lock),
                 LinePump(self.child.stderr, self.err, self.prefix, self.err_lock, catcher)]
        for pump in pumps:
            pump.start()
        self.records.start(self.info.rank, {
            "rank": self.info.rank, "host": self.info.hostname, "supervisor_pid": os.getpid(),
            "trainer_pid": self.child.pid, "command": self.argv, "time": time.time(),
            "local_rank": self.info.local_rank, "group": self.info.group, "gpu_type": self.info.gpu_type,
            "gpu": self.info.gpu, "size": self.info.size})

        why = "exited"
        requested = False  # stopped through the run dir by the launcher, not by a signal of ours
        hung = stack = None
        self.liveness.started(self.child.pid)
        # elastic: a node lost before the training started must fail the start, not hang it
        start_beat = StartBeat(self.records, self.info.rank, self.elastic)
        exit_fd = _exit_notifier(self.child.pid)
        while True:
            start_beat.beat()
            if exit_fd is not None:
                try:  # wakes the moment the trainer exits
                    select.select([exit_fd], [], [], WATCH_SECONDS)
                except InterruptedError:
                    pass
            try:
                self.child.wait(timeout=0 if exit_fd is not None else POLL_SECONDS)
                break
            except subprocess.TimeoutExpired:
                pass
            if self.term_at is not None and self.stop_signal is None:
                self._wait_for_checkpoint()
            if self.stop_signal is not None:
                why = "stopped"
                self.say(f"eddis-train: received {signal.Signals(self.stop_signal).name}, stopping the trainer")
                self.stop_child(self.stop_signal)
                break
            request = stop_request(self.run_dir)
            if request is not None:
                reason, first = request
                why, self.stop_signal, requested = "stopped", first, True
                self.say(f"eddis-train: stopping the trainer ({signal.Signals(first).name} first): {reason}")
                self.stop_child(first)
                break
            peer = self._peer_failure()
            if peer is not None:
                why = "stopped"
                self.say(f"eddis-train: stopping: {describe_failure(peer)}")
                self.stop_child()
                break
            hung = self.liveness.hung()
            if hung is not None:
                why, stack = "hung", self._end_hung_child(hung)
                break
        ended = time.time()
        self.liveness.close()
        if exit_fd is not None:
            os.close(exit_fd)
        # first the shared memory: on scancel a SIGKILL may follow soon
        shm.cleanup(self.info.local_rank)
        for pump in pumps:  # drain what the trainer wrote before it ended
            pump.join(timeout=10)

        rc = self.child.returncode if self.child.returncode is not None else -signal.SIGKILL
        code, sig = (rc, None) if rc >= 0 else (None, -rc)
        if why == "exited" and self._sent:
            why = "stopped"  # it ended after we asked it to, in whatever way it chose
        if why == "exited" and sig in STOP_SIGNALS and self.term_at is not None:
            why, self.stop_signal = "stopped", self.stop_signal or signal.SIGTERM  # before it could checkpoint
        if why == "exited" and sig in STOP_SIGNALS:
            # scancel and srun signal every process of the step at once: the trainer may
            # die of that signal before our own handler has run. Not a failure then.
            deadline = time.monotonic() + 1.0
            while self.stop_signal is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.stop_signal is not None:
                why = "stopped"
        if why == "exited" and code == REQUEUE_EXIT_STATUS:
            why = "checkpointed"  # it wrote the checkpoint the job asked for and stopped: no failure
        if why == "hung" or (why == "exited" and rc != 0):
            why = "hung" if why == "hung" else "failed"
            record = self._record(code, sig, ended, why, catcher.result(), list(catcher.tail))
            if why == "hung":
                record.update(hung=hung, stack=stack)
            # elastic: lost, and the others train on, once its training started; before, the start failed
            record["lost"] = lost = self.elastic and self.records.has_started(self.info.rank)
            self.records.fail(self.info.rank, record)
            self.records.finish(self.info.rank, self._record(code, sig, ended, why, None, []))
            if lost:
                # recorded; exit 0, so that neither srun nor mpirun ends the survivors' step
                self.say(f"eddis-train: rank {self.info.rank} on {self.info.hostname} is lost "
                         f"({'hung' if why == 'hung' else describe_exit(code, sig)}); elastic run: "
                         "the other ranks train on")
                return 0
            early = (" before its training started (an elastic run goes on without a lost rank only "
                     "after that)") if self.elastic else ""
            self.say(f"eddis-train: rank {self.info.rank} on {self.info.hostname} "
                     f"{'hung and was killed' if why == 'hung' else describe_exit(code, sig)}{early}; "
                     "stopping the other ranks")
            self._wait_for_peers(self.stop_grace + 10)
        else:
            self.records.finish(self.info.rank, self._record(code, sig, ended, why, None, []))
        if why == "stopped" and self.stop_signal == signal.SIGINT:
            self._wait_for_peers(self.interrupt_grace + self.stop_grace + 10, signalled=True)
            # Asked through the run dir (eddis-train --local): that launcher says it was
            # interrupted and exits 130 itself; a non-zero status here would only make mpirun
            # report that it aborted the job.
            return 0 if requested else INTERRUPTED_STATUS
        if why == "checkpointed":
            # 0, not 75: srun --kill-on-bad-exit would kill the peers still closing down after
            # the same checkpoint; the answer rank 0 left in the run dir tells the job why
            return 0
        if why == "stopped":
            # Stopped because a peer failed: exit 0, so that srun --kill-on-bad-exit does not
            # SIGKILL the ranks still cleaning up; the failed rank exits last, with its own
            # status, which becomes the step's. Stopped by a signal (scancel): 143.
            return SIGNALLED_STATUS if self.stop_signal is not None else 0
        return exit_status(code, sig)

    def _wait_for_checkpoint(self):
        """After the first SIGTERM (a checkpoint request): say so once; past the grace, stop."""
        if not self.term_announced:
            self.term_announced = True
            self.say("eddis-train: received SIGTERM: the trainer writes a checkpoint at its next step "
                     f"boundary and stops (at most EDDIS_CHECKPOINT_GRACE={self.checkpoint_grace:g} s)")
        if time.monotonic() - self.term_at > self.checkpoint_grace:
            self.say(f"eddis-train: the trainer wrote no checkpoint within {self.checkpoint_grace:g} s of "
                     "SIGTERM (EDDIS_CHECKPOINT_GRACE)")
            self.stop_signal = signal.SIGTERM

    def _verdict(self):
        """What the trainer records and does when it finds this supervisor hung (.liveness):
        the rank fails, as when its trainer hangs; in an elastic run it is lost once its
        training started."""
        started = self.records.started_file(self.info.rank) if self.elastic else None
        return supervisor_verdict(self.records, self.info.rank, self._record(None, None, 0, "hung", None, []),
                                  lost_if_exists=started)

    def _end_hung_child(self, hung):
        """Name the hung trainer, dump its stack, kill it; returns the stack (or None)."""
        self.say(f"eddis-train: rank {self.info.rank} on {self.info.hostname} (trainer pid {self.child.pid}) "
                 f"stopped making progress: {hung}; dumping its stack and killing it")
        stack = self.liveness.stack()
        if stack:
            self.say("eddis-train: its Python stack:\n" + stack)
        self._signal_child(signal.SIGKILL)
        try:
            self.child.wait(timeout=30)
        except subprocess.TimeoutExpired:  # in the kernel for good (D state): report it anyway
            self.say(f"eddis-train: the trainer (pid {self.child.pid}) did not die of SIGKILL within 30 s")
        return stack

    def _record(self, code, sig, ended, why, traceback, tail):
        # stop_signal: the signal that stopped it, so the job can tell an interrupt from srun's
        # --kill-on-bad-exit ending the last ranks after they recorded their exit
        return {"rank": self.info.rank, "host": self.info.hostname, "code": code, "signal": sig,
                "stop_signal": self.stop_signal, "time": ended, "why": why, "command": self.argv,
                "traceback": traceback,
                "tail": tail[-10:], "local_rank": self.info.local_rank, "group": self.info.group}
