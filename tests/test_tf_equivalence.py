"""Equivalence (TensorFlow): N ranks, each on its share of every global batch, end
with the same weights as one process training on the whole global batch.

This file is also the worker (``mpirun -n N python tests/test_tf_equivalence.py``):
every rank trains each configuration with ``DistributedGradientTape`` (inside
``tf.function``, and once eagerly) or with ``model.fit`` + ``DistributedOptimizer``
(data from ``eddis.shard_batches``); rank 0 also trains a reference copy on the
whole global batch in-process. Every rank checks that its weights equal rank
0's; rank 0 reports the relative L2 error against the reference.

Stated tolerances after 20 SGD-momentum steps: fp32 1e-5; fp16 compression
5e-3; bf16 compression 5e-2 (8 mantissa bits); Keras mixed precision against a
single process under the same policy: mixed_float16 2e-2, mixed_bfloat16 1e-1
(the forward pass itself computes in 16 bits on a different batch split).
"""
import json
import sys

STEPS = 20
GLOBAL_BATCH = 24
TOLERANCE = {"none": 1e-5, "fp16": 5e-3, "bf16": 5e-2, "mixed_float16": 2e-2, "mixed_bfloat16": 1e-1}
# (api, mode, compression, model, weighted shares, precision policy)
CONFIGS = []
for _mode in ("allreduce", "sync"):
    CONFIGS += [("tape", _mode, "none", "mlp", False, "float32"),
                ("tape", _mode, "none", "cnn", False, "float32"),
                ("fit", _mode, "none", "mlp", False, "float32"),
                ("fit", _mode, "none", "mlp", True, "float32"),
                ("tape", _mode, "none", "mlp", True, "float32")]
CONFIGS += [("tape-eager", "allreduce", "none", "mlp", False, "float32"),
            ("tape", "allreduce", "fp16", "mlp", False, "float32"),
            ("tape", "allreduce", "bf16", "mlp", False, "float32"),
            ("fit", "allreduce", "fp16", "mlp", False, "float32"),
            ("fit", "allreduce", "none", "mlp", False, "mixed_float16"),
            ("fit", "allreduce", "none", "mlp", False, "mixed_bfloat16")]
# 4 ranks on 2 cores: the sync/fit/tape core and weighted shares only
CONFIGS_4 = [c for c in CONFIGS if c[0] in ("tape", "fit") and c[2] == "none" and c[3] == "mlp"
             and c[5] == "float32"]


def config_id(c):
    return "-".join(str(x) for x in c if x not in (False, "float32")).replace("True", "weighted")


def make_model(kind):
    import keras

    keras.utils.set_random_seed(0)
    if kind == "mlp":
        layers = [keras.Input((32,)), keras.layers.Dense(64, activation="tanh"),
                  keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(10)]
    else:
        layers = [keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
                  keras.layers.Conv2D(8, 3, padding="same", activation="relu"), keras.layers.Flatten(),
                  keras.layers.Dense(10)]
    # float32 logits even under mixed precision (the Keras guide's advice)
    layers.append(keras.layers.Activation("linear", dtype="float32"))
    return keras.Sequential(layers)


def data(kind):
    import numpy as np

    rng = np.random.default_rng(1000)
    shape = (STEPS * GLOBAL_BATCH, 32) if kind == "mlp" else (STEPS * GLOBAL_BATCH, 8, 8, 1)
    return rng.normal(size=shape).astype("float32"), rng.integers(0, 10, STEPS * GLOBAL_BATCH).astype("int64")


def flat_weights(model):
    import numpy as np

    return np.concatenate([np.asarray(w, dtype=np.float64).reshape(-1) for w in model.trainable_weights])


def train_tape(model, x, y, mode, compression, shard, eager):
    import keras
    import tensorflow as tf
    import eddis.tensorflow as eddis

    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    count = shard.stop - shard.start

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = eddis.DistributedGradientTape(tape, mode=mode, bucket_bytes=4096, sample_count=count,
                                             compression=getattr(eddis.Compression, compression))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step = step if eager else tf.function(step)
    for s in range(STEPS):
        sl = slice(s * GLOBAL_BATCH + shard.start, s * GLOBAL_BATCH + shard.stop)
        step(x[sl], y[sl])


