"""A Horovod elastic TensorFlow/Keras script with only the import changed (``import
eddis.tensorflow as hvd``), run in mode sync with EDDIS_MAX_RESTARTS: a GradientTape loop
inside ``@hvd.elastic.run``, its state a ``TensorFlowKerasState``, with the Keras optimizer
wrapped in ``hvd.DistributedOptimizer`` (``optimizer``) or, as in Horovod's own TF2 elastic
example, a plain optimizer applying a ``hvd.DistributedGradientTape``'s gradients (``tape``).
A lost rank ends the trainers, the launcher starts them again, and ``hvd.elastic.run`` goes
on from the last ``state.commit()``, which in sync is a checkpoint of the run. A commit
records the batches of the epoch done, so a restarted run trains each batch exactly once.
Usage: tensorflow_elastic_sync_style.py OUT.npz {optimizer,tape}

Test harness hooks (not Horovod's): ELASTIC_TEST_KILL_AFTER=epoch:batch, rank 1 SIGKILLs
itself right after the commit at that point, on the launcher's first attempt; rank 0 writes
the weights it starts from on that attempt to OUT with ``-initial`` before ``.npz``, from
which the test replays the training in one process."""
import os
import signal
import sys

import numpy as np
import tensorflow as tf
from tensorflow import keras

import eddis.tensorflow as hvd

EPOCHS, BATCHES, COMMIT_EVERY = 2, 10, 4
out, reduce_by = sys.argv[1], sys.argv[2]
kill_after = os.environ.get("ELASTIC_TEST_KILL_AFTER")
attempt = os.environ.get("EDDIS_RESTART_COUNT", "0")

hvd.init()
keras.utils.set_random_seed(hvd.rank())   # different on purpose: sync() must make them equal
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
if reduce_by == "optimizer":
    optimizer = hvd.DistributedOptimizer(optimizer)
optimizer.build(model.trainable_variables)


def batch_of(epoch, batch):
    rng = np.random.default_rng(1000 * epoch + 10 * batch + hvd.rank())
    x = rng.normal(size=(16, 8)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


@hvd.elastic.run
def train(state):
    print(f"attempt {attempt} starts at epoch {state.epoch} batch {state.batch}", flush=True)
    if attempt == "0" and hvd.rank() == 0:
        np.savez(out.replace(".npz", "-initial.npz"), *model.get_weights())
    for state.epoch in range(state.epoch, EPOCHS):
        for batch in range(state.batch, BATCHES):
            x, y = batch_of(state.epoch, batch)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            if reduce_by == "tape":
                tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            state.batch = batch + 1
            if state.batch % COMMIT_EVERY == 0:
                state.commit()
                if kill_after == f"{state.epoch}:{state.batch}" and hvd.rank() == 1 and attempt == "0":
                    os.kill(os.getpid(), signal.SIGKILL)
        state.batch = 0
    state.commit()


train(hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0))
if hvd.rank() == 0:
    np.savez(out, *model.get_weights())
print(f"HOROVOD-STYLE ELASTIC SYNC OK rank {hvd.rank()}", flush=True)
