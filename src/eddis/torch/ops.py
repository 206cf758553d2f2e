"""Tensor collectives for metrics and set-up: allreduce, broadcast, allgather, and their
``*_async`` forms with Horovod's handles (``poll``, ``synchronize``).

They run over MPI on the host (CUDA tensors are copied to the host and back), on EDDIS's
collectives thread (eddis.core.comm.engine): an ``*_async`` call returns a handle at once and
the operation goes on while the script computes; handles complete in the order they were
issued. They are meant for losses, accuracies and start-up synchronization, not for
gradients (the DistributedOptimizer handles those).
"""
import numpy as np
import torch

from ..core.basics import basics as _basics
from ..core.comm.ops import Adasum, Average, Max, Min, ReduceOp, Sum, resolve_op  # noqa: F401
from ..errors import ConfigError


def _to_numpy(tensor):
    t = tensor.detach()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16
        t = t.float()
    return np.ascontiguousarray(t.cpu().numpy())


def _from_numpy(array, like):
    return torch.from_numpy(array).to(device=like.device, dtype=like.dtype).reshape(like.shape)


def _no_process_set(process_set):
    if process_set is not None:
        raise ConfigError("process sets are not supported by EDDIS; reduce over all ranks")


def _into(tensor):
    """The in-place variants' finish: the result copied into ``tensor``, which is returned."""
    def finish(array):
        with torch.no_grad():
            tensor.copy_(_from_numpy(array, tensor))
        return tensor
    return finish


def _allreduce_handle(tensor, average, name, op, prescale_factor, postscale_factor, process_set):
    _no_process_set(process_set)
    return _basics.allreduce_async(_to_numpy(tensor), op=op, average=average, name=name,
                                   prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def _numbered(handle, finish):
    handle.finish = finish
    return _basics.handle_number(handle)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=None):
    """A handle (for :func:`poll` / :func:`synchronize`) to ``tensor`` reduced over all ranks
    (default: averaged), a new tensor. ``tensor`` is read at the call."""
    handle = _allreduce_handle(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return _numbered(handle, lambda array: _from_numpy(array, tensor))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=None):
    """In-place :func:`allreduce_async`: :func:`synchronize` writes the result into ``tensor``
    and returns it."""
    handle = _allreduce_handle(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return _numbered(handle, _into(tensor))


def allreduce(tensor, average=None, name=None, compression=None, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """A new tensor: ``tensor`` reduced over all ranks (default: averaged)."""
    handle = _allreduce_handle(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return _from_numpy(handle.wait(), tensor)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=None):
    """In-place :func:`allreduce`; returns ``tensor``."""
    handle = _allreduce_handle(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return _into(tensor)(handle.wait())


def _broadcast_handle(tensor, root_rank, name, process_set):
    _no_process_set(process_set)
    return _basics.broadcast_async(_to_numpy(tensor), root_rank=root_rank, name=name)


def broadcast_async(tensor, root_rank, name=None, process_set=None):
    """A handle to root_rank's ``tensor``, a new tensor."""
    return _numbered(_broadcast_handle(tensor, root_rank, name, process_set),
                     lambda array: _from_numpy(array, tensor))


def broadcast_async_(tensor, root_rank, name=None, process_set=None):
    """In-place :func:`broadcast_async`: :func:`synchronize` writes root_rank's values into
    ``tensor`` and returns it."""
    return _numbered(_broadcast_handle(tensor, root_rank, name, process_set), _into(tensor))


def broadcast(tensor, root_rank=0, name=None, process_set=None):
    """A new tensor holding root_rank's ``tensor``."""
    return _from_numpy(_broadcast_handle(tensor, root_rank, name, process_set).wait(), tensor)


def broadcast_(tensor, root_rank=0, name=None, process_set=None):
    return _into(tensor)(_broadcast_handle(tensor, root_rank, name, process_set).wait())


def _gathered(tensor):
    def finish(array):
        return torch.from_numpy(array).to(device=tensor.device, dtype=tensor.dtype)
    return finish


def allgather_async(tensor, name=None, process_set=None):
    """A handle to every rank's ``tensor`` concatenated along dimension 0."""
    _no_process_set(process_set)
    return _numbered(_basics.allgather_async(_to_numpy(tensor), name=name), _gathered(tensor))


def allgather(tensor, name=None, process_set=None):
    """Concatenation of every rank's ``tensor`` along dimension 0 (sizes may differ)."""
    _no_process_set(process_set)
    return _gathered(tensor)(_basics.allgather_async(_to_numpy(tensor), name=name).wait())


poll = _basics.poll
synchronize = _basics.synchronize
broadcast_object = _basics.broadcast_object
allgather_object = _basics.allgather_object
barrier = _basics.barrier
