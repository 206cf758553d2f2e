"""Rank 0's progress line counts samples right without set_sample_count (the manual says
it need not be called): the torch optimizer takes the batch dimension of the model's
forward inputs. With set_sample_count the script's count wins; when nothing tells the
batch, the line counts steps and says "steps/s" rather than a wrong "samples/s".

Real ranks (mpirun -n 2), EDDIS_PROGRESS=log with a line per step; the test asserts the
line's count of samples (ranks x batch x passes x steps), never a time.

This file is also the worker: ``mpirun -n 2 python tests/test_progress_samples.py CASE``.
"""
import os
import re
import sys

STEPS = 5
BATCH = 8
RANKS = 2


class ListModel:
    """Builds a model whose forward takes a list of tensors: no batch dimension to see."""

    @staticmethod
    def make():
        import torch.nn as nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = nn.Linear(6, 3)

            def forward(self, parts):
                return self.linear(parts[0])

        return Net()


def main_keras(case):
    import keras
    import numpy as np
    import tensorflow as tf
    import eddis.tensorflow as eddis

    eddis.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    optimizer = eddis.DistributedOptimizer(keras.optimizers.SGD(0.1))
    if case == "keras_set_sample_count":
        optimizer.set_sample_count(3)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    rng = np.random.default_rng(eddis.rank())
    data = tf.data.Dataset.from_tensor_slices((rng.normal(size=(BATCH * STEPS, 6)).astype("float32"),
                                               rng.normal(size=(BATCH * STEPS, 3)).astype("float32")))
    model.fit(data.batch(BATCH), epochs=1, verbose=0,
              callbacks=[eddis.callbacks.BroadcastGlobalVariablesCallback(0)])
    eddis.shutdown()


def main(case):
    if case.startswith("keras"):
        return main_keras(case)
    import torch
    import torch.nn as nn
    import eddis.torch as eddis

    eddis.init()
    torch.manual_seed(0)
    model = ListModel.make() if case == "list_input" else nn.Sequential(nn.Linear(6, 4), nn.ReLU(),
                                                                          nn.Linear(4, 3))
    passes = 2 if case == "accumulation" else 1
    optimizer = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           backward_passes_per_step=passes)
    loss_fn = nn.CrossEntropyLoss()   # a module without parameters, called outside the model
    if case == "set_sample_count":
        optimizer.set_sample_count(3)
    for _ in range(STEPS):
        optimizer.zero_grad()
        for _ in range(passes):
            x, y = torch.randn(BATCH, 6), torch.randint(0, 3, (BATCH,))
            out = model([x]) if case == "list_input" else model(x)
            loss_fn(out, y).backward()
        with torch.no_grad():
            model([x]) if case == "list_input" else model(torch.randn(100, 6))  # evaluation: not counted
        optimizer.step()
    eddis.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.exit(0)

import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402

HERE = os.path.abspath(__file__)


TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
          "TF_ENABLE_ONEDNN_OPTS": "0"}


def progress_lines(run_mpi, case):
    proc = run_mpi(RANKS, [PYTHON, HERE, case], timeout=180, check=True,
                   env={"EDDIS_PROGRESS": "log", "EDDIS_PROGRESS_INTERVAL": "0", **TF_ENV})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[eddis] train step")]
    assert lines, proc.stdout + proc.stderr
    assert re.search(rf"step {STEPS}\b", lines[-1]), lines
    return lines


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case, samples_per_rank_and_step", [
    ("batch_from_forward", BATCH),
    ("accumulation", 2 * BATCH),     # both backward passes of a step count
    ("set_sample_count", 3),         # the script's count wins over the batch seen
    ("keras_set_sample_count", 3),   # TensorFlow: the count the script gives
])
def test_progress_counts_the_samples_of_every_rank(run_mpi, case, samples_per_rank_and_step):
    lines = progress_lines(run_mpi, case)
    assert all(" samples/s " in line for line in lines), lines
    assert f"  {RANKS * samples_per_rank_and_step * STEPS} samples  " in lines[-1], lines
    # every line's count: ranks x samples x the steps so far
    for line in lines:
        steps = int(re.search(r"step (\d+)", line).group(1))
        count = int(re.search(r"  (\d+) samples  ", line).group(1))
        assert count == RANKS * samples_per_rank_and_step * steps, line


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["list_input", "keras"])   # keras: nothing tells the batch there
def test_progress_says_steps_when_no_batch_is_seen(run_mpi, case):
    lines = progress_lines(run_mpi, case)
    assert all(" steps/s " in line and "samples" not in line for line in lines), lines
