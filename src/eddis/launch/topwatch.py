"""The watch of the top ``eddis-train`` (``--local``, ``--job``): a sentinel process beside it.

The top process runs the whole job: it stops the smb-servers once the ranks have ended,
prints the report and, as a Slurm job's batch step, frees the allocation when it exits.
Stopped (SIGSTOP) or wedged, it does none of that: the servers and the allocation stay
until the time limit. Nothing above it notices (the user's shell, slurmstepd), and the
ranks and servers, which may be on other nodes, cannot kill it. So it starts a sentinel,
a small child process on its node, and the two watch each other as a supervisor and its
child do (:mod:`.liveness`, both ways, ``EDDIS_LIVENESS_TIMEOUT``).

When the top counts as hung, the sentinel ends the job in its place (:func:`end_job`):

1. records the top as the failure (``launch/supervisors/failures/``), so that the report
   names it;
2. asks every rank to stop (``launch/stop``) and waits, at most EDDIS_STOP_GRACE + 5 s,
   for their exit records;
3. asks the smb-servers to stop (``launch/smb-servers-stop``) and waits, at most
   SERVERS_SECONDS, for the top's other children (srun, mpirun, the servers' supervisors)
   to end;
4. prints the root-cause report and retires the run directory;
5. kills what is left below the top, then the top: a Slurm job's batch step ends with it
   (FAILED), and Slurm ends whatever step is left and frees the allocation; ``--local``
   exits 137 (-9).

When the sentinel counts as hung, or ends, the top kills it and starts another one (at most
MAX_RESTARTS times): a watcher that hangs is no fault of the job.

The sentinel ignores the signals meant for the job (SIGINT, SIGTERM, SIGHUP, SIGUSR1,
SIGUSR2): it ends with the top (PR_SET_PDEATHSIG), or when the top closes its end of the
beats. It stays in the top's process group: a Ctrl-Z on ``eddis-train --local`` stops
both, which is a pause, not a fault.
"""
import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

from .. import identity, settings
from .liveness import LivenessWatch, beat_interval, start_in_child
from .status import exit_status
from .verdict import HUNG_SIGNAL

IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
MAX_RESTARTS = 3
SERVERS_SECONDS = 12.0   # the servers' supervisors stop theirs within 10 s (serverstep.SERVER_STOP_SECONDS)
CLOSE_SECONDS = 5.0
PR_SET_PDEATHSIG = 1
TOP_NAME = "top"   # launch/supervisors/failures/top.json


def say(text):
    print(f"eddis-train: {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- in the top
class TopWatch:
    """The top's side: starts the sentinel, beats to it, watches it; a context manager.

    ``kind``: how the report names the top (``eddis-train --local``, ``eddis-train --job``)."""

    def __init__(self, kind, run_dir):
        self.kind = kind
        self.run_dir = str(run_dir)
        self.timeout = settings.get("EDDIS_LIVENESS_TIMEOUT")
        self.proc = self.watch = None
        self.restarts = 0
        self._closing = threading.Event()
        self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def start(self):
        if self.timeout <= 0:
            return self   # EDDIS_LIVENESS_TIMEOUT=0: no liveness watch anywhere
        self._spawn()
        if self.proc is not None:
            self._thread = threading.Thread(target=self._watch, name="eddis-sentinel-watch", daemon=True)
            self._thread.start()
        return self

    def _spawn(self):
        self.watch = LivenessWatch(watched=True)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "eddis.launch.topwatch", "--kind", self.kind, "--run-dir", self.run_dir],
                env=dict(os.environ, **self.watch.child_env()), stdin=subprocess.DEVNULL,
                pass_fds=self.watch.pass_fds, preexec_fn=_die_with_parent)
        except OSError as exc:
            self.watch.close()
            self.proc = self.watch = None
            say(f"cannot start the sentinel that watches {self.kind}: {exc}; it goes unwatched")
            return
        self.watch.started(self.proc.pid)

    def _watch(self):
        """Restart a sentinel that hangs or ends; at close(), end it. This thread ends it, as
        the parent of the sentinels it started for PR_SET_PDEATHSIG, which would kill them at
        its exit."""
        try:
            while not self._closing.wait(beat_interval(self.timeout)):
                hung = self.watch.hung()
                if hung is None and self.proc.poll() is None:
                    continue
                what = f"hung ({hung})" if hung is not None else f"ended (status {self.proc.returncode})"
                self._end_sentinel(wait=hung is None)
                if self.restarts >= MAX_RESTARTS:
                    say(f"the sentinel that watches {self.kind} {what}, after {self.restarts} restart(s); "
                        "it goes unwatched from here")
                    return
                self.restarts += 1
                say(f"the sentinel that watches {self.kind} {what}; starting another")
                self._spawn()
                if self.proc is None:
                    return
        finally:
            if self.proc is not None and self.proc.returncode is None:
                self._end_sentinel()

    def _end_sentinel(self, wait=True):
        """The end of our beats, which a running sentinel answers by exiting; killed if it does not."""
        self.watch.close()
        try:
            self.proc.wait(timeout=CLOSE_SECONDS if wait else 0)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self):
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=CLOSE_SECONDS + 2 * beat_interval(self.timeout) + 1)