def train_fit(model, x, y, mode, compression, weights):
    import keras
    import tensorflow as tf
    import eddis.tensorflow as eddis

    optimizer = eddis.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), mode=mode,
                                           bucket_bytes=4096,
                                           compression=getattr(eddis.Compression, compression))
    optimizer.set_sample_count(eddis.local_batch_size(GLOBAL_BATCH, weights))
    model.compile(optimizer=optimizer, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dataset = eddis.shard_batches(tf.data.Dataset.from_tensor_slices((x, y)), GLOBAL_BATCH, weights)
    model.fit(dataset, epochs=1, verbose=0, shuffle=False,
              callbacks=[eddis.callbacks.BroadcastGlobalVariablesCallback(0)])
    return optimizer


def train_reference(model, x, y, api):
    import keras
    import tensorflow as tf

    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if api == "fit":
        model.compile(optimizer=optimizer, loss=loss_fn, jit_compile=False)
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
        return

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for s in range(STEPS):
        step(x[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], y[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH])


def train_config(api, mode, compression, kind, weighted, policy):
    import keras
    import numpy as np
    import eddis.tensorflow as eddis
    from eddis.core import batch_slice

    keras.mixed_precision.set_global_policy(policy)
    try:
        rank, size = eddis.rank(), eddis.size()
        weights = [r + 1 for r in range(size)] if weighted else None
        x, y = data(kind)
        model = make_model(kind)
        if api != "fit":  # model.fit broadcasts through BroadcastGlobalVariablesCallback
            eddis.broadcast_variables(model.variables, root_rank=0)
        initial = [np.array(w) for w in model.get_weights()]
        reducer = None
        if api == "fit":
            reducer = train_fit(model, x, y, mode, compression, weights).reducer
        else:
            train_tape(model, x, y, mode, compression, batch_slice(GLOBAL_BATCH, rank, size, weights),
                       eager=api == "tape-eager")
        mine = flat_weights(model)
        root = eddis.broadcast(mine, root_rank=0).numpy()
        spread = float(eddis.allreduce(np.abs(mine - root).max(), op=eddis.Max))
        if rank != 0:
            return None
        reference = make_model(kind)
        reference.set_weights(initial)
        train_reference(reference, x, y, "fit" if api == "fit" else "tape")
        ref = flat_weights(reference)
        return {"config": list((api, mode, compression, kind, weighted, policy)), "ranks": size,
                "rel_error": float(np.linalg.norm(mine - ref) / np.linalg.norm(ref)),
                "rank_spread": spread, "moved": float(np.linalg.norm(ref - flat_weights_of(initial))),
                "buckets": None if reducer is None else reducer.num_buckets}
    finally:
        keras.mixed_precision.set_global_policy("float32")


def flat_weights_of(arrays):
    import numpy as np

    return np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays])


def worker():
    import eddis.tensorflow as eddis
    from eddis.core import available_modes

    eddis.init()
    modes = available_modes()
    for config in CONFIGS if eddis.size() <= 2 else CONFIGS_4:
        if config[1] not in modes:
            continue
        result = train_config(*config)
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
    eddis.shutdown()


if __name__ == "__main__":
    sys.exit(worker())

# ---------------------------------------------------------------------- tests
import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
          "TF_ENABLE_ONEDNN_OPTS": "0"}
_results = {}


def _run(run_mpi, ranks):
    if ranks not in _results:
        proc = run_mpi(ranks, [PYTHON, __file__], env=TF_ENV, timeout=420, check=True)
        found = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        _results[ranks] = {tuple(r["config"]): r for r in found}
    return _results[ranks]


@pytest.mark.timeout(480)
@pytest.mark.parametrize("config", [(2, c) for c in CONFIGS] + [(4, c) for c in CONFIGS_4],
                         ids=lambda rc: f"{rc[0]}ranks-{config_id(rc[1])}")
def test_matches_single_process_on_global_batch(run_mpi, config):
    from eddis.core import available_modes

    ranks, config = config
    # a mode missing from the build is a broken build, not a skip
    assert config[1] in available_modes(), f"mode {config[1]} is not built (available: {available_modes()})"
    results = _run(run_mpi, ranks)
    assert config in results, f"worker printed no result for {config}"
    r = results[config]
    assert r["rank_spread"] == 0.0, f"ranks ended with different weights: {r}"
    assert r["moved"] > 0.1, f"training did not move the weights: {r}"
    tolerance = TOLERANCE[config[5] if config[5] != "float32" else config[2]]
    assert r["rel_error"] < tolerance, r
    if config[0] == "fit" and config[2] == "none":
        assert r["buckets"] > 1, "the test model must span several buckets"
