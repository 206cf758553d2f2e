"""Mixed GPU generations in ``eddis.torch``: easgd, hybrid, balanced sync, progress control.

    optimizer = eddis.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           mode="easgd")          # or "hybrid", or balance=True
    eddis.broadcast_parameters(model.state_dict(), root_rank=0)
    while not eddis.should_stop():          # the global learning counter (EDDIS_TOTAL_ITERATIONS)
        x, y = next_batch()
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()                    # easgd/hybrid: every tau steps, an exchange
    eddis.save_checkpoint("model.pt", model, optimizer)   # the centre (easgd/hybrid), once

Balanced sync: ``DistributedOptimizer(..., mode="sync", balance=True)`` with
``eddis.BalancedBatchSampler(dataset, global_batch_size)`` as the data loader's
``batch_sampler`` (or ``eddis.balanced_slice(global_batch_size)`` to cut an
in-memory global batch): every rank gets a share of each global batch
proportional to its measured speed, and the optimizer weights its gradients by
that share. ``balance=[w0, w1, ...]`` starts from those per-rank weights (say,
the GPUs' known relative speeds) instead of equal shares. Without ``balance`` the same sampler gives equal shares.

How the optimizer hooks in (``eddis.torch.optimizer`` calls these): it builds a
:class:`HeteroState` when it wraps, and keeps it; ``before_push()``
before the first gradient bucket of a step goes on the wire (the simulated
slowdown sleeps here, so a slowed rank's gradients really arrive late);
``before_sync()`` when the step's gradients are final (``synchronize()``: end of
the compute, measured for balancing) and ``after_step()`` after the wrapped
optimizer's step (the elastic exchange; rebalancing). They are the core's
framework-agnostic :class:`eddis.core.hetero.step.HeteroStep`; the algorithms live in
``eddis.core`` (easgd, hybrid, balance, progress, simulate).
"""
import numpy as np
import torch
import torch.utils.data

from ..core.basics import basics as _basics
from ..core.hetero import step as hetero
from ..errors import ConfigError


class HeteroState(hetero.HeteroStep):
    """The heterogeneity hooks of one DistributedOptimizer: the core's
    :class:`eddis.core.hetero.step.HeteroStep` over the optimizer's bucket plan and
    reducer, with parameters (``params``, in the plan's order) copied to and from the
    flat vector by torch."""

    def __init__(self, params, plan, reducer, mode, balance):
        self.params = params
        super().__init__(mode=mode, balance=balance, gather=self._gather_into,
                         scatter=self._scatter_from, partial_copies=True)
        self.attach(plan, reducer)

    def _pieces(self, parts):
        """``(flat start, parameter, first element, end element)`` of every parameter's share
        of ``parts`` (``(start, count)`` of the flat vector; None: all of every parameter)."""
        for slot, p in zip(self.plan.slots, self.params):
            for lo, n in [(slot.start, slot.count)] if parts is None else parts:
                a, b = max(lo, slot.start) - slot.start, min(lo + n, slot.start + slot.count) - slot.start
                if a < b:
                    yield slot.start, p, a, b

    def _gather_into(self, flat, parts=None):
        with torch.no_grad():
            for at, p, a, b in self._pieces(parts):
                torch.from_numpy(flat[at + a:at + b]).copy_(p.detach().reshape(-1)[a:b])

    def _scatter_from(self, flat, parts=None):
        with torch.no_grad():
            for at, p, a, b in self._pieces(parts):
                src = torch.from_numpy(flat[at + a:at + b])
                if p.is_contiguous():
                    p.view(-1)[a:b].copy_(src.to(device=p.device, dtype=p.dtype))
                else:   # a whole copy: a strided parameter has no flat view to write a part into
                    whole = p.detach().reshape(-1).clone()
                    whole[a:b] = src.to(device=p.device, dtype=p.dtype)
                    p.copy_(whole.view(p.shape))


def state_of(optimizer):
    """The HeteroState of an eddis.DistributedOptimizer; None for any other object."""
    state = getattr(getattr(optimizer, "_eddis", None), "hetero", None)
    return state if isinstance(state, HeteroState) else None


