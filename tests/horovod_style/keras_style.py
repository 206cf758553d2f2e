"""A Horovod Keras script in the style of Horovod's documentation (model.fit, the callbacks,
load_model); only the import differs, and Keras 3's jit_compile=False replaces
experimental_run_tf_function=False."""
import os
import sys

import numpy as np
import tensorflow as tf
from tensorflow import keras

import eddis.tensorflow.keras as hvd

hvd.init()
assert not (hvd.nccl_built() or hvd.gloo_built() or hvd.ddl_built() or hvd.ccl_built() or hvd.rocm_built())
assert hvd.mpi_built() and hvd.mpi_enabled() and hvd.cuda_built() == tf.test.is_built_with_cuda()

rng = np.random.default_rng(hvd.rank())
x = rng.normal(size=(64, 8)).astype("float32")
y = x.sum(axis=1, keepdims=True)
keras.utils.set_random_seed(hvd.rank())
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
scaled_lr = 0.01 * hvd.size()
opt = keras.optimizers.SGD(scaled_lr)
opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.fp16)
model.compile(loss="mse", optimizer=opt, metrics=["mae"], jit_compile=False)

callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=1),
    hvd.callbacks.LearningRateScheduleCallback(initial_lr=scaled_lr, multiplier=0.1, start_epoch=3),
]
history = model.fit(x, y, batch_size=8, epochs=4, callbacks=callbacks, shuffle=False,
                    verbose=2 if hvd.rank() == 0 else 0)
assert np.isclose(float(np.asarray(model.optimizer.learning_rate)), scaled_lr * 0.1)
losses = hvd.allgather_object(history.history["loss"])
assert losses[0] == losses[-1], "MetricAverageCallback left the ranks' losses apart"

try:
    hvd.broadcast_global_variables(0)  # TF1 only: raises in TF2, as Horovod's does
except RuntimeError as exc:
    assert "broadcast_variables" in str(exc)
else:
    sys.exit("broadcast_global_variables(0) did not raise")

path = os.path.join(os.environ.get("EDDIS_RUN_DIR", "."), "keras_style.keras")
if hvd.rank() == 0:
    model.save(path)
hvd.barrier()
restored = hvd.load_model(path)
restored.fit(x, y, batch_size=8, epochs=1, verbose=0,
             callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
flat = np.concatenate([np.ravel(w) for w in restored.get_weights()])
assert np.array_equal(hvd.broadcast(flat, root_rank=0).numpy(), flat), "ranks' restored models differ"
print(f"HOROVOD-STYLE OK rank {hvd.rank()}", flush=True)
