"""A Slurm job's steps as processes (their sruns, or an elastic run's mpirun): started,
waited for, stopped. Every wait is bounded; what does not end is cancelled, then killed."""
import signal
import subprocess
import sys
import time

from . import jobsteps
from .jobsteps import TRAINER_STEP_NAME
from .report import request_servers_stop, request_stop
from .stepcommands import SERVER_STEP_NAME

STOP_SECONDS = 30.0  # for the steps to end after scancel --signal=TERM
SLURM_ASK_SECONDS = 1.0  # between two squeue calls while steps stop
SLURM_COMMAND_TIMEOUT = 10.0
POLL_SECONDS = 0.2


def start_step(argv):
    # srun would pass the job's stdin on to the step's first task
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL)


def running(sruns):
    return [p for p in sruns if p.poll() is None]


def wait_ended(sruns, seconds, poll=POLL_SECONDS):
    """Wait until every srun has ended, at most ``seconds``; the ones still running."""
    deadline = time.monotonic() + seconds
    while running(sruns) and time.monotonic() < deadline:
        time.sleep(poll)
    return running(sruns)


def scancel(args, env=None):
    try:
        subprocess.run(["scancel", *args], capture_output=True, timeout=SLURM_COMMAND_TIMEOUT,
                       env=None if env is None else dict(env))
    except (OSError, subprocess.TimeoutExpired):
        pass  # the kill that follows ends the sruns; Slurm ends their steps with the job


def _wait_steps(name, sruns, env, wait, poll):
    """Wait, at most ``wait`` s, for the sruns of this job's steps named ``name`` to end.
    srun can miss the end of a hetjob step (Slurm 22.05): once Slurm lists none of these
    steps any more, their sruns get STEP_GONE_GRACE s. True when Slurm lists them no more."""
    deadline = time.monotonic() + wait
    next_ask = time.monotonic() + SLURM_ASK_SECONDS
    gone_at = None
    while running(sruns) and time.monotonic() < deadline:
        now = time.monotonic()
        if now >= next_ask:
            next_ask = now + SLURM_ASK_SECONDS
            if jobsteps.step_ids(name, env) == []:
                gone_at = gone_at or now
                if now - gone_at >= jobsteps.STEP_GONE_GRACE:
                    break
        time.sleep(poll)
    return gone_at is not None


def _kill_waiting(sruns, poll):
    for srun in running(sruns):  # an srun still waiting for a step that has ended
        srun.kill()
    wait_ended(sruns, SLURM_COMMAND_TIMEOUT, poll)


def stop_steps(name, sruns, env=None, wait=STOP_SECONDS, poll=POLL_SECONDS):
    """Stop this job's steps named ``name`` and wait, bounded, for their sruns (Popen objects).

    SIGTERM through scancel, not to srun: srun answers SIGTERM with SIGKILL, which would
    leave the servers' shared memory behind. What is left after ``wait`` s (or once Slurm
    lists none of the steps, :func:`_wait_steps`) is cancelled, and its srun killed."""
    sruns = [p for p in sruns if p is not None]
    if not sruns:
        return
    steps = jobsteps.step_ids(name, env) or []
    if steps:
        scancel(["--signal=TERM", *steps], env)
    _wait_steps(name, sruns, env, wait, poll)
    if steps and running(sruns):
        scancel(steps, env)
    _kill_waiting(sruns, poll)


def stop_mpirun(run_dir, mpirun, reason, env=None, wait=STOP_SECONDS, poll=POLL_SECONDS):
    """Stop the elastic trainers' ``mpirun`` (a Popen) and wait, bounded, for it: first through the
    run dir, where every rank's supervisor stops its trainer gently (EDDIS_STOP_GRACE), then
    SIGTERM to mpirun, which passes it on to the supervisors and ends them soon after; what is
    left ``wait`` s later is killed, the nodes' daemon steps cancelled."""
    from .. import settings

    if mpirun is None or mpirun.poll() is not None:
        return
    request_stop(run_dir, reason, signal.SIGTERM)
    if not wait_ended([mpirun], settings.get("EDDIS_STOP_GRACE") + wait, poll):
        return
    mpirun.send_signal(signal.SIGTERM)
    if not wait_ended([mpirun], wait, poll):
        return
    steps = jobsteps.step_ids(TRAINER_STEP_NAME, env) or []
    if steps:
        scancel(steps, env)
    jobsteps.kill_tree(mpirun.pid)
    wait_ended([mpirun], SLURM_COMMAND_TIMEOUT, poll)


def end_server_steps(run_dir, sruns, env=None, wait=STOP_SECONDS, poll=POLL_SECONDS):
    """End the smb-server steps of a job whose trainers have ended: every server's supervisor
    is asked in the run dir to stop its server, and exits 0, so that its step ends COMPLETED
    and slurmstepd prints nothing (a cancelled step prints ``error: *** STEP ... CANCELLED ***``
    into the job's output). Steps still running after ``wait`` s are cancelled
    (:func:`stop_steps`), and the job's output says so."""
    sruns = [p for p in sruns if p is not None]
    if not running(sruns):
        return
    request_servers_stop(run_dir, "the job's trainers have ended")
    if _wait_steps(SERVER_STEP_NAME, sruns, env, wait, poll) or not running(sruns):
        _kill_waiting(sruns, poll)
        return
    print(f"eddis_job: {len(running(sruns))} smb-server step(s) did not end within {wait:.0f} s of the "
          "request to stop; cancelling them", file=sys.stderr, flush=True)
    stop_steps(SERVER_STEP_NAME, sruns, env, wait, poll)
