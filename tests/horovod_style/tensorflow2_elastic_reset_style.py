"""The logic of Horovod's TF2 elastic example (examples/elastic/tensorflow2/
tensorflow2_mnist_elastic.py), written anew with ``import eddis.tensorflow as hvd``: a
``tf.function`` step whose ``allreduce`` flag wraps the tape in a ``DistributedGradientTape``,
one local step before ``@hvd.elastic.run`` to create the optimizer's variables, a loop that
skips the batches done, sets ``state.batch`` and commits after every step, a reset callback
that scales the learning rate with ``size()``, and a ``tf.train.Checkpoint`` saved by rank 0.
Its MNIST convolution network is a small dense classifier on synthetic data (no download,
2 cores), and its callback assigns ``opt.learning_rate`` (Keras 3 has no ``opt.lr``); under
Horovod that callback runs only after a reset, so a first start must not run it.
Usage: tensorflow2_elastic_reset_style.py CHECKPOINT_DIR

Test harness hooks (not Horovod's): the reset callbacks print what they did; with
ELASTIC_TEST_KILL_AFTER=B, rank 1 SIGKILLs itself right after the commit at batch B on the
launcher's first attempt, so that EDDIS_MAX_RESTARTS restarts the run from that commit."""
import os
import signal
import sys

import numpy as np
import tensorflow as tf
from tensorflow import keras

import eddis.tensorflow as hvd

checkpoint_dir = sys.argv[1]
kill_after = os.environ.get("ELASTIC_TEST_KILL_AFTER")
attempt = os.environ.get("EDDIS_RESTART_COUNT", "0")

hvd.init()
rng = np.random.default_rng(hvd.rank())
features = rng.normal(size=(2048, 16)).astype("float32")
labels = (features[:, :4].argmax(axis=1)).astype("int64")
dataset = tf.data.Dataset.from_tensor_slices((features, labels)).repeat().shuffle(512, seed=hvd.rank()).batch(32)

model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dropout(0.1),
                          keras.layers.Dense(4, activation="softmax")])
loss = keras.losses.SparseCategoricalCrossentropy()
base_lr = 0.001
opt = keras.optimizers.Adam(base_lr * hvd.size())


@tf.function
def training_step(x, y, allreduce=True):
    with tf.GradientTape() as tape:
        loss_value = loss(y, model(x, training=True))
    if allreduce:
        tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss_value, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss_value


for x, y in dataset.take(1):   # creates the optimizer's variables, which the state syncs
    training_step(x, y, allreduce=False)

resets = []


@hvd.elastic.run
def train(state):
    print(f"rank {hvd.rank()} attempt {attempt} starts at batch {state.batch} after resets {resets}", flush=True)
    start_batch = state.batch
    for batch_idx, (x, y) in enumerate(dataset.skip(state.batch).take(100 // hvd.size())):
        state.batch = start_batch + batch_idx
        loss_value = training_step(x, y)
        if state.batch % 10 == 0 and hvd.rank() == 0:
            print(f"Step #{state.batch}\tLoss: {float(loss_value):.6f}", flush=True)
        state.commit()
        if kill_after == str(state.batch) and hvd.rank() == 1 and attempt == "0":
            os.kill(os.getpid(), signal.SIGKILL)


def on_state_reset():
    opt.learning_rate.assign(base_lr * hvd.size())
    resets.append(f"on_state_reset(lr={float(opt.learning_rate.numpy()):g})")


def after_lr_scaled():
    resets.append("after_lr_scaled")


state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0)
state.register_reset_callbacks([on_state_reset, after_lr_scaled])
train(state)

checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)
if hvd.rank() == 0:
    checkpoint.save(os.path.join(checkpoint_dir, "ckpt"))
print(f"TF2 ELASTIC EXAMPLE OK rank {hvd.rank()} attempt {attempt} batch {state.batch} resets {resets}",
      flush=True)
