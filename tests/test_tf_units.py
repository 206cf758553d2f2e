"""eddis.tensorflow without MPI ranks: tf.data sharding by per-rank shares (explicit
rank/size), compression wire types, the warm-up schedule; then, in one
single-rank worker process, misuse errors, mixed precision wrapping, saving a
model compiled with a DistributedOptimizer, and one rank training exactly like
plain Keras."""
import json
import subprocess
import sys

import numpy as np
import pytest

import tensorflow as tf

from eddis.core import batch_slice  # noqa: E402
from eddis.errors import ConfigError  # noqa: E402
from eddis.tensorflow import callbacks, data  # noqa: E402
from eddis.tensorflow.compression import Compression, codec_of  # noqa: E402


def elements(dataset):
    return [int(x) for x in dataset.as_numpy_iterator()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("weights", [None, [1, 2, 3]])
def test_shard_gives_disjoint_shares_proportional_to_weights(weights):
    dataset = tf.data.Dataset.range(200)
    block = 3 if weights is None else 60
    parts = [elements(data.shard(dataset, weights, block_size=block, rank=r, size=3)) for r in range(3)]
    used = (200 // block) * block
    assert sorted(sum(parts, [])) == list(range(used))          # disjoint, nothing lost but the tail
    expected = [used // 3] * 3 if weights is None else [used * w // 6 for w in weights]
    assert [len(p) for p in parts] == expected
    for r in range(3):  # the assert_cardinality promise holds
        shard = data.shard(dataset, weights, block_size=block, rank=r, size=3)
        assert int(shard.cardinality()) == len(parts[r])


@pytest.mark.timeout(120)
def test_shard_batches_cuts_each_global_batch_like_the_core():
    weights, global_batch = [1, 2, 3], 12
    dataset = tf.data.Dataset.from_tensor_slices((np.arange(50), -np.arange(50)))
    for r in range(3):
        part = batch_slice(global_batch, r, 3, weights)
        batches = list(data.shard_batches(dataset, global_batch, weights, rank=r, size=3).as_numpy_iterator())
        assert len(batches) == 50 // global_batch                     # same number of steps everywhere
        for step, (x, y) in enumerate(batches):
            np.testing.assert_array_equal(x, np.arange(step * 12, step * 12 + 12)[part])
            np.testing.assert_array_equal(y, -x)
        assert data.local_batch_size(global_batch, weights, rank=r, size=3) == part.stop - part.start


@pytest.mark.timeout(60)
def test_shard_rejects_what_cannot_be_shared():
    with pytest.raises(ConfigError, match="smaller than the number of ranks"):
        data.shard(tf.data.Dataset.range(10), block_size=2, rank=0, size=3)
    with pytest.raises(ConfigError, match="fewer than one block"):
        data.shard(tf.data.Dataset.range(10), block_size=20, rank=0, size=2)
    with pytest.raises(ConfigError, match="gets no element"):
        data.shard(tf.data.Dataset.range(100), [0, 1], block_size=10, rank=0, size=2)
    with pytest.raises(ConfigError, match="tf.data.Dataset"):
        data.shard([1, 2, 3], rank=0, size=1)


@pytest.mark.timeout(60)
def test_compression_members_and_wire_types():
    x = tf.constant([1.0, 2.5, -3.0])
    for member, wire in ((Compression.fp16, tf.float16), (Compression.bf16, tf.bfloat16)):
        compressed, ctx = member.compress(x)
        assert compressed.dtype == wire
        np.testing.assert_array_equal(member.decompress(compressed, ctx).numpy(), x.numpy())
    assert Compression.none.compress(x)[0] is x
    assert [codec_of(c).name for c in (Compression.none, Compression.fp16, Compression.bf16, "bf16")] == \
        ["none", "fp16", "bf16", "bf16"]
    with pytest.raises(ConfigError, match="none, fp16, bf16"):
        codec_of("int8")


@pytest.mark.timeout(60)
def test_warmup_schedule_ramps_from_lr_over_size_to_lr():
    cb = callbacks.LearningRateWarmupCallback(0.8, warmup_epochs=4)
    assert cb.ramp(0, size=4) == pytest.approx(0.25)
    assert cb.ramp(2, size=4) == pytest.approx(0.25 * (2 * 3 / 4 + 1))
    assert cb.ramp(4, size=4) == 1.0
    assert cb.ramp(0, size=1) == 1.0
    assert cb.end_epoch == 4 and cb.staircase is False
    with pytest.raises(ConfigError, match="momentum_correction"):
        callbacks.LearningRateWarmupCallback(0.1, momentum_correction=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("initial_epoch", [0, 3])
def test_keras_elastic_callbacks_count_across_restarts_and_commit_in_order(initial_epoch):
    """Horovod's callbacks for model.fit, driven as fit drives them: a run restarted after 3
    epochs, fit either numbering its epochs from 0 (epochs=total - state.epoch) or from
    initial_epoch=3; every 2 batches and each epoch's end a commit of the values after it."""
    from eddis.core.checkpoint.elastic_state import ObjectState
    from eddis.tensorflow.keras import elastic

    class Recorded(ObjectState):
        def commit(self):
            self.commits = getattr(self, "commits", []) + [(self.epoch, self.batch)]
            super().commit()

    state = Recorded(epoch=3, batch=0)
    listed = [elastic.UpdateEpochStateCallback(state), elastic.UpdateBatchStateCallback(state),
              elastic.CommitStateCallback(state, batches_per_commit=2)]
    for cb in listed:
        cb.on_train_begin()
    for epoch in range(initial_epoch, initial_epoch + 2):
        for cb in listed:
            cb.on_epoch_begin(epoch)
        for batch in range(3):
            for cb in listed:
                cb.on_train_batch_end(batch)
        for cb in listed:
            cb.on_epoch_end(epoch)
    assert (state.epoch, state.batch) == (5, 0)
    # the batch count restarts at each fit's start and each epoch's end: batch 2 of 3, the end
    assert state.commits == [(3, 2), (4, 0), (4, 2), (5, 0)]
    # fit's epochs of 4 steps: batch 4's commit would write the step the epoch's end writes again
    state.commits = []
    committing = elastic.CommitStateCallback(state, batches_per_commit=2)
    committing.set_params({"steps": 4})
    committing.on_train_begin()
    for batch in range(4):
        state.batch = batch + 1
        committing.on_train_batch_end(batch)
    state.batch = 0
    committing.on_epoch_end(5)
    assert state.commits == [(5, 2), (5, 0)]
    for bad in (0, 1.5, True, "4"):
        with pytest.raises(ConfigError, match="whole number of batches"):
            elastic.CommitStateCallback(state, batches_per_commit=bad)


# ---------------------------------------------------------------- one single-rank process
WORKER = r'''
import json, os, sys, tempfile
import numpy as np, keras, tensorflow as tf
import eddis.tensorflow as eddis
from eddis.errors import EddisError
results = {}

def case(name):
    def run(fn):
        try:
            fn()
            results[name] = ["ok", ""]
        except EddisError as exc:
            results[name] = [type(exc).__name__, str(exc)]
    return run

def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])

@case("no_init")
def _():
    eddis.DistributedOptimizer(keras.optimizers.SGD(0.1))

eddis.init()

@case("string_optimizer")
def _():
    eddis.DistributedOptimizer("sgd")

@case("model_as_optimizer")
def _():
    eddis.DistributedOptimizer(model())

@case("wrapped_twice")
def _():
    eddis.DistributedOptimizer(eddis.DistributedOptimizer(keras.optimizers.SGD(0.1)))

@case("backward_passes")
def _():
    eddis.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)

@case("tape_easgd")
def _():
    with tf.GradientTape() as tape:
        pass
    eddis.DistributedGradientTape(tape, mode="easgd")

@case("tape_not_a_tape")
def _():
    eddis.DistributedGradientTape(object())

@case("unknown_mode")
def _():
    m = model()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(m(np.ones((2, 4), "float32")))
    eddis.DistributedGradientTape(tape, mode="gossip").gradient(loss, m.trainable_variables)

@case("adasum_easgd")
def _():
    eddis.DistributedOptimizer(keras.optimizers.SGD(0.1), op=eddis.Adasum, mode="easgd")

@case("adasum_sample_count")
def _():
    eddis.DistributedGradientTape(tf.GradientTape(), op=eddis.Adasum, sample_count=4)

@case("mixed_float16_wraps_loss_scale")
def _():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        opt = eddis.DistributedOptimizer(keras.optimizers.SGD(0.1))
        assert isinstance(opt, keras.optimizers.LossScaleOptimizer), type(opt)
        m = model()
        m.compile(optimizer=opt, loss="mse", jit_compile=False)
        assert m.optimizer is opt   # compile keeps it: no second LossScaleOptimizer around it
        x = np.ones((8, 4), "float32")
        m.fit(x, np.zeros((8, 3), "float32"), batch_size=4, verbose=0)
        assert int(opt.iterations.numpy()) == 2
    finally:
        keras.mixed_precision.set_global_policy("float32")

@case("save_and_load")
def _():
    m = model()
    m.compile(optimizer=eddis.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse",
              jit_compile=False)
    m.fit(np.ones((8, 4), "float32"), np.zeros((8, 3), "float32"), batch_size=4, verbose=0)
    path = os.path.join(tempfile.mkdtemp(), "m.keras")
    eddis.save_model(path, m)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is keras.optimizers.Adam, type(loaded.optimizer)
    for a, b in zip(loaded.get_weights(), m.get_weights()):
        np.testing.assert_array_equal(a, b)

@case("one_rank_matches_plain_keras")
def _():
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, 32)
    runs = []
    for wrap in (False, True):
        m = model()
        opt = keras.optimizers.SGD(0.1, momentum=0.9)
        m.compile(optimizer=eddis.DistributedOptimizer(opt) if wrap else opt, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        runs.append(m.get_weights())
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)

@case("xla_switched_off_by_callback")
def _():
    import warnings
    m = model()
    m.compile(optimizer=eddis.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
    assert m.jit_compile is True
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m.fit(np.ones((8, 4), "float32"), np.zeros((8, 3), "float32"), batch_size=4, verbose=0,
              callbacks=[eddis.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert m.jit_compile is False
    assert any("jit_compile=False" in str(w.message) for w in seen)

@case("keras_load_model_wraps_the_optimizer")
def _():
    import eddis.tensorflow.keras as hvd
    m = model()
    m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse", jit_compile=False)
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 3), "float32")
    m.fit(x, y, batch_size=4, verbose=0)
    path = os.path.join(tempfile.mkdtemp(), "m.keras")
    hvd.save_model(path, m)
    loaded = hvd.load_model(path)
    assert type(loaded.optimizer).__name__ == "Adam" and hasattr(loaded.optimizer, "_eddis"), type(loaded.optimizer)
    assert int(loaded.optimizer.iterations.numpy()) == 2    # the file's optimizer state goes on
    loaded.fit(x, y, batch_size=4, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == 4
    assert loaded.optimizer.reducer is not None             # the steps went through EDDIS

@case("optimizer_variables_call_and_property")
def _():
    m = model()
    opt = eddis.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    opt.build(m.trainable_variables)
    assert [id(v) for v in opt.variables()] == [id(v) for v in opt.variables]
    eddis.broadcast_variables(opt.variables(), root_rank=0)   # Horovod's TF2 examples
    eddis.broadcast_variables(opt.variables, root_rank=0)     # Keras 3

@case("broadcast_global_variables")
def _():
    import eddis.tensorflow.keras as hvd
    hvd.broadcast_global_variables(0)

@case("learning_rate_schedule_callback")
def _():
    import eddis.tensorflow.keras as hvd
    lrs = []
    class Seen(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))
    m = model()
    m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=False)
    schedules = [hvd.callbacks.LearningRateScheduleCallback(0.8, lambda epoch: 0.5 ** epoch, start_epoch=1,
                                                            end_epoch=3),
                 hvd.callbacks.LearningRateScheduleCallback(0.8, 0.01, start_epoch=3)]
    m.fit(np.ones((8, 4), "float32"), np.zeros((8, 3), "float32"), batch_size=4, epochs=4, verbose=0,
          shuffle=False, callbacks=[*schedules, Seen()])
    expected = [0.1, 0.1, 0.4, 0.4, 0.2, 0.2, 0.008, 0.008]
    assert np.allclose(lrs, expected), lrs

print("RESULTS " + json.dumps(results), flush=True)
eddis.shutdown()
'''

EXPECTED = {
    "no_init": ("UsageError", "call eddis.init() first"),
    "string_optimizer": ("ConfigError", "create the optimizer"),
    "model_as_optimizer": ("ConfigError", "you passed the model"),
    "wrapped_twice": ("UsageError", "already a DistributedOptimizer"),
    "backward_passes": ("ConfigError", "gradient_accumulation_steps"),
    "tape_easgd": ("ConfigError", "wrap the optimizer instead"),
    "tape_not_a_tape": ("ConfigError", "needs a tf.GradientTape"),
    "unknown_mode": ("ConfigError", "unknown mode 'gossip'"),
    "adasum_easgd": ("ConfigError", "averages models elastically"),
    "adasum_sample_count": ("ConfigError", "not as a weighted mean"),
    "mixed_float16_wraps_loss_scale": ("ok", ""),
    "save_and_load": ("ok", ""),
    "one_rank_matches_plain_keras": ("ok", ""),
    "xla_switched_off_by_callback": ("ok", ""),
    "keras_load_model_wraps_the_optimizer": ("ok", ""),
    "optimizer_variables_call_and_property": ("ok", ""),
    "broadcast_global_variables": ("UsageError", "eddis.broadcast_variables(model.variables, root_rank=0)"),
    "learning_rate_schedule_callback": ("ok", ""),
}
_worker = {}


def worker_results():
    if not _worker:
        from conftest import python_env

        env = python_env({"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1",
                          "TF_NUM_INTEROP_THREADS": "1", "EDDIS_MODE": "allreduce"})
        proc = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True,
                              timeout=240)
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULTS ")]
        assert line, f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        _worker.update(json.loads(line[0][8:]))
    return _worker


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_single_rank_case(name):
    kind, text = worker_results()[name]
    assert kind == EXPECTED[name][0], (name, kind, text)
    assert EXPECTED[name][1] in text, (name, text)