def _state_of(optimizer):
    if optimizer is None:
        return _basics.training_state()
    state = state_of(optimizer)
    if state is None:
        raise ConfigError("pass the optimizer returned by eddis.DistributedOptimizer(...)")
    return state


# ---------------------------------------------------------------- public API
configure_progress = _basics.configure_progress
should_stop = _basics.should_stop
global_step = _basics.global_step
progress_counts = _basics.progress_counts
reset_progress = _basics.reset_progress


def final_model(optimizer=None):
    """Collective: load the job's final model into the parameters on every rank
    (easgd/hybrid: the centre variable; sync: nothing to do)."""
    _basics.final_model(_state_of(optimizer))


def save_checkpoint(path, model, optimizer=None, **extra):
    """Collective: write the final model once (rank 0), atomically.

    easgd/hybrid: the centre variable (it is also loaded into ``model`` on every
    rank); sync: the synchronized parameters. The file holds ``model`` (the
    state dict), ``optimizer`` (rank 0's optimizer state, when given), ``mode``,
    ``global_step`` and any ``extra`` keyword values; ``torch.load`` reads it.
    """
    state = _state_of(optimizer)
    _basics.final_model(state)

    def write(tmp):
        payload = {"model": model.state_dict(), "mode": state.mode if state is not None else "sync",
                   "global_step": _basics.global_step(), "size": _basics.size(), **extra}
        if optimizer is not None:
            payload["optimizer"] = optimizer.state_dict()
        torch.save(payload, tmp)

    return _basics.save_on_rank0(path, write, "save_checkpoint")


def balanced_slice(global_batch_size, optimizer=None):
    """The slice of the next global batch (``global_batch_size`` samples, the same on
    every rank) that this rank computes: proportional to its speed with
    ``balance=True``, equal otherwise. Sets the optimizer's sample weight."""
    state = _state_of(optimizer)
    return state.serve(state.step, global_batch_size)


class BalancedBatchSampler(torch.utils.data.Sampler):
    """``batch_sampler`` for a DataLoader: each step, this rank's part of one global batch.

    Every rank walks the same permutation (seeded by ``seed + epoch``) in global
    batches of ``global_batch_size`` (the last one of an epoch filled up by
    wrapping around, so every rank does the same number of steps); rank r takes
    its share of each, proportional to its measured speed under ``balance=True``,
    equal otherwise. ``set_epoch(e)`` reshuffles.
    """

    def __init__(self, dataset, global_batch_size, shuffle=True, seed=0, optimizer=None):
        self.dataset = dataset
        self.global_batch_size = int(global_batch_size)
        if self.global_batch_size < 1:
            raise ConfigError(f"global_batch_size must be >= 1, got {global_batch_size}")
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self.optimizer = optimizer
        self._step = None

    def set_epoch(self, epoch):
        self.epoch = int(epoch)
        _basics.note_epoch(self.epoch)   # where the epoch began, for checkpoints

    def __len__(self):
        return -(-len(self.dataset) // self.global_batch_size)

    def __iter__(self):
        state = _state_of(self.optimizer)
        if self._step is None:
            # a resumed run's loop skips the epoch's batches done before: they keep their steps
            self._step = state.step - _basics.batches_done(self.epoch)
        n = len(self.dataset)
        order = (np.random.default_rng(self.seed + self.epoch).permutation(n) if self.shuffle
                 else np.arange(n))
        batch = self.global_batch_size
        for j in range(len(self)):
            idx = order[j * batch:(j + 1) * batch]
            if len(idx) < batch:
                idx = np.concatenate([idx, np.resize(order, batch - len(idx))])
            part = state.serve(self._step, batch)
            self._step += 1
            yield idx[part].tolist()


__all__ = ["configure_progress", "should_stop", "global_step", "progress_counts", "reset_progress", "final_model",
           "save_checkpoint", "balanced_slice", "BalancedBatchSampler"]
