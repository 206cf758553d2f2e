"""Horovod's ``horovod.tensorflow.keras.elastic``: elastic ``model.fit`` with ``import
eddis.tensorflow.keras as hvd``::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=100)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(dataset, steps_per_epoch=n, epochs=epochs - state.epoch, callbacks=callbacks)

    train(state)

``run``, the states and what a commit is (in ``sync``, restarted after a lost rank, also a
checkpoint the restarted ``run`` continues from) are :mod:`eddis.tensorflow.elastic`'s. The
callbacks keep the state's ``epoch`` (epochs done, across restarts) and ``batch`` (batches of
the current epoch done) and commit every ``batches_per_commit`` batches and at each epoch's
end; list them in that order, so a commit holds the values after the batch or epoch it ends.

Keras runs each epoch of ``fit`` from its first step: a run restarted from a commit in the
middle of an epoch trains that epoch from its start again (as under Horovod). A restart from
an epoch's end commit continues exactly where the run was.
"""
import keras

from ...errors import ConfigError
from ..elastic import ObjectState, State, TensorFlowKerasState, run


class KerasState(TensorFlowKerasState):
    """Horovod's ``KerasState``: a compiled Keras model, its optimizer (default: the one it was
    compiled with) and plain values such as ``epoch`` and ``batch``."""


class CommitStateCallback(keras.callbacks.Callback):
    """``state.commit()`` after every ``batches_per_commit`` batches and at each epoch's end."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) \
                or batches_per_commit < 1:
            raise ConfigError(f"CommitStateCallback(batches_per_commit={batches_per_commit!r}): give a whole "
                              "number of batches of at least 1")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_left = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_left = self.batches_per_commit   # the same on every rank after a restart

    def on_train_batch_end(self, batch, logs=None):
        self.batches_left -= 1
        if self.batches_left == 0:
            # the epoch's last batch: the epoch-end commit follows at the same step, and a commit
            # in sync is a checkpoint of the run, which would be written twice
            if (self.params or {}).get("steps") != batch + 1:
                self.state.commit()
            self.batches_left = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()
        self.batches_left = self.batches_per_commit


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` at the batches of the current epoch done (0 at an epoch's end)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` at the epochs done, counted across restarts: Keras numbers the
    epochs of each ``fit`` from its ``initial_epoch``, the state from the run's start."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.epochs_before = state.epoch
        self.first_fit_epoch = None

    def on_train_begin(self, logs=None):
        self.epochs_before = self.state.epoch
        self.first_fit_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.first_fit_epoch is None:
            self.first_fit_epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.epochs_before + (epoch - self.first_fit_epoch) + 1


__all__ = ["run", "State", "ObjectState", "TensorFlowKerasState", "KerasState", "CommitStateCallback",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback"]
