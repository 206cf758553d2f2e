"""Start-up synchronization: ``broadcast_parameters`` and ``broadcast_optimizer_state``."""
import collections

import numpy as np
import torch

from ..core.basics import basics as _basics
from ..core.comm import collectives, runtime
from ..errors import ConfigError


def _named_tensors(params):
    if isinstance(params, collections.abc.Mapping):
        return list(params.items())
    items = list(params)
    if items and isinstance(items[0], tuple):
        return [(str(n), t) for n, t in items]
    return [(f"tensor.{i}", t) for i, t in enumerate(items)]


def broadcast_parameters(params, root_rank=0):
    """Overwrite tensors on every rank with root_rank's values, in place.

    ``params``: ``model.state_dict()``, ``model.named_parameters()`` or a list of
    tensors. Tensors of one dtype travel as one message. Names, shapes and dtypes
    must agree on every rank (checked; a mismatch raises ConfigError on all ranks).
    """
    runtime.require("eddis.broadcast_parameters()")
    _basics.announce("broadcast_parameters", root_rank)   # refused on every caller beside a joined rank
    named = [(n, t) for n, t in _named_tensors(params) if torch.is_tensor(t)]
    signature = "\n".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in named)
    collectives.check_same(signature, "broadcast_parameters: the tensors (names, shapes, dtypes)",
                           "Build the same model (same constructor arguments) on every rank "
                           "before broadcasting.")
    by_dtype = collections.OrderedDict()
    for name, t in named:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for dtype, tensors in by_dtype.items():
            flat = torch.cat([t.detach().reshape(-1).cpu() for t in tensors]) if tensors else None
            if flat is None or flat.numel() == 0:
                continue
            if dtype == torch.bfloat16:
                array = flat.view(torch.int16).numpy()
            elif dtype == torch.bool:
                array = flat.view(torch.uint8).numpy()
            else:
                array = flat.numpy()
            array = np.ascontiguousarray(array)
            collectives.broadcast_array(array, root=root_rank, what="eddis.broadcast_parameters")
            back = torch.from_numpy(array)
            if dtype in (torch.bfloat16, torch.bool):
                back = back.view(dtype)
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(back[offset:offset + n].view(t.shape))
                offset += n


def _to_cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def broadcast_optimizer_state(optimizer, root_rank=0):
    """Give every rank root_rank's optimizer state (moments, step counts, and
    hyper-parameters such as the learning rate)."""
    runtime.require("eddis.broadcast_optimizer_state()")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"broadcast_optimizer_state needs a torch.optim.Optimizer, got "
                          f"{type(optimizer).__name__}")
    _basics.announce("broadcast_optimizer_state", root_rank)
    is_root = runtime.rank() == root_rank
    state = _to_cpu(optimizer.state_dict()) if is_root else None
    shape = [len(g["params"]) for g in optimizer.param_groups]
    collectives.check_same(repr(shape), "broadcast_optimizer_state: the optimizer's parameter groups",
                           "Create the optimizer with the same parameter groups on every rank.")
    state = collectives.broadcast_object(state, root=root_rank, what="eddis.broadcast_optimizer_state")
    if not is_root:
        optimizer.load_state_dict(state)
