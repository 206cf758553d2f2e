"""The end of one attempt, the same for ``eddis-train --local`` and ``eddis-train --job``.

An attempt starts the smb-servers, waits for them and runs the trainers: the launcher's own
part (:class:`Launcher`), processes on this machine (:mod:`.local`) or Slurm steps
(:mod:`.jobrun`). Once the trainers have ended, both end it here, in this order:

1. the trainers' fate: the status the trainer guard wrote when it had to end their launcher;
   a launcher that died after every rank had finished the training did not fail it; one that
   returned 0 while a rank recorded no exit (Slurm ends the tasks of a failed node without
   one) did;
2. what is left is stopped: the smb-servers are asked in the run dir to stop, so that each
   server's supervisor stops it and records its end; the launcher ends what still runs after
   a bound;
3. the liveness verdicts, now that every server's end is on record: an elastic run that lost
   ranks, or a node with its server, finished degraded (0) or failed;
4. a finished attempt: the checkpoint the trainers wrote on request before they stopped (for
   the requeue handler, :mod:`.runend`), the elastic commits of a training that is over; a
   failed one: an interrupt every rank recorded is no failure (130); else the root-cause
   report, and the root cause's status.

What comes after (another attempt, a requeue, the run's status) is :mod:`.restarts`' and
:mod:`.runend`'s; the run directory is retired once, when the run ends.
"""
import abc
import sys

from .elastic import elastic_run, elastic_status
from .jobsteps import (COMPLETE_BEFORE_CHECKPOINT, every_rank_finished, every_rank_interrupted, ranks_without_exit,
                       remove_elastic_commits, report_failure, trainers_status)
from .report import describe_exit, root_cause
from .status import INTERRUPTED_STATUS


class Launcher(abc.ABC):
    """What a launcher gives the parts of a run that both launchers share: the end of an
    attempt, the attempts (:mod:`.restarts`) and the run's end (:mod:`.runend`)."""

    prefix = "eddis-train"   # its lines start with "<prefix>: "
    steps = "the smb-server and the ranks"   # what an attempt starts, as its lines name them
    where = ""               # where they start again (" in this allocation")
    trainers = "the ranks"
    tool = "mpirun"          # what starts the trainers, as the lines name it
    job_id = None            # the Slurm job's id: its requeue handler needs it; None: no queue
    run_dir = None

    def say(self, text, err=False):
        print(f"{self.prefix}: {text}", file=sys.stderr if err else sys.stdout, flush=True)

    @property
    def stopping(self):
        """The signal that stops the whole run, once one came (then no attempt follows)."""
        return None

    @abc.abstractmethod
    def attempt(self):
        """Start the smb-servers and the trainers, watch them, and end the attempt
        (:func:`end_attempt`): ``(status, the trainers' checkpoint answer or None)``."""

    @abc.abstractmethod
    def end_servers(self):
        """Stop the smb-servers once the trainers have ended: asked in the run dir first, so
        that each server's supervisor records its end; bounded."""

    def replan(self):
        """Before a restart: plan it (a Slurm job leaves failed nodes out); False when it cannot run."""
        return True


def end_attempt(launcher, status):
    """End the attempt whose trainers' launcher ended with ``status`` (module docstring):
    ``(the attempt's status, the checkpoint answer or None)``."""
    from ..smb.rundir import checkpoint_answer, training_was_complete

    run_dir = launcher.run_dir
    status = trainers_fate(launcher, status)
    launcher.end_servers()
    if elastic_run():
        status = elastic_status(run_dir, status, sys.stderr)
    if status == 0:
        answer = checkpoint_answer(run_dir)
        if training_was_complete(run_dir):
            launcher.say(COMPLETE_BEFORE_CHECKPOINT)
        if answer is None:
            remove_elastic_commits(run_dir)
        return 0, answer
    if root_cause(run_dir)[0] is None and (status == INTERRUPTED_STATUS or every_rank_interrupted(run_dir)):
        # an interrupt that reached the trainers themselves (scancel --signal=INT of the step):
        # no rank failed
        launcher.say(f"{launcher.trainers} were interrupted (SIGINT)", err=True)
        return INTERRUPTED_STATUS, None
    status, _ = report_failure(run_dir, status)
    return status, None


def trainers_fate(launcher, status):
    """The trainers' status, from their launcher's ``status`` and the ranks' records."""
    run_dir = launcher.run_dir
    status = trainers_status(run_dir, status)
    tool = launcher.tool
    if status > 128 and every_rank_finished(run_dir):
        launcher.say(f"{tool} {describe_exit(None, status - 128)} after every rank had finished the training: "
                     f"{tool} failed at the step's end, not the training; the job goes on as finished", err=True)
        return 0
    missing = ranks_without_exit(run_dir) if status == 0 and not elastic_run() else []
    if missing:
        launcher.say(f"{tool} ended with status 0, but rank(s) {', '.join(map(str, missing))} recorded no exit "
                     f"(Slurm ends the tasks on a failed node without one): {launcher.trainers} failed", err=True)
        return 1
    return status
