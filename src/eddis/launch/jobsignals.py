"""What a Slurm job does with the signals Slurm sends its batch step."""
import signal

from ..errors import JobSignalled

# #SBATCH --signal=B:USR1@N (eddis.slurm.script): the time limit is N seconds away
CHECKPOINT_SIGNAL = signal.SIGUSR1


class JobSignals:
    """SIGTERM and SIGINT (scancel, the time limit) stop the job: the first raises
    :class:`JobSignalled` in the main thread; later ones, and any once the job is
    finishing, are ignored. A signal that must not stop the job (a checkpoint request,
    ``#SBATCH --signal=B:USR1@...``) gets its own entry in :meth:`handlers`."""

    def __init__(self):
        self.stopping = None
        self.armed = False
        self.checkpoint_asked = False  # Slurm's warning before the time limit came

    def handlers(self):
        return {signal.SIGTERM: self._stop, signal.SIGINT: self._stop, CHECKPOINT_SIGNAL: self._ask_checkpoint}

    def _ask_checkpoint(self, signum, frame):
        # only noted here: the main loop passes it on (squeue and scancel are no work for a handler)
        self.checkpoint_asked = True

    def install(self):
        for signum, handler in self.handlers().items():
            signal.signal(signum, handler)
        self.armed = True
        return self

    def disarm(self):
        self.armed = False

    def _stop(self, signum, frame):
        if not self.armed or self.stopping is not None:
            return
        self.stopping = signum
        raise JobSignalled(signum)
