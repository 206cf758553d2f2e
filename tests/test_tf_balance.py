"""Balanced sync with Keras on 2 real MPI ranks, rank 1 slowed 3x
(EDDIS_SIMULATE_SLOWDOWN, the testing aid): ``DistributedOptimizer(balance=True)``
with ``eddis.balanced_batches`` moves the shares of the global batch towards the
faster rank during ``model.fit``, and the weights still end equal to one process
training on the whole global batches (relative error below 1e-5, fp32): the
math of plain sync at the speed of the sum of the ranks.

This file is also the worker: ``mpirun -n 2 python tests/test_tf_balance.py``.
"""
import json
import os
import sys

STEPS = 30
GLOBAL_BATCH = 24


def worker():
    os.environ.setdefault("EDDIS_BALANCE_WARMUP", "3")
    os.environ.setdefault("EDDIS_BALANCE_INTERVAL", "5")
    import keras
    import numpy as np
    import tensorflow as tf
    import eddis.tensorflow as eddis

    eddis.init()
    rank = eddis.rank()
    rng = np.random.default_rng(5)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, 16)).astype("float32")
    y = rng.integers(0, 4, STEPS * GLOBAL_BATCH)

    def make_model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="tanh"),
                                 keras.layers.Dense(4)])

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = make_model()
    initial = model.get_weights()
    optimizer = eddis.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), mode="sync",
                                           balance=True, bucket_bytes=4096)
    model.compile(optimizer=optimizer, loss=loss, jit_compile=False)
    data = eddis.balanced_batches(tf.data.Dataset.from_tensor_slices((x, y)), GLOBAL_BATCH, optimizer)
    sizes = []

    class Sizes(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            sizes.append(optimizer.hetero.sizes_for(batch, GLOBAL_BATCH)[rank])

    model.fit(data, epochs=1, verbose=0, shuffle=False,
              callbacks=[eddis.callbacks.BroadcastGlobalVariablesCallback(0), Sizes()])
    mine = np.concatenate([w.reshape(-1) for w in model.get_weights()]).astype(np.float64)
    spread = float(eddis.allreduce(np.abs(mine - eddis.broadcast(mine, 0).numpy()).max(), op=eddis.Max))
    shares = optimizer.hetero.balancer.shares.tolist()
    all_sizes = eddis.allgather_object(sizes)
    if rank == 0:
        reference = make_model()
        reference.set_weights(initial)
        reference.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss, jit_compile=False)
        reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        ref = np.concatenate([w.reshape(-1) for w in reference.get_weights()]).astype(np.float64)
        print("RESULT " + json.dumps({"rel_error": float(np.linalg.norm(mine - ref) / np.linalg.norm(ref)),
                                      "spread": spread, "shares": shares, "sizes": all_sizes}), flush=True)
    eddis.shutdown()


if __name__ == "__main__":
    sys.exit(worker())

# ---------------------------------------------------------------- tests
import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402


@pytest.mark.timeout(300)
def test_balanced_sync_follows_speed_and_keeps_the_global_batch_math(run_mpi):
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
           "EDDIS_SIMULATE_SLOWDOWN": "1:3.0", "EDDIS_COMM_TIMEOUT": "120"}
    proc = run_mpi(2, [PYTHON, __file__], env=env, timeout=280, check=True)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert line, proc.stdout + proc.stderr
    r = json.loads(line[0][7:])
    assert r["spread"] == 0.0, r
    assert r["rel_error"] < 1e-5, r
    assert r["shares"][0] > r["shares"][1], r          # the slowed rank got the smaller share
    for step in range(len(r["sizes"][0])):             # every global batch fully covered
        assert r["sizes"][0][step] + r["sizes"][1][step] == 24, r
    assert r["sizes"][0][-1] > r["sizes"][1][-1], r
