"""A Horovod elastic TensorFlow script in the style of Horovod's elastic documentation
(a GradientTape loop inside @hvd.elastic.run, TensorFlowKerasState, commits per batch);
only the import differs. Prints HOROVOD-STYLE ELASTIC OK rank R."""
import numpy as np
import tensorflow as tf
from tensorflow import keras

import eddis.tensorflow as hvd

EPOCHS, BATCHES = 2, 6

hvd.init()
keras.utils.set_random_seed(hvd.rank())   # different on purpose: sync() must make them equal
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(0.05)
optimizer.build(model.trainable_variables)
rng = np.random.default_rng(hvd.rank())


@hvd.elastic.run
def train(state):
    weights = hvd.allgather_object(float(np.sum(model.get_weights()[0])))
    assert len(set(weights)) == 1, f"state.sync() left the ranks' models apart: {weights}"
    for state.epoch in range(state.epoch, EPOCHS):
        for state.batch in range(state.batch, BATCHES):
            x = rng.normal(size=(8, 4)).astype("float32")
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - x.sum(axis=1, keepdims=True)) ** 2)
            tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            state.commit()
        state.batch = 0


state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)
train(state)
committed = [w.copy() for w in model.get_weights()]
model.set_weights([w + 1.0 for w in committed])
state.epoch = 99
state.restore()
assert state.epoch == EPOCHS - 1 and state.batch == BATCHES - 1, (state.epoch, state.batch)
assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), committed))
print(f"HOROVOD-STYLE ELASTIC OK rank {hvd.rank()}")
