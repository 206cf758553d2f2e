"""Horovod's elastic API (``hvd.elastic.run``, ``State``), mapped onto EDDIS.

Horovod restarts the training function on the survivors when a worker is lost:
it restores the last ``commit()``, re-forms the ring and ``sync()``s the state
from a surviving rank. EDDIS needs none of that in the modes that continue
without a lost rank (easgd, hybrid with EDDIS_ELASTIC=1): the survivors never
see an error and train on against the centre variable, and the lost worker's
state ends with its process. Workers never join a running job either. So:

- ``run(func)`` syncs the state once and calls ``func(state, ...)`` once; in
  sync modes a lost rank ends the job, which restarts from its last checkpoint
  (EDDIS_MAX_RESTARTS), not from an in-memory commit;
- ``State.sync()`` broadcasts the state from rank 0, the lowest rank, while all
  ranks live (an MPI broadcast with a lost member never completes: after a loss
  it is refused, saying why);
- ``commit()`` keeps an in-memory copy (``save()``), ``restore()`` goes back to it;
  ``check_host_updates()`` has nothing to check (membership only shrinks, and
  that needs no action from the script).

Framework adapters subclass :class:`ObjectState` for their models and optimizers
(``eddis.torch.elastic.TorchState``).
"""
import copy
import functools

from ..errors import UsageError
from . import collectives, elastic, runtime


def run(func):
    """Decorator: ``func(state, *args, **kwargs)`` runs once, after ``state.sync()``."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        state.sync()
        state.on_reset()   # what Horovod does after each (re)start; here the only one
        return func(state, *args, **kwargs)
    return wrapper


class State:
    """The training state the script commits and restores (Horovod's ``hvd.elastic.State``)."""

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Keep the current state in memory (what ``restore()`` returns to)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Horovod interrupts here when hosts were added or removed; EDDIS never adds any, and
        a lost one needs nothing of the survivors."""

    def save(self):
        raise UsageError(f"{type(self).__name__} must define save()")

    def restore(self):
        raise UsageError(f"{type(self).__name__} must define restore()")

    def sync(self):
        raise UsageError(f"{type(self).__name__} must define sync()")

    @staticmethod
    def sync_root(what):
        """The rank a sync broadcasts from (0), or a UsageError once a rank is lost."""
        runtime.require(what)
        members = elastic.current()
        lost = members.lost() if members is not None else []
        if lost:
            raise UsageError(f"{what} after rank(s) {', '.join(map(str, lost))} were lost: a broadcast needs "
                             "every rank. In an elastic easgd/hybrid run the survivors need no sync; "
                             "train on with the state they have.")
        return 0


class ObjectState(State):
    """Plain Python values as attributes (Horovod's ``ObjectState``): ``ObjectState(epoch=0)``."""

    def __init__(self, **kwargs):
        super().__init__()
        self._values = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved = None
        self.save()

    def _current(self):
        return {name: getattr(self, name) for name in self._values}

    def save(self):
        self._saved = copy.deepcopy(self._current())

    def restore(self):
        for name, value in copy.deepcopy(self._saved).items():
            setattr(self, name, value)

    def sync(self):
        root = self.sync_root("state.sync()")
        values = collectives.broadcast_object(self._current(), root=root, what="elastic state.sync()")
        for name, value in values.items():
            setattr(self, name, value)
        self.save()
