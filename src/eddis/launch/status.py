"""Exit statuses as a shell reports them, and the one rule for a run's status.

Every part of the launcher turns how a process ended into a status here: the ``--local``
run and the Slurm job (their launcher's return code, the root cause's record), the
supervisors of a rank and of an smb-server, and the trainer guard, so that a status
means the same wherever it is printed.
"""
import signal

SIGNALLED_STATUS = 128 + signal.SIGTERM   # 143: what a shell reports for a process ended by SIGTERM (scancel)
INTERRUPTED_STATUS = 128 + signal.SIGINT  # 130: Ctrl-C


def exit_status(code, signum=None):
    """The status a shell reports for a process that ended with ``code`` (a Popen return code:
    -N for signal N) or was killed by ``signum`` (a record's ``signal``); 1 when neither is known."""
    if signum:
        return 128 + int(signum)
    if code is None:
        return 1
    code = int(code)
    return 128 - code if code < 0 else code


def run_status(root_cause, status):
    """The status of a run whose launcher ended with ``status`` and whose records name
    ``root_cause`` (a failure record, or None): the root cause's, never 0 (srun's and
    mpirun's own status may be a peer's SIGKILL, or 0 for a rank lost without an exit), else
    ``status``."""
    if root_cause is None:
        return status
    return exit_status(root_cause.get("code"), root_cause.get("signal")) or 1
