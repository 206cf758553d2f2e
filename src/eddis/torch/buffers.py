"""Torch tensors as SMB buffers: the converter :mod:`eddis.smb.pool` cannot have.

numpy imports CPU tensors through DLPack without a copy, except bfloat16 ones
(numpy has no bfloat16) and tensors that require grad (DLPack refuses them);
this converter views those too, still without a copy.
"""
import numpy as np
import torch

from ..errors import SMBValueError
from ..smb import pool


def _is_tensor(buf):
    return isinstance(buf, torch.Tensor)


def tensor_as_numpy(tensor, writable):
    if tensor.device.type != "cpu":
        raise SMBValueError(f"tensor on {tensor.device}: SMB transfers take CPU tensors; use .cpu()")
    if not tensor.is_contiguous():
        raise SMBValueError("tensor is not contiguous; call .contiguous() first")
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        bits = tensor.view(torch.int16).numpy()
        bf16 = pool.numpy_dtype("bfloat16")  # uint16 without ml_dtypes: the bits stay int16
        return bits if bf16 == np.uint16 else bits.view(bf16)
    return tensor.numpy()


pool.register_exporter(_is_tensor, tensor_as_numpy)
