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

How the optimizer hooks in (``eddis.torch.optimizer`` calls these):
``attach(optimizer, mode, balance)`` once after wrapping; ``before_push()``
before the first gradient bucket of a step goes on the wire (the simulated
slowdown sleeps here, so a slowed rank's gradients really arrive late);
``before_sync()`` when the step's gradients are final (``synchronize()``: end of
the compute, measured for balancing) and ``after_step()`` after the wrapped
optimizer's step (the elastic exchange; rebalancing). The algorithms live in
``eddis.core`` (easgd, hybrid, balance, progress, simulate).
"""
import os
import threading
import time

import numpy as np
import torch
import torch.utils.data

from ..core import balance as _balance
from ..core import collectives, easgd, hybrid, progress, runtime, simulate
from ..errors import ConfigError, UsageError
from .. import settings

_current = [None]        # the HeteroState of the newest DistributedOptimizer
_loop_mark = [0.0]       # when should_stop() last returned (its waiting is not compute)
_names = [0]


class HeteroState:
    """What one DistributedOptimizer needs for the heterogeneity features."""

    def __init__(self, optimizer, mode, balance):
        self.optimizer = optimizer
        self.mode = str(settings.get("EDDIS_MODE") if mode is None else mode).lower()
        initial = None
        if balance is None:
            balance = settings.get("EDDIS_BALANCE")
        elif not isinstance(balance, bool):
            initial, balance = list(balance), True   # initial per-rank weights
        self.rank, self.size = runtime.rank(), runtime.size()
        self.group, self.num_groups = runtime.group(), runtime.num_groups()
        self.params = optimizer._eddis_params
        self.plan = optimizer._eddis_plan
        self.reducer = optimizer.reducer
        self.step = 0
        self.slowdown = simulate.from_settings(self.rank, self.group, self.size, self.num_groups)
        self._lock = threading.Lock()
        self._pushed_step = -1
        self._compute_estimate = None
        self._slept_this_step = 0.0
        self._last = time.perf_counter()
        self.global_batch = None
        self.balancer = None
        if balance:
            if self.mode not in ("sync", "allreduce"):
                raise ConfigError(f"balance=True balances synchronous training (mode 'sync' or "
                                  f"'allreduce'), not mode {self.mode!r}: easgd and hybrid already let "
                                  "faster ranks do more iterations. Drop balance or use mode='sync'.")
            self.balancer = _balance.Balancer(self.size, self.rank, initial=initial)
        self.averager = None
        self.group_comm = None
        if self.mode in ("easgd", "hybrid") and self.size > 1:
            self._setup_averaging()
        progress.set_mode_hint(self.mode)
        _current[0] = self

    def _setup_averaging(self):
        if self.mode == "hybrid":
            members = hybrid.group_members()
            hybrid.check_groups(members)
            worker, workers = self.group, len(members)
            self.group_comm = hybrid.group_comm()
        else:
            worker, workers = self.rank, self.size
        _names[0] += 1
        name = collectives.broadcast_object(f"eddis.{self.mode}.centre.{_names[0]}", root=0,
                                            what=f"{self.mode} set-up")
        self.averager = easgd.ElasticAverager(runtime.smb_client(), self.plan.total, worker, workers,
                                              alpha=hybrid.default_alpha(workers), name=name)
        self.flat = np.empty(self.plan.total, dtype=np.float32)
        self.exchanging = self.group_comm is None or self.group_comm.Get_rank() == 0
        self._centre_ready = False

    # ------------------------------------------------------------ parameters <-> flat vector
    def gather(self):
        flat = self.flat
        with torch.no_grad():
            for slot, p in zip(self.plan.slots, self.params):
                view = torch.from_numpy(flat[slot.start:slot.start + slot.count])
                view.copy_(p.detach().reshape(-1))
        return flat

    def scatter(self, flat):
        with torch.no_grad():
            for slot, p in zip(self.plan.slots, self.params):
                src = torch.from_numpy(flat[slot.start:slot.start + slot.count]).view(slot.shape)
                p.copy_(src.to(device=p.device, dtype=p.dtype))

    # ------------------------------------------------------------ hooks from the optimizer
    def before_push(self):
        """Before this step's first gradient bucket is marked ready (autograd thread)."""
        if not self.slowdown.active:
            return
        with self._lock:
            if self._pushed_step == self.step:
                return
            self._pushed_step = self.step
        estimate = self._compute_estimate
        if estimate is None:  # first step: what it computed so far
            estimate = time.perf_counter() - self._compute_start()
        self._slept_this_step = self.slowdown.stretch(estimate)

    def _compute_start(self):
        return max(self._last, _loop_mark[0])

    def before_sync(self):
        now = time.perf_counter()
        elapsed = now - self._compute_start()
        if self.slowdown.active:
            if self._pushed_step != self.step:  # no bucket was pushed (no gradients): sleep now
                self._pushed_step = self.step
                self._slept_this_step = self.slowdown.stretch(elapsed)
                elapsed += self._slept_this_step
            self._compute_estimate = max(0.0, elapsed - self._slept_this_step)
            self._slept_this_step = 0.0
        if self.balancer is not None and self.global_batch is not None:
            self.balancer.record(self.balancer.samples_for(self.step), elapsed)
        if self.averager is not None and not self._centre_ready:
            self._init_centre()

    def _init_centre(self):
        # every rank holds the broadcast parameters now; rank 0 makes them the centre
        if self.rank == 0:
            self.averager.initialize(self.gather())
        collectives.barrier(what=f"{self.mode}: centre variable initialization")
        self._centre_ready = True

    def after_step(self):
        if self.averager is not None and self.averager.due(self.step):
            self._exchange()
        if self.balancer is not None:
            self.balancer.end_step(self.step)
        self.step += 1
        if self.global_batch is not None:
            self._set_weight(self.step)
        self._last = time.perf_counter()

    def _exchange(self):
        flat = self.gather()
        if self.group_comm is None:
            self.averager.exchange(flat)
        else:
            hybrid.exchange_group(self.averager, flat, self.group_comm)
        self.scatter(flat)

    # ------------------------------------------------------------ batches
    def sizes_for(self, step, global_batch):
        if self.balancer is not None:
            return self.balancer.sizes_for(step, global_batch)
        if self.global_batch is None:
            self.global_batch = int(global_batch)
        return _balance.balanced_sizes(int(global_batch), [1.0] * self.size)

    def serve(self, step, global_batch):
        """The slice of global batch ``step`` this rank computes; sets its weight."""
        sizes = self.sizes_for(step, global_batch)
        self.global_batch = int(global_batch)
        if self.balancer is not None:
            self.balancer.note_served(step)
        if step == self.step:
            self._set_weight(step)
        start = sum(sizes[:self.rank])
        return slice(start, start + sizes[self.rank])

    def _set_weight(self, step):
        if self.reducer.in_progress:
            return  # gradients of this step are already on their way; after_step sets the next
        self.reducer.set_weight(self.sizes_for(step, self.global_batch)[self.rank])

    # ------------------------------------------------------------ the final model
    def final_model(self):
        """Collective: make every rank's parameters the job's final model."""
        if self.averager is None:
            return
        if not self._centre_ready:
            raise UsageError(f"mode {self.mode}: no training step was taken, so there is no centre "
                             "variable yet; call save_checkpoint after training")
        if self.exchanging:
            self.averager.exchange(self.gather())   # the last local steps count too
        self.averager.finish()
        collectives.barrier(what=f"{self.mode}: final model (every worker's last exchange)")
        self.scatter(self.averager.read_center(out=self.flat))
        collectives.barrier(what=f"{self.mode}: final model (centre read)")