def _die_with_parent():
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------- the sentinel
def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m eddis.launch.topwatch",
                                description="the sentinel of a top eddis-train; it starts it")
    p.add_argument("--kind", required=True)
    p.add_argument("--run-dir", required=True)
    args = p.parse_args(argv)
    for sig in IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    top = start_in_child()   # beats to the top, which watches us; its beats come back
    if top is None:
        say("the sentinel runs only under eddis-train --local or --job, which start it")
        return 2
    while True:
        top.wait(beat_interval(top.timeout))   # woken at once when the top ends the watch
        why = top.hung()
        if why is not None:
            return end_job(args.kind, top.pid, args.run_dir, why)
        if top.closed:
            return 0   # the top ended the watch: it is ending well


def end_job(kind, top_pid, run_dir, why):
    """End the job of the hung top process ``top_pid`` in its place (see the module's docstring)."""
    from ..smb.rundir import retire_run_dir
    from .jobsteps import descendants, process_alive
    from .report import (describe_failure, format_report, launches, read_records, request_servers_stop,
                         request_stop, root_cause, supervisor_records, who)

    record = {"supervisor": kind, "host": identity.node_name(), "pid": top_pid, "code": None,
              "signal": int(HUNG_SIGNAL), "time": time.time(), "why": "hung", "hung": why}
    say(f"{who(record)} stopped making progress: {why}; ending its job in its place: its ranks and "
        "smb-servers stop, then it is killed")
    try:
        supervisor_records(run_dir).fail(TOP_NAME, record)
        request_stop(run_dir, describe_failure(record))
    except OSError as exc:
        say(f"cannot record it in {run_dir}: {exc}")

    def ranks_ended():
        newest = launches(run_dir)[-1:]
        if not newest:
            return True
        size = max((r.get("size") or 0 for r in read_records(newest[0].ranks)), default=0)
        return len(newest[0].exited_ranks()) >= size

    def below_top():
        return [p for p in descendants(top_pid) if p not in (top_pid, os.getpid()) and process_alive(p)]

    _wait(lambda: ranks_ended() or not below_top(), settings.get("EDDIS_STOP_GRACE") + 5)
    try:
        request_servers_stop(run_dir, describe_failure(record))
    except OSError:
        pass
    _wait(lambda: not below_top(), SERVERS_SECONDS)
    first, failures, exits = root_cause(run_dir)
    print(format_report(first, failures, exits, run_dir=run_dir, job_code=exit_status(None, HUNG_SIGNAL)),
          file=sys.stderr, flush=True)
    retire_run_dir(run_dir)   # the token must not outlive the job
    left = below_top()
    for pid in reversed(left):   # the deepest first
        _kill(pid)
    say(f"killing {who(record)}" + (f" and {len(left)} process(es) left below it" if left else "")
        + f"; the job's status is {exit_status(None, HUNG_SIGNAL)}")
    _kill(top_pid)   # this process ends with it (PR_SET_PDEATHSIG)
    time.sleep(CLOSE_SECONDS)
    return exit_status(None, HUNG_SIGNAL)


def _wait(done, seconds):
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.25)


def _kill(pid):
    try:
        os.kill(pid, HUNG_SIGNAL)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
