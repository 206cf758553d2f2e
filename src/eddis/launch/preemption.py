"""Preemption: Slurm's SIGTERM that comes with a grace time, answered with a checkpoint.

What Slurm 22.05 does to a job preempted with ``PreemptMode=REQUEUE`` and a partition's
``GraceTime=G`` (seen on the dev cluster): every process of every step (trainers, their
children, the smb-servers) gets SIGCONT and SIGTERM at once; the batch script gets nothing;
``scontrol show job`` shows ``JobState=RUNNING``, ``PreemptTime=<now>`` and
``EndTime=<now + G>``. After G s Slurm requeues the job (``Restarts`` + 1, no PreemptTime
shown any more), then signals everything, the batch script too, and kills it after KillWait. A batch script that exits within G ends the job
``COMPLETED`` (or ``FAILED``), and Slurm does not requeue it. A plain ``scancel`` signals the
batch script and the steps at the same moment, ``PreemptTime`` stays ``None``.

So, in a job with ``EDDIS_CHECKPOINT_DIR``:

- each trainer's first SIGTERM is a checkpoint request (``eddis.init()``, told so by its
  ``eddis-train`` through EDDIS_CHECKPOINT_ON_SIGTERM), and ``eddis-train`` gives it
  EDDIS_CHECKPOINT_GRACE s to write it and stop with status 75 before it stops it;
- each smb-server's supervisor keeps its server up until the job asks the servers to stop
  (after the trainers), or for that grace and EDDIS_STOP_GRACE more;
- the job, which got no signal, asks Slurm once whether it was preempted
  (:func:`preempted`) and requeues itself at once (``scontrol requeue``), which frees the
  nodes for the preemptor before the grace time is over; a preemption is not counted
  against EDDIS_MAX_REQUEUES (:func:`count_preemption`).

When the batch script gets SIGTERM as well (``scancel``, the time limit), the job asks every
step to stop through the run directory, and they stop at once, as without checkpoints.
"""
import os
import subprocess
from pathlib import Path

from .. import settings

PREEMPTIONS_FILE = "preemptions"  # in the run dir, kept across the job's requeues
SLURM_COMMAND_TIMEOUT = 10.0
# between a second SIGTERM (or the grace's end) and a server's stop, for the trainers' own end
SERVER_MARGIN_SECONDS = 10.0


def checkpoint_on_sigterm(env=None):
    """Whether this process is in a Slurm job step whose trainers checkpoint on SIGTERM."""
    env = os.environ if env is None else env
    return bool(env.get("SLURM_STEP_ID") is not None and env.get("SLURM_JOB_ID")
                and settings.get("EDDIS_CHECKPOINT_DIR", env) is not None)


def server_wait_seconds():
    """How long an smb-server outlives the SIGTERM that asked the trainers for a checkpoint."""
    return settings.get("EDDIS_CHECKPOINT_GRACE") + settings.get("EDDIS_STOP_GRACE") + SERVER_MARGIN_SECONDS


def job_fields(job_id, env=None):
    """``scontrol show job -o`` of ``job_id`` as a dict per line (a hetjob has one per
    component); None when Slurm cannot be asked."""
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                              timeout=SLURM_COMMAND_TIMEOUT, env=None if env is None else dict(env))
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in proc.stdout.splitlines()
            if line.strip()]


def preempted(job_id, env=None):
    """True when Slurm shows the running job preempted (a PreemptTime), False when it does not,
    None when it cannot be asked."""
    lines = job_fields(job_id, env)
    if not lines:
        return None
    return any(line.get("PreemptTime", "None") not in ("None", "Unknown", "") for line in lines)


def requeued_by_slurm(job_id, env=None):
    """True when Slurm has already requeued the running job (its ``Restarts`` passed this run's
    SLURM_RESTART_COUNT): at the end of a preemption's grace time Slurm requeues the job
    first and then signals it, and shows no PreemptTime any more. None when it cannot be asked."""
    lines = job_fields(job_id, env)
    if not lines or not lines[0].get("Restarts", "").isdigit():
        return None
    return int(lines[0]["Restarts"]) > int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def _count_file(run_dir):
    return Path(run_dir) / PREEMPTIONS_FILE


def preemptions(run_dir):
    """How many times this job was preempted and requeued (0 on its first run)."""
    if not (os.environ.get("SLURM_RESTART_COUNT") or "0").strip("0"):
        return 0  # a first run: a count is another job's of the same id (a rebuilt cluster)
    try:
        return int(_count_file(run_dir).read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def count_preemption(run_dir):
    """One more preemption; returns the count."""
    count = preemptions(run_dir) + 1
    path = _count_file(run_dir)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # a retired run dir may be gone
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{count}\n")
    os.replace(tmp, path)
    return count
