"""A Horovod TensorFlow 2 (GradientTape) script in the style of Horovod's documentation,
with Keras 3's opt.variables (the property); only the import differs."""
import numpy as np
import tensorflow as tf

import eddis.tensorflow as hvd

hvd.init()
gpus = tf.config.experimental.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus and hvd.cuda_built():
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")
assert not (hvd.nccl_built() or hvd.gloo_built() or hvd.ddl_built() or hvd.ccl_built() or hvd.rocm_built())
assert hvd.mpi_built() and hvd.mpi_enabled() and not hvd.gloo_enabled()

rng = np.random.default_rng(hvd.rank())
x = rng.normal(size=(64, 8)).astype("float32")
dataset = tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1, keepdims=True))).repeat().batch(8)
tf.random.set_seed(hvd.rank())  # different initial weights: the broadcast must fix them
model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="tanh"),
                             tf.keras.layers.Dense(1)])
loss_fn = tf.keras.losses.MeanSquaredError()
opt = tf.keras.optimizers.SGD(0.01 * hvd.size())


@tf.function
def training_step(images, labels, first_batch):
    with tf.GradientTape() as tape:
        loss_value = loss_fn(labels, model(images, training=True))
    tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.none, op=hvd.Average)
    grads = tape.gradient(loss_value, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    return loss_value


for batch, (images, labels) in enumerate(dataset.take(20 // hvd.size())):
    loss_value = training_step(images, labels, batch == 0)
    if batch % 5 == 0 and hvd.local_rank() == 0:
        print(f"Step #{batch}\tLoss: {float(loss_value):.6f}", flush=True)

flat = np.concatenate([np.ravel(w) for w in model.get_weights()])
assert np.array_equal(hvd.broadcast(flat, root_rank=0).numpy(), flat), "ranks' models differ"
assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum)) == hvd.size()
assert hvd.allgather(tf.constant([[float(hvd.rank())]])).numpy().ravel().tolist() == \
    [float(r) for r in range(hvd.size())]
assert hvd.allgather_object(hvd.rank()) == list(range(hvd.size()))
assert hvd.broadcast_object("root" if hvd.rank() == 0 else None, root_rank=0) == "root"
print(f"HOROVOD-STYLE OK rank {hvd.rank()}", flush=True)
