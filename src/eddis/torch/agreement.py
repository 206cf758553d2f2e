"""The parameters the ranks compare (eddis.core.progress.agreement): those of every torch optimizer
that stepped in this process, wrapped or not, so that a run that wrapped nothing is
checked too. A global step hook only notes the optimizer (no communication in it).

Scripts often train inside ``main()``: by the check at exit the optimizer and the model
are gone. Holding them would keep every model of a sweep in (GPU) memory, so each
optimizer is held weakly and, when it is freed, its parameters (still alive at that
moment, through our weak references) leave a snapshot of their checksums instead.
"""
import itertools
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..core.progress import agreement
from . import deferred

_live = weakref.WeakKeyDictionary()  # optimizer -> order of its first step (the same on every rank)
_snapshots = {}                      # order -> checksums of a freed optimizer's parameters
_order = itertools.count()


def _entries(order, params, names):
    entries = []
    for index, p in enumerate(params):
        if p is None or not p.requires_grad or p.layout != torch.strided:
            continue
        data = p.detach()
        entries.append((names.get(id(p), f"optimizer {order} parameter {index}"), tuple(data.shape),
                        data.sum(dtype=torch.float64).item(),
                        torch.linalg.vector_norm(data, dtype=torch.float64).item()))
    return entries


def _wrapped(optimizer):
    """A DistributedOptimizer's state (eddis.torch.optimizer), or None."""
    return getattr(optimizer, "_eddis", None)


def _names(optimizer):
    state = _wrapped(optimizer)
    # a DistributedOptimizer knows the parameters' names
    return {} if state is None else state.feed.names()


def _params(optimizer):
    # a DistributedOptimizer updating bucket by bucket holds a share in each group meanwhile
    state = _wrapped(optimizer)
    groups = (state is not None and state.whole_groups) or [g["params"] for g in optimizer.param_groups]
    return [p for params in groups for p in params]


def _snapshot(order, refs, names):
    try:
        _snapshots[order] = _entries(order, [ref() for ref in refs], names)
    except Exception:  # a finalizer must not raise; the optimizer is simply not checked
        _snapshots[order] = []


def harmless_hook(hook):
    """Whether a global step hook may run once per bucket of an update (this module's does)."""
    return hook is _stepped


def _stepped(optimizer, args, kwargs):
    if optimizer in _live:
        return
    params = _params(optimizer)
    known = {id(p) for other in list(_live) for p in _params(other)}
    if params and all(id(p) in known for p in params):
        return  # a DistributedOptimizer and the original it was made from share the parameters
    order = next(_order)
    _live[optimizer] = order
    weakref.finalize(optimizer, _snapshot, order, [weakref.ref(p) for p in params], _names(optimizer))


def checksums():
    deferred.finish_all()   # EDDIS_OVERLAP_FORWARD: the last step's updates are part of the parameters
    by_order = dict(_snapshots)
    seen = set()
    for optimizer, order in sorted(_live.items(), key=lambda item: item[1]):
        params = [p for p in _params(optimizer) if id(p) not in seen]
        seen.update(id(p) for p in params)
        by_order[order] = _entries(order, params, _names(optimizer))
    return [entry for order in sorted(by_order) for entry in by_order[order]]


register_optimizer_step_post_hook(_stepped)
agreement.register_source(checksums)
tick = agreement.tick
