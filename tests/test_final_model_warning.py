"""easgd/hybrid: a script that trains and never loads the centre variable
(``eddis.final_model``) evaluates and saves one worker's parameters, and nothing
else says so. eddis.shutdown() warns then, on rank 0, naming the cause and the fix;
a script that called final_model() gets no warning.

This file is also the worker: ``mpirun -n 2 python tests/test_final_model_warning.py
FRAMEWORK MODE CALL`` (FRAMEWORK torch or tensorflow, CALL final_model or none).
"""
import os
import sys

STEPS = 6


def train_torch(mode, call):
    import torch
    import torch.nn as nn
    import eddis.torch as eddis

    eddis.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), mode=mode)
    eddis.broadcast_parameters(model.state_dict(), root_rank=0)
    generator = torch.Generator().manual_seed(eddis.rank())
    for _ in range(STEPS):
        optimizer.zero_grad()
        x = torch.randn(16, 8, generator=generator)
        model(x).pow(2).mean().backward()
        optimizer.step()
    if call == "final_model":
        eddis.final_model(optimizer)
    print(f"rank {eddis.rank()} trained {STEPS} steps", flush=True)


def train_tensorflow(mode, call):
    import keras
    import numpy as np
    import tensorflow as tf
    import eddis.tensorflow as eddis

    eddis.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(2)])
    optimizer = eddis.DistributedOptimizer(keras.optimizers.SGD(0.1), mode=mode)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    rng = np.random.default_rng(eddis.rank())
    data = tf.data.Dataset.from_tensor_slices((rng.normal(size=(16 * STEPS, 8)).astype("float32"),
                                               rng.normal(size=(16 * STEPS, 2)).astype("float32"))).batch(16)
    model.fit(data, epochs=1, verbose=0, callbacks=[eddis.callbacks.BroadcastGlobalVariablesCallback(0)])
    if call == "final_model":
        eddis.final_model(optimizer)
    print(f"rank {eddis.rank()} trained {STEPS} steps", flush=True)


if __name__ == "__main__":
    framework, mode, call = sys.argv[1:4]
    if mode == "hybrid":   # one group per rank, as the launcher sets them for hetjob components
        os.environ["EDDIS_GROUP"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["EDDIS_NUM_GROUPS"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    (train_torch if framework == "torch" else train_tensorflow)(mode, call)
    sys.exit(0)

import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402

HERE = os.path.abspath(__file__)
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
          "TF_ENABLE_ONEDNN_OPTS": "0"}
FIX = "Call eddis.final_model(optimizer)"


def _run(run_mpi, framework, mode, call, env=None):
    env = dict(TF_ENV if framework == "tensorflow" else {}, EDDIS_COMM_TIMEOUT="60", **(env or {}))
    proc = run_mpi(2, [PYTHON, HERE, framework, mode, call], env=env, timeout=240, check=True)
    assert proc.stdout.count(f"trained {STEPS} steps") == 2, proc.stdout
    return proc.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_shutdown_warns_once_when_easgd_never_loaded_the_centre(run_mpi, framework):
    stderr = _run(run_mpi, framework, "easgd", "none")
    assert stderr.count("FinalModelWarning") == 1, stderr   # rank 0 only
    assert "eddis.final_model() was never called" in stderr, stderr
    assert f"this rank trained {STEPS} step(s)" in stderr, stderr
    assert FIX in stderr, stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_no_warning_after_final_model(run_mpi, framework):
    stderr = _run(run_mpi, framework, "easgd", "final_model")
    assert "FinalModelWarning" not in stderr, stderr


@pytest.mark.timeout(300)
def test_hybrid_of_two_groups_warns_too(run_mpi):
    stderr = _run(run_mpi, "torch", "hybrid", "none")
    assert "FinalModelWarning" in stderr and FIX in stderr, stderr
