"""The one exception family of EDDIS.

Every failure raised by EDDIS is an :class:`EddisError` carrying a numeric
``code`` (a UCS status, an errno, an MPI error code, or -1) and a ``message``.
Where a Python built-in exception means the same thing, the raised class also
derives from it, so ``except TimeoutError`` works on an SMB wait that timed out.

Every exception class of EDDIS is defined here, the native extensions' too;
the modules that raise one may re-export it under its old address
(``eddis.core.reducer.ReductionError``). tests/test_errors.py holds the package
to that.
"""
import errno as _errno


class EddisError(Exception):
    """Base class: ``code`` is the native status, ``message`` says what and how to fix."""

    def __init__(self, message, code=-1):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self):
        return f"{self.message} (code {self.code})" if self.code not in (-1, None) else self.message


class SMBError(EddisError):
    """A failure in the SMB layer (server, client, transport)."""


class SMBTimeoutError(SMBError, TimeoutError):
    pass


class SMBConnectionError(SMBError, ConnectionError):
    pass


class SMBKeyError(SMBError, KeyError):
    def __str__(self):  # KeyError would repr() the message
        return EddisError.__str__(self)


class SMBBoundsError(SMBError, IndexError):
    pass


class SMBPermissionError(SMBError, PermissionError):
    pass


class SMBMemoryError(SMBError, MemoryError):
    pass


class SMBValueError(SMBError, ValueError):
    pass


class SMBNotImplementedError(SMBError, NotImplementedError):
    pass


class ConfigError(EddisError, ValueError):
    """A bad setting, argument or environment variable."""


class UsageError(EddisError, RuntimeError):
    """The API was used out of order (for example ``init()`` not called)."""


class SMBServerError(SMBError, RuntimeError):
    """An smb-server process failed: it ended before it published its address (the message has
    its output), or it stops because one of its threads died (the handshake gate or the request
    loop; the message names the thread and why, and the server exits with status 70)."""


# ---------------------------------------------------------------- the runtime's collectives
class CollectiveTimeoutError(EddisError, TimeoutError):
    """Other ranks did not join a collective call in time."""


class MPIError(EddisError, RuntimeError):
    """An MPI call failed; ``code`` is the MPI error code (extension ``eddis._mpi``)."""


class ReductionError(EddisError, RuntimeError):
    """The background communication failed; the cause is chained."""


class ReductionTimeoutError(EddisError, TimeoutError):
    """A step's reduction did not finish within EDDIS_COMM_TIMEOUT."""


class ProgressTimeoutError(EddisError, TimeoutError):
    """The staleness bound kept a rank waiting longer than EDDIS_COMM_TIMEOUT."""


class ProgressError(EddisError, RuntimeError):
    """The global learning counter does not hold what this job's claims left in it."""


class MembershipTimeoutError(EddisError, TimeoutError):
    """An elastic run's wait for its live ranks ran out (a rank neither arrived nor was lost)."""


class ParameterDriftError(EddisError, RuntimeError):
    """In a synchronous mode the ranks' parameters no longer agree: something trains outside
    the gradient averaging (nothing wrapped, or an update that bypasses the wrapper)."""


class NodeFailureError(EddisError, RuntimeError):
    """Too few healthy nodes remain in a job's allocation to restart its trainers; the
    message names the failed nodes and the fixes."""


class CheckpointError(EddisError, OSError):
    """Saving, finding or restoring a checkpoint failed (or does not fit this job); every rank
    raises it, naming the rank and the cause."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's file is missing, truncated or changed since it was written (its size or
    SHA-256 differs from its manifest's), or the manifest itself is: it is never loaded.
    ``problem`` names the file, what was expected and what was found; the message adds the fix."""

    def __init__(self, problem, fix=None):
        super().__init__(problem if fix is None else f"{problem}; {fix}")
        self.problem = problem


# The exit status of a rank that stopped after writing a requested checkpoint (BSD's
# EX_TEMPFAIL: try again later). Defined here, in the base layer, so that the launcher,
# which may not import the runtime, can tell a stop for requeue from a failure.
REQUEUE_EXIT_STATUS = 75


