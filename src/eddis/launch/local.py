"""``eddis-train --local -n N train.py``: the whole job on one machine, no Slurm.

Creates a run directory with its token, starts one ``smb-server`` and waits until
it has published, runs N ranks with Open MPI's ``mpirun`` (each rank is an
``eddis-train`` supervisor, as under srun); then ends the attempt as a Slurm job does
(:mod:`.attempt`): the server asked to stop, the verdicts, the root-cause report when a
rank failed; another attempt after a crash in the start-up (EDDIS_START_RETRIES) or a
failure (EDDIS_MAX_RESTARTS), :mod:`.restarts`; the run's status (:mod:`.runend`: 75 after
a checkpoint the ranks were asked for, to run the same command again). SIGTERM stops
everything. Ctrl-C (SIGINT) interrupts: every trainer gets SIGINT, so that the script's
``except KeyboardInterrupt`` runs, then SIGTERM after ``EDDIS_INTERRUPT_GRACE`` s and
SIGKILL after ``EDDIS_STOP_GRACE`` s more (a second Ctrl-C cuts that short); the run
exits 130. Slurm's variables are removed from the ranks' environment, so this also works
inside an allocation without joining it.
"""
import os
import shutil
import signal
import subprocess
import sys
import time

from .. import settings
from ..errors import ConfigError
from . import jobsteps
from .attempt import Launcher, end_attempt
from .elastic import MPIRUN_OPTIONS, elastic_run
from .report import request_servers_stop, request_stop
from .restarts import run_attempts
from .runend import conclude
from .status import exit_status
from .stepcontrol import STOP_SECONDS, wait_ended
from .topwatch import TopWatch

SERVER_STOP_SECONDS = 10.0
POLL_SECONDS = 0.25
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_STRIPPED_PREFIXES = ("SLURM_", "SLURMD_", "PMIX_", "PMI_", "OMPI_COMM_WORLD_")


def _clean_environment():
    return {k: v for k, v in os.environ.items() if not k.startswith(_STRIPPED_PREFIXES)}


def server_command(run_dir, memory):
    """The smb-server under its supervisor, which names it when it dies or hangs."""
    from .serverstep import supervisor_command

    return supervisor_command(run_dir, 0, memory)


def mpirun_command(ranks, argv, elastic=False):
    if shutil.which("mpirun") is None:
        raise ConfigError("mpirun is not on PATH: install Open MPI (apt-get install openmpi-bin) "
                          "or load its module, then retry eddis-train --local")
    cmd = ["mpirun", "-n", str(ranks), "--oversubscribe", "--bind-to", "none"]
    if elastic:
        cmd.extend(MPIRUN_OPTIONS)
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + [sys.executable, "-m", "eddis.launch.train", *argv]


def _stop(proc, sig=signal.SIGTERM, timeout=SERVER_STOP_SECONDS):
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(sig)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def run_local(argv, ranks=1, memory=None):
    if ranks < 1:
        raise ConfigError(f"-n {ranks}: give at least one rank")
    return LocalRun(argv, ranks, memory).run()


