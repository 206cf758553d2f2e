"""Horovod's elastic API (``hvd.elastic.run``, ``State``), mapped onto EDDIS.

Horovod restarts the training function on the survivors when a worker is lost:
it restores the last ``commit()``, re-forms the ring and ``sync()``s the state
from a surviving rank. EDDIS needs none of that in the modes that continue
without a lost rank (easgd, hybrid with EDDIS_ELASTIC=1): the survivors never
see an error and train on against the centre variable, and the lost worker's
state ends with its process. Workers never join a running job either. So:

- ``run(func)`` syncs the state once and calls ``func(state, ...)`` once; in
  sync modes a lost rank ends the job, which restarts its trainers (EDDIS_MAX_RESTARTS),
  so there the commits are persisted: ``commit()`` writes a checkpoint of the run
  (:mod:`eddis.core.checkpoint.save`, one consistent cut on every rank, the state's
  values in its manifest) into :func:`commit_folder`, and ``run`` on a restarted run
  first restores the newest one that verifies (:func:`latest_commit`), model, optimizer,
  RNGs and values (epoch, batch, ...), so that ``func`` goes on from the last commit;
- the reset callbacks (``register_reset_callbacks``) run where Horovod runs them: after a
  reset, never at the first start. Horovod's reset is the restart of ``func`` after a
  worker was lost, from the last commit, with ``reset()`` and the callbacks before the
  ``sync()``; EDDIS's is ``run`` going on from a persisted commit (a restarted sync run,
  or a new job that resumes the commits in EDDIS_CHECKPOINT_DIR), in the same order. The
  survivors of a lost rank in easgd/hybrid are not interrupted and keep their rank and
  size, so nothing resets there;
- ``State.sync()`` broadcasts the state from rank 0, the lowest rank, while all
  ranks live (an MPI broadcast with a lost member never completes: after a loss
  it is refused, saying why);
- ``commit()`` keeps an in-memory copy (``save()``), ``restore()`` goes back to it;
  ``check_host_updates()`` has nothing to check (membership only shrinks, and
  that needs no action from the script).

Framework adapters subclass :class:`ModelState` for their models and optimizers
(``eddis.torch.elastic.TorchState``, ``eddis.tensorflow.elastic.TensorFlowKerasState``): it
persists and restores the commits through the adapter's own ``eddis.checkpoint``/``resume``.
"""
import copy
import functools
import logging
import os

from ... import settings
from ...errors import UsageError
from ...smb.rundir import ELASTIC_COMMITS_DIR
from ..comm import collectives, elastic, runtime
from . import verify

log = logging.getLogger("eddis.core.elastic_state")

# the manifest's extra entry of a checkpoint a commit wrote: the state's values
COMMIT_ENTRY = "elastic_state"
PERSISTED_MODES = ("sync", "allreduce")   # a lost rank restarts the trainers there


def commit_folder(mode):
    """Where ``commit()`` persists the state in ``mode``: EDDIS_CHECKPOINT_DIR, else
    ``<run dir>/elastic-commits`` when the job restarts failed trainers (EDDIS_MAX_RESTARTS > 0);
    None (in memory only) in easgd/hybrid, whose survivors go on with what they hold, and
    when nothing would ever read the commit back."""
    if mode not in PERSISTED_MODES:
        return None
    folder = settings.get("EDDIS_CHECKPOINT_DIR")
    if folder is not None:
        return folder
    run_dir = settings.get("EDDIS_RUN_DIR")
    if settings.get("EDDIS_MAX_RESTARTS") > 0 and run_dir is not None:
        return os.path.join(run_dir, ELASTIC_COMMITS_DIR)
    return None


def is_commit(manifest):
    """Whether a checkpoint's manifest is a commit's (periodic checkpoints hold no state values)."""
    return COMMIT_ENTRY in manifest.get("extra", {})


def latest_commit(folder):
    """Collective: the newest checkpoint in ``folder`` that a commit wrote and whose files verify
    against their checksums, or None: no commit there. As a plain resume does, a commit that fails
    verification is named in the job output, with why, and set aside, and the one before it is
    taken; with none that verifies, every rank raises CheckpointCorruptError
    (:func:`eddis.core.checkpoint.verify.choose_for_name`)."""
    return verify.choose_for_name(folder, is_commit, "elastic commit")


def run(func):
    """Decorator: ``func(state, *args, **kwargs)`` runs once, after ``state.sync()``; from the
    last persisted commit when there is one (a restarted sync run)."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if state.restore_commit():
            state.on_reset()   # Horovod's order after a reset: restore, reset, callbacks, sync
        state.sync()
        return func(state, *args, **kwargs)
    return wrapper


class State:
    """The training state the script commits and restores (Horovod's ``hvd.elastic.State``)."""

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions ``run`` calls, in this order, after a reset (never at the first start), e.g.
        to scale the learning rate with ``size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self):
        """Subclasses: reset objects and variables after a reset event, before the sync."""

    def commit(self):
        """Keep the current state in memory (what ``restore()`` returns to) and, where the
        adapter persists commits, as a checkpoint too (:meth:`persist_commit`)."""
        self.save()
        self.persist_commit()
        self.check_host_updates()

    def persist_commit(self):
        """Adapters whose state holds a model and its optimizer write the commit as a checkpoint
        into :func:`commit_folder` (collective: every rank commits together); plain values stay
        in memory."""

    def restore_commit(self):
        """Adapters: restore the newest persisted commit, if any; whether there was one."""
        return False

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

    def _set_values(self, values):
        for name in self._values:
            if name in values:
                setattr(self, name, values[name])

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


class ModelState(ObjectState):
    """A model, its optimizer and plain values as one elastic state, whose commits in sync
    modes are checkpoints of the run (:func:`commit_folder`). An adapter's subclass gives
    ``checkpointing``, its module with ``checkpoint(folder, model, optimizer, **extra)`` and
    ``resume(path, model, optimizer)``, and :meth:`training_mode`; it keeps the in-memory
    copy itself (``save``/``restore``/``sync``, framework tensors)."""

    checkpointing = None
    _warned_in_memory = False

    def training_mode(self):
        """The mode the model trains in, where the adapter's ``eddis.checkpoint`` can cut its
        state (an eddis.DistributedOptimizer; in TensorFlow also a plain optimizer beside a
        DistributedGradientTape), else None (a plain torch optimizer)."""
        raise UsageError(f"{type(self).__name__} must define training_mode()")

    def _commit_folder(self):
        mode = self.training_mode()
        if mode is not None:
            return commit_folder(mode)
        if (self.model is not None and self.optimizer is not None and not ModelState._warned_in_memory
                and commit_folder(settings.get("EDDIS_MODE")) is not None):
            ModelState._warned_in_memory = True
            log.warning("%s: the optimizer is not an eddis.DistributedOptimizer, so state.commit() stays "
                        "in memory and a restarted run (EDDIS_MAX_RESTARTS) starts its function from the "
                        "beginning; wrap it, optimizer = eddis.DistributedOptimizer(optimizer), to resume "
                        "from the last commit", type(self).__name__)
        return None

    def persist_commit(self):
        folder = self._commit_folder()
        if folder is not None:
            self.checkpointing.checkpoint(folder, self.model, self.optimizer, **{COMMIT_ENTRY: self._current()})

    def restore_commit(self):
        folder = self._commit_folder()
        path = None if folder is None else latest_commit(folder)
        if path is None:
            return False
        start = self.checkpointing.resume(path, self.model, self.optimizer)
        self._set_values(start.extra[COMMIT_ENTRY])
        return True