class CheckpointStop(EddisError, SystemExit):
    """Raised on every rank at the step boundary where a requested checkpoint (SIGUSR1,
    ``eddis.core.checkpoint.request``) was written: the run stops so the job can be requeued.
    A SystemExit whose ``code`` is :data:`REQUEUE_EXIT_STATUS`, so an uncaught one ends the
    process with that status (no traceback, a clean shutdown)."""

    def __init__(self, message, path=None):
        super().__init__(message, code=REQUEUE_EXIT_STATUS)
        self.path = path


# ---------------------------------------------------------------- profiles and timelines
class TimelineError(EddisError):
    """A failure reading what EDDIS_PROFILE or EDDIS_TIMELINE left on disk."""


class TimelineNotFoundError(TimelineError, FileNotFoundError):
    """No profile or trace files where the run should have left them."""


class TimelineFormatError(TimelineError, ValueError):
    """A file that is not an EDDIS profile or trace, or one that holds no ranks."""


# UCS status codes (ucs/type/status.h), mapped to the closest built-in.
UCS_STATUS_CLASSES = {
    -3: SMBConnectionError,      # UCS_ERR_IO_ERROR
    -4: SMBMemoryError,          # UCS_ERR_NO_MEMORY
    -5: SMBValueError,           # UCS_ERR_INVALID_PARAM
    -6: SMBConnectionError,      # UCS_ERR_UNREACHABLE
    -7: SMBValueError,           # UCS_ERR_INVALID_ADDR
    -8: SMBNotImplementedError,  # UCS_ERR_NOT_IMPLEMENTED
    -12: SMBKeyError,            # UCS_ERR_NO_ELEM
    -14: SMBConnectionError,     # UCS_ERR_NO_DEVICE
    -18: SMBValueError,          # UCS_ERR_ALREADY_EXISTS
    -19: SMBBoundsError,         # UCS_ERR_OUT_OF_RANGE
    -20: SMBTimeoutError,        # UCS_ERR_TIMED_OUT
    -21: SMBMemoryError,         # UCS_ERR_EXCEEDS_LIMIT
    -22: SMBNotImplementedError,  # UCS_ERR_UNSUPPORTED
    -23: SMBPermissionError,     # UCS_ERR_REJECTED
    -24: SMBConnectionError,     # UCS_ERR_NOT_CONNECTED
    -25: SMBConnectionError,     # UCS_ERR_CONNECTION_RESET
    -80: SMBTimeoutError,        # UCS_ERR_ENDPOINT_TIMEOUT
}

ERRNO_CLASSES = {
    _errno.ETIMEDOUT: SMBTimeoutError,
    _errno.ECONNREFUSED: SMBConnectionError,
    _errno.ECONNRESET: SMBConnectionError,
    _errno.EHOSTUNREACH: SMBConnectionError,
    _errno.ENOENT: SMBKeyError,
    _errno.EACCES: SMBPermissionError,
    _errno.EPERM: SMBPermissionError,
    _errno.ENOMEM: SMBMemoryError,
    _errno.ERANGE: SMBBoundsError,
    _errno.EINVAL: SMBValueError,
    _errno.ENOSYS: SMBNotImplementedError,
}


def from_ucs_status(status, message):
    """The exception for a UCS status code (negative int) and its message."""
    status = int(status)
    if -59 <= status <= -40:  # link failures
        cls = SMBConnectionError
    elif -89 <= status <= -60:  # endpoint failures
        cls = SMBTimeoutError if status == -80 else SMBConnectionError
    else:
        cls = UCS_STATUS_CLASSES.get(status, SMBError)
    return cls(message, status)


def from_errno(err, message):
    """The exception for an errno value and its message."""
    return ERRNO_CLASSES.get(int(err), SMBError)(message, int(err))


class JobSignalled(BaseException):
    """Slurm asked the job to stop (eddis-train --job). Not an error, and a BaseException
    as KeyboardInterrupt is, so that no ``except Exception`` on the way (a poll loop that
    tolerates an unreadable file) holds it up."""

    def __init__(self, signum):
        import signal

        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class EddisWarning(UserWarning):
    """Base of the warnings EDDIS gives: something went on that is legal but is rarely what
    the script meant. A warning, not an EddisError: it is never raised as a failure."""


class FinalModelWarning(EddisWarning):
    """easgd/hybrid trained, but the script never loaded the centre variable
    (``eddis.final_model``): what it evaluates or saves is one worker's parameters."""


# Control-flow signals defined here that are deliberately not EddisErrors.
SIGNALS = (JobSignalled,)