class LocalRun(Launcher):
    """One ``--local`` run: its attempts, each an smb-server and ``mpirun`` of the ranks."""

    def __init__(self, argv, ranks, memory):
        self.argv = list(argv)
        self.ranks = ranks
        self.memory = memory
        self.elastic = elastic_run()   # refused (ConfigError) before anything starts
        self.signals = []   # the stop signals this run received, filled by its handler
        self.server = self.mpirun = None

    @property
    def stopping(self):
        return self.signals[0] if self.signals else None

    def _on_signal(self, signum, frame):
        self.signals.append(signum)

    def run(self):
        from ..smb.rundir import retire_run_dir

        path = jobsteps.run_dir()
        try:
            self.run_dir = jobsteps.create_run_dir(path)
        except OSError as exc:
            self.say(f"error: cannot create the run directory {path}: {exc}", err=True)
            return 1
        previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        try:
            # stopped or wedged, this process would keep the server for ever: its sentinel ends the run then
            with TopWatch("eddis-train --local", self.run_dir):
                try:
                    status, answer = run_attempts(self)
                finally:
                    retire_run_dir(self.run_dir)   # the token must not outlive the job
                return conclude(self, status, answer)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _environment(self):
        env = _clean_environment()
        env["EDDIS_RUN_DIR"] = str(self.run_dir)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.ranks)))
        if os.geteuid() == 0:
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        return env

    def attempt(self):
        """One run of the server and the ranks, then the shared end."""
        self.server = self.mpirun = None
        try:
            return self._attempt()
        finally:   # what an error left running
            _stop(self.mpirun, signal.SIGTERM, timeout=settings.get("EDDIS_STOP_GRACE") + 10)
            _stop(self.server)

    def _attempt(self):
        env = self._environment()
        self.say(f"run dir {self.run_dir}; starting smb-server", err=True)
        # Own sessions: a Ctrl-C reaches only us; we stop the ranks and then the server in order.
        self.server = subprocess.Popen(server_command(self.run_dir, self.memory), env=env,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        if jobsteps.wait_servers(self.run_dir, 1, watch_pids=[self.server.pid]) != 0:
            self.end_servers()
            return 1, None
        status = self._run_ranks(env)
        if self.stopping is not None:
            self.end_servers()
            return exit_status(None, self.stopping), None
        return end_attempt(self, status)

    def _run_ranks(self, env):
        """mpirun's status once the ranks have ended, bounded by a stop signal and the server's
        end; None when a stop signal came before they started."""
        if self.stopping is not None:
            return None
        self.mpirun = subprocess.Popen(mpirun_command(self.ranks, self.argv, self.elastic), env=env,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        stop_deadline = None
        while True:
            try:
                return exit_status(self.mpirun.wait(timeout=POLL_SECONDS))
            except subprocess.TimeoutExpired:
                pass
            if self.signals and stop_deadline is None:
                # The supervisors watch this file and stop their trainers gracefully; mpirun
                # then ends by itself. SIGTERM to mpirun only if that takes too long.
                interrupted = self.signals[0] == signal.SIGINT
                request_stop(self.run_dir, f"eddis-train --local received {signal.Signals(self.signals[0]).name}",
                             signal.SIGINT if interrupted else signal.SIGTERM)
                if interrupted:
                    self.say("interrupted (SIGINT): every trainer gets SIGINT (KeyboardInterrupt), SIGTERM after "
                             f"{settings.get('EDDIS_INTERRUPT_GRACE'):g} s (EDDIS_INTERRUPT_GRACE); Ctrl-C again to "
                             "stop them now", err=True)
                stop_deadline = (time.monotonic() + settings.get("EDDIS_STOP_GRACE") + 10
                                 + (settings.get("EDDIS_INTERRUPT_GRACE") if interrupted else 0))
            elif len(self.signals) > 1 and stop_deadline != float("inf"):
                self.mpirun.send_signal(signal.SIGTERM)   # a second signal: stop now
                stop_deadline = float("inf")
            elif stop_deadline is not None and time.monotonic() > stop_deadline:
                self.mpirun.send_signal(signal.SIGTERM)
                stop_deadline = float("inf")
            if stop_deadline is None and self.server.poll() is not None:
                self.say(f"error: the smb-server ended (status {self.server.returncode}) while training; stopping "
                         "the ranks", err=True)
                request_stop(self.run_dir, f"the smb-server ended (status {self.server.returncode})")
                return exit_status(_wait_or_kill(self.mpirun, settings.get("EDDIS_STOP_GRACE") + 10)) or 1

    def end_servers(self):
        """Ask the server in the run dir to stop; SIGTERM (then SIGKILL) when it does not within STOP_SECONDS."""
        if self.server is None or self.server.poll() is not None:
            return
        request_servers_stop(self.run_dir, "the ranks have ended")
        if wait_ended([self.server], STOP_SECONDS):
            self.say(f"the smb-server did not end within {STOP_SECONDS:.0f} s of the request to stop; stopping it",
                     err=True)
            _stop(self.server)


def _wait_or_kill(proc, timeout=30.0):
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=timeout)
