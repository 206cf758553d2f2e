"""The attempts of a run, the same for ``eddis-train --local`` and ``eddis-train --job``.

An attempt that did not finish is run again, with fresh smb-servers and trainers and a run
directory cleared of its records (they were reported):

- once more (``EDDIS_START_RETRIES``) when the root cause is a rank that crashed before its
  ``eddis.init()`` returned: Open MPI 4.1 crashes inside MPI_Init about once in 250 starts on
  a loaded node (docs/reliability.md), and a second start does not meet the same race; no
  training was lost;
- at most ``EDDIS_MAX_RESTARTS`` times after the trainers failed, where the launcher can
  plan it (a Slurm job leaves its failed nodes out, :func:`.placement.without_failed_nodes`);
  a script that calls ``eddis.resume()`` continues from its last checkpoint.

Not after a finish (0: the training is over, or the trainers stopped after a checkpoint they
were asked for), nor after a stop on purpose: the launcher's own signal, or the trainers
interrupted (130) or terminated (143, a preemption) by a signal to them. ``EDDIS_RESTART_COUNT``
tells each attempt's ranks how many came before it.
"""
import os

from .jobsteps import create_run_dir
from .report import describe_failure, start_up_crash
from .status import INTERRUPTED_STATUS, SIGNALLED_STATUS

STOPPED_ON_PURPOSE = (INTERRUPTED_STATUS, SIGNALLED_STATUS)


def run_attempts(launcher):
    """Run ``launcher``'s attempts (an :class:`.attempt.Launcher`) until one needs no other:
    ``(status, checkpoint answer)`` of the last."""
    restarts = retries = 0
    while True:
        os.environ["EDDIS_RESTART_COUNT"] = str(restarts + retries)
        status, answer = launcher.attempt()
        if status == 0 or status in STOPPED_ON_PURPOSE or launcher.stopping is not None:
            return status, answer
        if retry_start_up(launcher, retries):
            retries += 1
        elif restart_after(launcher, restarts):
            restarts += 1
        else:
            return status, answer
        launcher.run_dir = create_run_dir(launcher.run_dir)


def retry_start_up(launcher, retries):
    """Whether to run the attempt again after a rank crashed before its eddis.init() returned."""
    from .. import settings

    crash = start_up_crash(launcher.run_dir)
    if crash is None:
        return False
    limit = settings.get("EDDIS_START_RETRIES")
    what = f"{describe_failure(crash)} before eddis.init() returned"
    if retries >= limit:
        if limit > 0:
            launcher.say(f"{what}, again after {retries} start retry(ies) (EDDIS_START_RETRIES={limit})", err=True)
        return False
    launcher.say(f"{what}: a crash in the start-up (Open MPI 4.1 under Slurm's PMIx crashes inside MPI_Init "
                 f"about once in 250 starts); starting {launcher.steps} again (start retry {retries + 1} of "
                 f"{limit}, EDDIS_START_RETRIES)", err=True)
    return True


def restart_after(launcher, restarts):
    """Whether to run the attempt again after the trainers failed (EDDIS_MAX_RESTARTS)."""
    from .. import settings

    limit = settings.get("EDDIS_MAX_RESTARTS")
    if limit <= 0:
        return False
    if restarts >= limit:
        launcher.say(f"{launcher.trainers} failed again after {restarts} restart(s) (EDDIS_MAX_RESTARTS={limit}); "
                     "giving up", err=True)
        return False
    if not launcher.replan():
        return False
    launcher.say(f"restarting {launcher.steps}{launcher.where} (restart {restarts + 1} of {limit}); a script "
                 "that calls eddis.resume() continues from its last checkpoint", err=True)
    return True
