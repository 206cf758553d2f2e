"""PyTorch and TensorFlow in one environment: neither adapter imports the other
framework, and importing both (in either order) leaves both working, including
one EDDIS reduction through each adapter in the same process."""
import subprocess
import sys

import pytest
pytestmark = pytest.mark.slow  # a fresh interpreter per order, both frameworks imported

import tensorflow  # noqa: F401  (required: missing is a failure, not a skip)
import torch  # noqa: F401  (required: missing is a failure, not a skip)

CODE = r'''
import sys
first, second = sys.argv[1:3]
import importlib
a = importlib.import_module(f"eddis.{first}")
other = {"torch": "tensorflow", "tensorflow": "torch"}[first]
assert other not in sys.modules, f"eddis.{first} imported {other}"
b = importlib.import_module(f"eddis.{second}")
import numpy as np, tensorflow as tf, torch, keras
import eddis.tensorflow as etf, eddis.torch as eth
etf.init()
# one step through each adapter, same runtime
m = torch.nn.Linear(4, 2)
opt = eth.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
m(torch.ones(3, 4)).sum().backward()
opt.step()
k = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(k(np.ones((3, 4), "float32")))
g = etf.DistributedGradientTape(tape).gradient(loss, k.trainable_variables)
assert g[0].shape == (4, 2)
assert float(etf.allreduce(tf.constant(2.0))) == 2.0 and float(eth.allreduce(torch.tensor(2.0))) == 2.0
print("OK", torch.__version__, tf.__version__, flush=True)
etf.shutdown()
'''


@pytest.mark.timeout(240)
@pytest.mark.parametrize("order", [("tensorflow", "torch"), ("torch", "tensorflow")], ids="-then-".join)
def test_both_frameworks_in_one_process(order):
    from conftest import python_env

    env = python_env({"TF_CPP_MIN_LOG_LEVEL": "3", "TF_NUM_INTRAOP_THREADS": "1",
                      "TF_NUM_INTEROP_THREADS": "1", "EDDIS_MODE": "allreduce"})
    proc = subprocess.run([sys.executable, "-c", CODE, *order], env=env, capture_output=True, text=True,
                          timeout=220)
    assert proc.returncode == 0 and "OK" in proc.stdout, f"{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
