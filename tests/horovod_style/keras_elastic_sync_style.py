"""A Horovod elastic Keras script with only the import changed (``import
eddis.tensorflow.keras as hvd``), run in mode sync with EDDIS_MAX_RESTARTS: ``model.fit``
inside ``@hvd.elastic.run`` with Horovod's elastic callbacks, its state a ``KerasState``.
A lost rank ends the trainers, the launcher starts them again, and ``hvd.elastic.run`` goes
on from the last commit, a checkpoint of the run in sync: a restart from an epoch's end
commit trains each batch exactly once. Each epoch's batches are a function of (epoch, batch,
rank), so the run can be replayed in one process.
Usage: keras_elastic_sync_style.py OUT.npz

Test harness hooks (not Horovod's): ELASTIC_TEST_KILL_AFTER=epoch:batch, rank 1 SIGKILLs
itself right after the commit at that point, on the launcher's first attempt; rank 0 writes
the weights it starts from on that attempt to OUT with ``-initial`` before ``.npz``."""
import os
import signal
import sys

import numpy as np
import tensorflow as tf
from tensorflow import keras

import eddis.tensorflow.keras as hvd

EPOCHS, BATCHES, COMMIT_EVERY = 2, 10, 4
out = sys.argv[1]
kill_after = os.environ.get("ELASTIC_TEST_KILL_AFTER")
attempt = os.environ.get("EDDIS_RESTART_COUNT", "0")

hvd.init()
keras.utils.set_random_seed(hvd.rank())   # different on purpose: sync() must make them equal
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)),
              loss="mean_squared_error", jit_compile=False)
model.optimizer.build(model.trainable_variables)


def batch_of(epoch, batch):
    rng = np.random.default_rng(1000 * epoch + 10 * batch + hvd.rank())
    x = rng.normal(size=(16, 8)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def batches_from(first_epoch):
    """The batches of the epochs left, in order: fit reads on across its epochs."""
    pairs = [batch_of(e, b) for e in range(first_epoch, EPOCHS) for b in range(BATCHES)]
    return tf.data.Dataset.from_tensor_slices(tuple(np.stack(part) for part in zip(*pairs)))


class KillAfterCommit(keras.callbacks.Callback):
    """After CommitStateCallback in the list: the state is committed when this runs."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def _maybe_die(self):
        if kill_after == f"{self.state.epoch}:{self.state.batch}" and hvd.rank() == 1 and attempt == "0":
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, batch, logs=None):
        self._maybe_die()

    def on_epoch_end(self, epoch, logs=None):
        self._maybe_die()


state = hvd.elastic.KerasState(model, batch=0, epoch=0)
callbacks = [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
             hvd.elastic.CommitStateCallback(state, batches_per_commit=COMMIT_EVERY), KillAfterCommit(state)]


@hvd.elastic.run
def train(state):
    print(f"attempt {attempt} starts at epoch {state.epoch} batch {state.batch}", flush=True)
    if attempt == "0" and hvd.rank() == 0:
        np.savez(out.replace(".npz", "-initial.npz"), *model.get_weights())
    state.model.fit(batches_from(state.epoch), steps_per_epoch=BATCHES, epochs=EPOCHS - state.epoch,
                    callbacks=callbacks, verbose=0)


train(state)
print(f"trained epochs {state.epoch}", flush=True)
if hvd.rank() == 0:
    np.savez(out, *model.get_weights())
print(f"HOROVOD-STYLE ELASTIC SYNC OK rank {hvd.rank()}", flush=True)
