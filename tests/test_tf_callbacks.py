"""Keras callbacks and tensor collectives on 2 real MPI ranks.

- MetricAverageCallback: the epoch's logs become the average of the ranks'
  values (what a callback before it saw), identical on every rank.
- LearningRateWarmupCallback: batch by batch from initial_lr / size to
  initial_lr over warmup_epochs, then left alone.
- BroadcastGlobalVariablesCallback: ranks built with different seeds start from
  rank 0's weights.
- broadcast_variables inside tf.function (Horovod's first_batch pattern),
  allreduce eagerly and in a graph, allgather.

This file is also the worker: ``mpirun -n 2 python tests/test_tf_callbacks.py``.
"""
import json
import sys


def worker():
    import keras
    import numpy as np
    import tensorflow as tf
    import eddis.tensorflow as eddis

    eddis.init()
    rank, size = eddis.rank(), eddis.size()
    out = {}

    keras.utils.set_random_seed(10 + rank)   # different initial weights on each rank
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    initial = [np.array(w) for w in model.get_weights()]
    rank0_initial = eddis.broadcast(initial[0], 0).numpy()
    initial_differs = eddis.allgather_object(bool(np.abs(rank0_initial - initial[0]).max() > 0))

    class Raw(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.raw, self.lrs = [], []

        def on_train_batch_begin(self, batch, logs=None):
            self.lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))

        def on_epoch_end(self, epoch, logs=None):
            self.raw.append(float(logs["loss"]))

    raw = Raw()
    rng = np.random.default_rng(rank)      # each rank its own data: losses differ
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    model.compile(optimizer=eddis.DistributedOptimizer(keras.optimizers.SGD(0.4), mode="allreduce"),
                  loss="mse", jit_compile=False)
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False, callbacks=[
        eddis.callbacks.BroadcastGlobalVariablesCallback(0),
        eddis.callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2),
        raw, eddis.callbacks.MetricAverageCallback()])
    out["raw"] = eddis.allgather_object(raw.raw)
    out["averaged"] = eddis.allgather_object([float(v) for v in history.history["loss"]])
    out["lrs"] = raw.lrs
    # after fit, every rank holds the same weights: they started from rank 0's
    final = np.concatenate([w.reshape(-1) for w in model.get_weights()])
    out["initial_differs"] = initial_differs
    out["final_equal"] = bool(np.array_equal(eddis.broadcast(final, 0).numpy(), final))

    # broadcast_variables inside tf.function, on the first batch only
    keras.utils.set_random_seed(20 + rank)
    m2 = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])

    @tf.function
    def first_step(first_batch):
        if first_batch:
            eddis.broadcast_variables(m2.variables, root_rank=0)
        return eddis.allreduce(tf.reduce_sum(m2.variables[0]), op=eddis.Sum)

    total = float(first_step(tf.constant(True)))
    kernel = m2.variables[0].numpy()
    out["graph_broadcast_equal"] = bool(np.array_equal(eddis.broadcast(kernel, 0).numpy(), kernel))
    out["graph_allreduce_sum"] = total / float(np.sum(kernel))
    out["allgather"] = eddis.allgather(tf.fill([rank + 1], float(rank))).numpy().tolist()
    out["eager_average"] = float(eddis.allreduce(tf.constant(float(rank))))
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    eddis.shutdown()


if __name__ == "__main__":
    sys.exit(worker())

# ---------------------------------------------------------------- tests
import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
          "EDDIS_COMM_TIMEOUT": "60"}
_result = {}


@pytest.fixture
def result(run_mpi):
    if not _result:
        proc = run_mpi(2, [PYTHON, __file__], env=TF_ENV, timeout=240, check=True)
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        assert line, proc.stdout + proc.stderr
        _result.update(json.loads(line[0][7:]))
    return _result


@pytest.mark.timeout(300)
def test_metric_average_callback(result):
    raw, averaged = result["raw"], result["averaged"]
    assert raw[0] != raw[1]                                  # the ranks saw different losses
    assert averaged[0] == averaged[1]                        # History holds one value everywhere
    np.testing.assert_allclose(averaged[0], np.mean(raw, axis=0), rtol=1e-6)


@pytest.mark.timeout(300)
def test_broadcast_callback_starts_every_rank_from_rank0(result):
    assert result["initial_differs"] == [False, True]
    assert result["final_equal"] is True


@pytest.mark.timeout(300)
def test_learning_rate_warmup(result):
    lrs = result["lrs"]                                      # 3 epochs of 4 batches, 2 ranks
    # Horovod's ramp: the batch being started counts as done, so the last warm-up batch runs
    # at 0.4; after the warm-up the rate is left where it ended
    expected = [0.4 / 2 * ((e + (b + 1) / 4) * (2 - 1) / 2 + 1) for e in range(2) for b in range(4)] + [0.4] * 4
    np.testing.assert_allclose(lrs, expected, rtol=1e-6)


@pytest.mark.timeout(300)
def test_collectives_in_graph_and_eager(result):
    assert result["graph_broadcast_equal"] is True
    assert result["graph_allreduce_sum"] == pytest.approx(2.0)
    assert result["allgather"] == [0.0, 1.0, 1.0]
    assert result["eager_average"] == 0.5


import numpy as np
