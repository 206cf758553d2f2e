"""What SMB takes as a buffer, without the framework adapters: numpy, DLPack, the buffer protocol."""
import subprocess

from conftest import PYTHON, python_env

# In a fresh interpreter: the smb layer alone, with eddis.torch (which registers its
# converter) never imported.
SMB_ONLY = r"""
import sys
import numpy as np
import torch
from eddis.errors import SMBValueError
from eddis.smb.pool import as_array

assert "eddis.torch" not in sys.modules and "eddis.core" not in sys.modules
t = torch.arange(6, dtype=torch.float32)
a = as_array(t, "float32", writable=True)
a[0] = 42.0  # a view: the tensor sees it
assert t[0].item() == 42.0 and a.dtype == np.float32
assert as_array(memoryview(bytearray(8)), "float32", writable=True).dtype == np.float32
for bad, words in ((torch.zeros(4, dtype=torch.bfloat16), "bfloat16"),
                   (torch.zeros(4, 4).t(), "contiguous"),
                   (object(), "does not expose a buffer")):
    try:
        as_array(bad, "bfloat16" if words == "bfloat16" else "float32", writable=False)
    except SMBValueError as exc:
        assert words in str(exc), exc
    else:
        raise AssertionError(f"{bad!r} was accepted")
print("ok")
"""

WITH_ADAPTER = r"""
import numpy as np
import torch
import eddis.torch  # noqa: F401
from eddis.smb.pool import as_array

t = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
a = as_array(t, "bfloat16", writable=True)
assert a.nbytes == 8 and a.__array_interface__["data"][0] == t.data_ptr()
print("ok")
"""


def test_smb_views_dlpack_and_buffers_without_any_framework_adapter():
    proc = subprocess.run([PYTHON, "-c", SMB_ONLY], env=python_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_torch_adapter_views_bfloat16_and_grad_tensors():
    proc = subprocess.run([PYTHON, "-c", WITH_ADAPTER], env=python_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


class CudaInterface:
    """What a CUDA array hands over (__cuda_array_interface__, v3); the pool only reads it."""

    def __init__(self, typestr, shape, strides=None, address=0x7f0000000000, readonly=False):
        self.__cuda_array_interface__ = {"data": (address, readonly), "typestr": typestr, "shape": shape,
                                         "strides": strides, "version": 3}


def test_gpu_buffers_are_read_from_the_cuda_array_interface():
    import numpy as np
    import pytest

    from eddis.errors import SMBValueError
    from eddis.smb.pool import device_view

    assert device_view(np.zeros(3, np.float32), "float32", False) is None
    assert device_view(memoryview(bytearray(8)), "float32", False) is None
    assert device_view(CudaInterface("<f4", (4, 5)), "float32", True) == (0x7f0000000000, 20)
    assert device_view(CudaInterface("<f4", (4, 5), strides=(20, 4)), "float32", False)[1] == 20
    assert device_view(CudaInterface("|u1", (16,)), "float32", False)[1] == 4        # raw bytes
    assert device_view(CudaInterface("<i2", (6,)), "bfloat16", False)[1] == 6        # bfloat16 bits
    for bad, words in ((CudaInterface("<f4", (4, 5), strides=(4, 16)), "not C-contiguous"),
                       (CudaInterface("<f8", (3,)), "GPU buffer is float64"),
                       (CudaInterface("|u1", (6,)), "not a whole number"),
                       (CudaInterface("<f4", (3,), readonly=True), "read-only")):
        with pytest.raises(SMBValueError, match=words):
            device_view(bad, "float32", True)
