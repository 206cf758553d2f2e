"""Tensor collectives for metrics and set-up: allreduce, broadcast, allgather.

They run over MPI on the host (CUDA tensors are copied to the host and back);
they are meant for losses, accuracies and start-up synchronization, not for
gradients (the DistributedOptimizer handles those).
"""
import numpy as np
import torch

from ..core import collectives
from ..core.basics import basics as _basics
from ..core.ops import Adasum, Average, Max, Min, ReduceOp, Sum, resolve_op  # noqa: F401
from ..errors import ConfigError


def _to_numpy(tensor):
    t = tensor.detach()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16
        t = t.float()
    return np.ascontiguousarray(t.cpu().numpy())


def _from_numpy(array, like):
    return torch.from_numpy(array).to(device=like.device, dtype=like.dtype).reshape(like.shape)


def allreduce(tensor, average=None, name=None, compression=None, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """A new tensor: ``tensor`` reduced over all ranks (default: averaged)."""
    if process_set is not None:
        raise ConfigError("process sets are not supported by EDDIS; reduce over all ranks")
    result = _basics.allreduce_array(_to_numpy(tensor), op=op, average=average, name=name,
                                     prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    return _from_numpy(result, tensor)


def allreduce_(tensor, average=None, name=None, op=None, **kwargs):
    """In-place :func:`allreduce`; returns ``tensor``."""
    with torch.no_grad():
        tensor.copy_(allreduce(tensor, average=average, name=name, op=op, **kwargs))
    return tensor


def broadcast(tensor, root_rank=0, name=None):
    """A new tensor holding root_rank's ``tensor``."""
    _basics.require("eddis.broadcast()")
    data = _to_numpy(tensor).copy()
    collectives.broadcast_array(data, root=root_rank, what=f"eddis.broadcast({name or ''})")
    return _from_numpy(data, tensor)


def broadcast_(tensor, root_rank=0, name=None):
    with torch.no_grad():
        tensor.copy_(broadcast(tensor, root_rank, name))
    return tensor


def allgather(tensor, name=None):
    """Concatenation of every rank's ``tensor`` along dimension 0 (sizes may differ)."""
    _basics.require("eddis.allgather()")
    parts = collectives.allgather_object(_to_numpy(tensor), what=f"eddis.allgather({name or ''})")
    return torch.from_numpy(np.concatenate(parts, axis=0)).to(device=tensor.device, dtype=tensor.dtype)


broadcast_object = _basics.broadcast_object
allgather_object = _basics.allgather_object
barrier = _basics.barrier
