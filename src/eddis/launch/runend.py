"""The end of a run, the same for ``eddis-train --local`` and ``eddis-train --job``: its one
requeue handler, its status and its last line, once its last attempt is over and its run
directory retired.

The trainers may stop before the training is over: after writing the checkpoint they were
asked for (status 0 and rank 0's answer in the run dir: Slurm's warning that the time limit
is near, SIGUSR1 by hand, a request file), or after a SIGTERM to them alone (143, with or
without a checkpoint: a preemption). As submitit's single handler does for a time-out and a
preemption alike, :func:`stopped_early` then queues the run again where it has a queue:

- a Slurm job requeues itself (``scontrol requeue``): after a time-limit warning at most
  ``EDDIS_MAX_REQUEUES`` times (``EDDIS_REQUEUE=0``: never); after a preemption at once and
  uncounted, since Slurm ends a job whose script exits within the grace time instead of
  requeuing it; a bare SIGTERM (``scancel --signal=TERM``) is not requeued;
- ``eddis-train --local`` has no queue: it exits 75 (``REQUEUE_EXIT_STATUS``) and says to run
  the same command again, which resumes from that checkpoint.
"""
import os
import signal
import subprocess

from ..errors import REQUEUE_EXIT_STATUS
from . import preemption
from .status import INTERRUPTED_STATUS, SIGNALLED_STATUS, exit_status

SLURM_COMMAND_TIMEOUT = 10.0


def conclude(launcher, status, answer):
    """The run's status, said in its last line: ``status`` and ``answer`` (the checkpoint answer)
    of its last attempt, or the launcher's own stop signal (``launcher.stopping``)."""
    signum = launcher.stopping
    if signum is None:
        if status == 0 and answer is None:
            launcher.say("done, status 0")
            return 0
        if status in (0, SIGNALLED_STATUS):
            status = stopped_early(launcher, status, answer)
            if status != SIGNALLED_STATUS:
                return status   # requeued (0), or why not (its own lines)
            signum = signal.SIGTERM
        elif status == INTERRUPTED_STATUS:
            signum = signal.SIGINT
        else:
            launcher.say(f"failed, status {status}", err=True)
            return status
    status = exit_status(None, signum)
    launcher.say(f"{'interrupted' if signum == signal.SIGINT else 'stopped'} by {signal.Signals(signum).name}, "
                 f"status {status}", err=True)
    return status


def checkpoint_written(answer):
    """"checkpoint <path> (step <n>)" that the trainers wrote before they stopped, or None."""
    if answer is None:
        return None
    return f"checkpoint {answer.get('checkpoint')} (step {answer.get('step')})"


def stopped_early(launcher, status, answer):
    """The trainers stopped before the training was over (the module's docstring): the run's
    status; SIGNALLED_STATUS when nothing queues it again."""
    where = checkpoint_written(answer)
    if launcher.job_id is None:
        if where is not None:
            launcher.say(f"{launcher.trainers} stopped after writing the requested {where}; run the same "
                         f"command again to resume from it (exit status {REQUEUE_EXIT_STATUS})", err=True)
            return REQUEUE_EXIT_STATUS
        return SIGNALLED_STATUS
    terminated = answer is None or answer.get("terminated", False)
    if not terminated:
        return requeue(launcher, answer)
    preempted = preemption.preempted(launcher.job_id)
    if preempted:
        return requeue(launcher, answer, preempted=True)
    if preempted is None:
        launcher.say(f"{launcher.trainers} stopped on SIGTERM, and `scontrol show job` could not tell whether "
                     "Slurm preempted the job; not requeued" + (f": resubmit to resume from {where}" if where else ""),
                     err=True)
    elif where is not None:
        launcher.say(f"{launcher.trainers} stopped on SIGTERM after writing {where}; the job was not preempted "
                     "(Slurm shows no PreemptTime: scancel --signal=TERM?), so it is not requeued: resubmit it to "
                     "resume", err=True)
    return SIGNALLED_STATUS


def requeue(launcher, answer, preempted=False):
    """Queue the Slurm job again: its trainers wrote the checkpoint they were asked for and
    stopped, or Slurm preempted it (``preempted``; with or without a checkpoint)."""
    from .. import settings

    job_id, run_dir = launcher.job_id, launcher.run_dir
    where = checkpoint_written(answer)
    what = f"wrote {where}" if where else "no checkpoint was written (that takes EDDIS_CHECKPOINT_DIR " \
                                          "and a step boundary within the grace time)"
    if preempted:
        launcher.say(f"preempted by Slurm: {what}")
    if not settings.get("EDDIS_REQUEUE"):
        launcher.say(f"{launcher.trainers} stopped ({what}); EDDIS_REQUEUE=0, so the job ends here: resubmit it "
                     "to resume")
        return 0
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    own = restarts - preemption.preemptions(run_dir)
    limit = settings.get("EDDIS_MAX_REQUEUES")
    if not preempted and own >= limit:
        launcher.say(f"error: {launcher.trainers} stopped after writing {where}, but the job has requeued itself "
                     f"{own} times (EDDIS_MAX_REQUEUES={limit}); not requeued again: raise EDDIS_MAX_REQUEUES or "
                     "the time limit, and resubmit to resume", err=True)
        return 1
    # counted first: Slurm ends this script soon after the requeue
    count = preemption.count_preemption(run_dir) if preempted else None
    try:
        proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True,
                              timeout=SLURM_COMMAND_TIMEOUT)
        failure = None if proc.returncode == 0 else (proc.stderr or proc.stdout).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        failure = str(exc)
    if failure is not None:
        launcher.say(f"error: {launcher.trainers} stopped ({what}), but `scontrol requeue {job_id}` failed: "
                     f"{failure}. Submit with --requeue (the script's #SBATCH --requeue), or resubmit the job to "
                     "resume", err=True)
        return 1
    if preempted:
        launcher.say(f"requeued job {job_id} (run {restarts + 2}; preemption {count}, not counted against "
                     "EDDIS_MAX_REQUEUES) now, not at the end of Slurm's grace time; it "
                     f"{'resumes there' if where else 'resumes from its last checkpoint, if any,'} when Slurm "
                     "runs it again")
        return 0
    launcher.say(f"wrote {where}; requeued job {job_id} (run {restarts + 2}), which resumes there")
    return 0
