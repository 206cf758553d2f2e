"""Tensor collectives for metrics and set-up: allreduce, broadcast, allgather.

They run over MPI on the host (CUDA tensors are copied to the host and back);
they are meant for losses, accuracies and start-up synchronization, not for
gradients (the DistributedOptimizer handles those).
"""
import numpy as np
import torch

from ..core import collectives, runtime
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
    runtime._require("eddis.allreduce()")
    if process_set is not None:
        raise ConfigError("process sets are not supported by EDDIS; reduce over all ranks")
    op = resolve_op(op, average)
    data = _to_numpy(tensor)
    if prescale_factor != 1.0:
        data = data * prescale_factor
    result = collectives.allreduce_array(data, op=op.name, what=f"eddis.allreduce({name or ''})")
    if postscale_factor != 1.0:
        result = result * postscale_factor
    return _from_numpy(np.asarray(result), tensor)


def allreduce_(tensor, average=None, name=None, op=None, **kwargs):
    """In-place :func:`allreduce`; returns ``tensor``."""
    with torch.no_grad():
        tensor.copy_(allreduce(tensor, average=average, name=name, op=op, **kwargs))
    return tensor


def broadcast(tensor, root_rank=0, name=None):
    """A new tensor holding root_rank's ``tensor``."""
    runtime._require("eddis.broadcast()")
    data = _to_numpy(tensor).copy()
    collectives.broadcast_array(data, root=root_rank, what=f"eddis.broadcast({name or ''})")
    return _from_numpy(data, tensor)


def broadcast_(tensor, root_rank=0, name=None):
    with torch.no_grad():
        tensor.copy_(broadcast(tensor, root_rank, name))
    return tensor


def allgather(tensor, name=None):
    """Concatenation of every rank's ``tensor`` along dimension 0 (sizes may differ)."""
    runtime._require("eddis.allgather()")
    parts = collectives.allgather_object(_to_numpy(tensor), what=f"eddis.allgather({name or ''})")
    return torch.from_numpy(np.concatenate(parts, axis=0)).to(device=tensor.device, dtype=tensor.dtype)


def broadcast_object(obj, root_rank=0, name=None):
    runtime._require("eddis.broadcast_object()")
    return collectives.broadcast_object(obj, root=root_rank, what=f"eddis.broadcast_object({name or ''})")


def allgather_object(obj, name=None):
    runtime._require("eddis.allgather_object()")
    return collectives.allgather_object(obj, what=f"eddis.allgather_object({name or ''})")


def barrier():
    runtime._require("eddis.barrier()")
    collectives.barrier(what="eddis.barrier()")