def attach(optimizer, mode, balance):
    state = HeteroState(optimizer, mode, balance)
    optimizer._eddis_hetero = state
    return state


def _state_of(optimizer):
    if optimizer is None:
        state = _current[0]
        if state is None:
            raise UsageError("no eddis.DistributedOptimizer exists yet: create it first (or pass optimizer=)")
        return state
    state = getattr(optimizer, "_eddis_hetero", None)
    if state is None:
        raise ConfigError("pass the optimizer returned by eddis.DistributedOptimizer(...)")
    return state


# ---------------------------------------------------------------- public API
def configure_progress(total=None, chunk=None, staleness=None, record=False):
    """Set up the global learning counter (collective; optional: the first
    should_stop() does it from EDDIS_TOTAL_ITERATIONS, EDDIS_CLAIM_CHUNK, EDDIS_STALENESS)."""
    state = _current[0]
    return progress.configure(total=total, chunk=chunk, staleness=staleness,
                              mode=state.mode if state is not None else None, record=record)


def should_stop():
    """True once the job's iterations (EDDIS_TOTAL_ITERATIONS) are used up; else this
    rank runs one more step. Call it once per step, as the loop condition."""
    try:
        return progress.should_stop()
    finally:
        _loop_mark[0] = time.perf_counter()


def global_step():
    """Iterations started job-wide before this rank's current step (for schedules, logs)."""
    return progress.global_step()


def progress_counts():
    """Collective: steps each rank did in this run, by rank (after training)."""
    ctl = progress.controller()
    mine = 0 if ctl is None else ctl.steps_done
    return collectives.allgather_object(mine, what="progress counts")


def final_model(optimizer=None):
    """Collective: load the job's final model into the parameters on every rank
    (easgd/hybrid: the centre variable; sync: nothing to do)."""
    _state_of(optimizer).final_model()


def save_checkpoint(path, model, optimizer=None, **extra):
    """Collective: write the final model once (rank 0), atomically.

    easgd/hybrid: the centre variable (it is also loaded into ``model`` on every
    rank); sync: the synchronized parameters. The file holds ``model`` (the
    state dict), ``optimizer`` (rank 0's optimizer state, when given), ``mode``,
    ``global_step`` and any ``extra`` keyword values; ``torch.load`` reads it.
    """
    state = _state_of(optimizer)
    state.final_model()
    path = os.fspath(path)
    error = None
    if runtime.rank() == 0:
        try:
            payload = {"model": model.state_dict(), "mode": state.mode,
                       "global_step": progress.global_step(), "size": runtime.size(), **extra}
            if optimizer is not None:
                payload["optimizer"] = optimizer.state_dict()
            tmp = f"{path}.tmp-{os.getpid()}"
            torch.save(payload, tmp)
            os.replace(tmp, path)
        except Exception as exc:  # the other ranks must hear about it too
            error = f"{type(exc).__name__}: {exc}"
    error = collectives.broadcast_object(error, root=0, what="save_checkpoint")
    if error is not None:
        raise OSError(f"save_checkpoint({path!r}) failed on rank 0: {error}")
    return path


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

    def __len__(self):
        return -(-len(self.dataset) // self.global_batch_size)

    def __iter__(self):
        state = _state_of(self.optimizer)
        if self._step is None:
            self._step = state.step
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


__all__ = ["configure_progress", "should_stop", "global_step", "progress_counts", "final_model",
           "save_checkpoint", "balanced_slice", "BalancedBatchSampler"]
