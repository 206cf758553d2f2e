"""One basics object behind both adapters: the same calls, the same rules (no drift)."""
import subprocess

import pytest

from conftest import PYTHON, python_env

SHARED = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "group",
          "num_groups", "hostname", "cross_rank", "cross_size", "mpi_threads_supported",
          "broadcast_object", "allgather_object", "barrier", "configure_progress", "should_stop",
          "global_step", "progress_counts", "reset_progress", "mpi_built", "mpi_enabled", "gloo_built",
          "gloo_enabled", "nccl_built", "rocm_built", "ddl_built", "ccl_built", "split_sizes",
          "batch_slice", "join", "request_checkpoint"]

BOTH = r"""
import eddis.tensorflow as tfe
import eddis.tensorflow.keras as kerase
import eddis.torch as pte
from eddis.core.basics import basics

shared = %r
for name in shared:
    a, b, c = getattr(pte, name), getattr(tfe, name), getattr(kerase, name)
    assert a == b == c, (name, a, b, c)
    assert a == getattr(basics, name), name
assert kerase.cuda_built is tfe.cuda_built
print("ok")
"""

BUILT = r"""
import sys
import tensorflow as tf
import torch
import eddis.tensorflow as tfe
import eddis.torch as pte

for adapter in (pte, tfe):
    for name in ("nccl_built", "gloo_built", "gloo_enabled", "rocm_built", "ddl_built", "ccl_built"):
        assert getattr(adapter, name)() is False, name
    assert adapter.mpi_built() is True          # this build has eddis._mpi and mpi4py
    assert adapter.mpi_enabled() is False       # not before init()
# a build property of the framework, not "this machine has a GPU"
assert pte.cuda_built() is (torch.version.cuda is not None)
assert tfe.cuda_built() is tf.test.is_built_with_cuda()
pte.init()
assert pte.mpi_enabled() is True and tfe.mpi_enabled() is True
pte.shutdown()
import eddis
del eddis._mpi                                  # neither MPI route importable
sys.modules["eddis._mpi"] = None
sys.modules["mpi4py"] = sys.modules["mpi4py.MPI"] = None
assert pte.mpi_built() is False and tfe.mpi_built() is False
print("ok")
"""


@pytest.mark.timeout(180)
def test_built_and_enabled_answer_for_eddis():
    proc = subprocess.run([PYTHON, "-c", BUILT], env=python_env({"TF_CPP_MIN_LOG_LEVEL": "3"}),
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.timeout(180)
def test_both_adapters_bind_the_same_basics():
    proc = subprocess.run([PYTHON, "-c", BOTH % SHARED], env=python_env({"TF_CPP_MIN_LOG_LEVEL": "3"}),
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


# One process (an MPI singleton): the rules every adapter's calls follow.
RULES = r"""
import os, tempfile
import numpy as np
import torch
import eddis.torch as pte
import eddis.tensorflow as tfe
import tensorflow as tf
from eddis.errors import CheckpointError, ConfigError, UsageError

pte.init()
for adapter, make in ((pte, lambda a: torch.tensor(a)), (tfe, lambda a: tf.constant(a))):
    # an integer average would round: refused the same way by both
    try:
        adapter.allreduce(make(np.arange(4, dtype=np.int64)))
    except ConfigError as exc:
        assert "integer" in str(exc), exc
    else:
        raise AssertionError(f"{adapter.__name__}: integer average accepted")
    out = adapter.allreduce(make(np.arange(4, dtype=np.int64)), op=adapter.Sum)
    assert list(np.asarray(out)) == [0, 1, 2, 3]
    # nothing was ever wrapped: final_model says so in both
    try:
        adapter.final_model()
    except UsageError as exc:
        assert "DistributedOptimizer" in str(exc), exc
    else:
        raise AssertionError(f"{adapter.__name__}: final_model() without an optimizer passed")

# rank 0's atomic save: a failing writer leaves no file, and every rank gets the error
from eddis.core.basics import basics
d = tempfile.mkdtemp()
target = os.path.join(d, "m.pt")
def write(tmp):
    open(tmp, "w").write("half")
    raise OSError("disk full")
try:
    basics.save_on_rank0(target, write, "save_checkpoint")
except CheckpointError as exc:
    assert "disk full" in str(exc) and isinstance(exc, OSError), exc
else:
    raise AssertionError("the failed save passed")
assert os.listdir(d) == [], os.listdir(d)
assert basics.save_on_rank0(target, lambda tmp: open(tmp, "w").write("x"), "save_checkpoint") == target
assert open(target).read() == "x" and os.listdir(d) == ["m.pt"]
pte.shutdown()
print("ok")
"""


@pytest.mark.timeout(240)
def test_the_shared_rules_hold_in_both_adapters(tmp_path):
    env = python_env({"TF_CPP_MIN_LOG_LEVEL": "3", "EDDIS_RUN_DIR": str(tmp_path / "run")})
    proc = subprocess.run([PYTHON, "-c", RULES], env=env, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]
