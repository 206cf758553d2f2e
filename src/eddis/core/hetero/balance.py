"""Balanced synchronous training: shares of the global batch that follow each rank's speed.

In plain ``sync`` every rank computes an equal share of the global batch, so a
step takes as long as the slowest rank needs for its share. With balancing,
rank r computes a share proportional to its measured throughput (samples per
second of its own compute), so all ranks finish their shares at about the same
time. The gradients are averaged weighted by sample count, so a step is still
exactly the gradient of the whole global batch: the *math* of plain sync, the
*speed* of the sum of the ranks.

Schedule (all ranks decide together, over MPI, so they always agree):

- the shares start equal, or from given ``initial`` weights (e.g. the GPUs'
  known relative speeds);
- step 0 is not measured (allocation and warm-up dominate it);
- after ``PROVISIONAL`` (2) measured steps the shares jump to a provisional split
  when ``warmup`` is longer: until the first full decision, every step runs at
  the pace of the slowest rank on its equal share (at {1,1,2,3}, about twice
  the balanced step), and two steps already tell which ranks are slow;
- after ``warmup`` measured steps the shares jump to the split measured over
  the steps since (the provisional one is not smoothed into it);
- every ``interval`` steps after that the throughputs are measured again and
  the shares move towards them by ``smoothing`` (``new = (1 - smoothing) old +
  smoothing measured``), so one noisy window cannot swing the split; changes
  below 1% of a share are ignored.

What is balanced is the moment each rank arrives at the reduction. A rank's step
is its *fixed cost* (from the end of the last reduction to the start of its
compute: waking up, the optimizer's update, the claim on the learning counter,
loading the batch) plus its samples' compute, and slower hardware is slower at
both. So the measured split gives rank r ``n_r = (T - fixed_r) / per_sample_r``
samples, with T chosen so that they sum to the global batch: every rank is
predicted to arrive at the same time. With no fixed cost this is the split
proportional to throughput. A rank whose fixed cost alone exceeds the others'
whole step keeps the minimum of one sample per global batch.

A decision taken at the end of step k applies from step ``k + 1``, or later when
a data loader has already handed out batches beyond it (``note_served``), so
every global batch is split with the same shares on every rank.

    balancer = Balancer(size, rank, comm=runtime.comm())
    balancer.global_batch = 256
    sizes = balancer.sizes_for(step)        # per-rank sample counts, sum 256
    part = balancer.slice_for(step)         # this rank's slice of the global batch
    balancer.record(samples, seconds, fixed)   # this rank's compute (and fixed cost) of the step
    balancer.end_step(step)                 # collective at decision steps

Settings: EDDIS_BALANCE, EDDIS_BALANCE_WARMUP, EDDIS_BALANCE_INTERVAL,
EDDIS_BALANCE_SMOOTHING.
"""
import logging

import numpy as np

from ... import settings
from ...errors import ConfigError, UsageError
from ..comm import collectives
from ..layout.sampler import split_sizes

log = logging.getLogger("eddis.core.balance")

MIN_CHANGE = 0.01
PROVISIONAL = 2   # measured steps before a provisional split, when the warm-up is longer


def balanced_sizes(global_batch, shares):
    """Per-rank sample counts proportional to ``shares``, summing to ``global_batch``
    (largest remainders), with at least one sample per rank (a rank with no samples
    has no mean loss), taken from the largest counts."""
    size = len(shares)
    if global_batch < size:
        raise ConfigError(f"the global batch ({global_batch}) must hold at least one sample per "
                          f"rank ({size}); raise the global batch size")
    # Rounding the whole batch, not one sample each plus the rest: a small share of
    # the rest rounds up by up to a sample, which is the step time of the slowest rank.
    sizes = split_sizes(global_batch, np.asarray(shares, dtype=np.float64))
    for r in range(size):
        if sizes[r] == 0:
            sizes[int(np.argmax(sizes))] -= 1
            sizes[r] = 1
    return sizes


def arrival_shares(samples, seconds, fixed, global_batch):
    """Shares (sum 1) under which every rank is predicted to reach the reduction at
    once: rank r needs ``fixed[r] + n_r * seconds[r] / samples[r]`` for n_r samples
    (``fixed``: its mean per-step cost outside compute). At least one sample per
    rank; ranks without a measurement count with the others' mean per-sample time."""
    samples = np.asarray(samples, dtype=np.float64)
    seconds = np.asarray(seconds, dtype=np.float64)
    fixed = np.maximum(np.asarray(fixed, dtype=np.float64), 0.0)
    size = len(samples)
    ok = (seconds > 0) & (samples > 0)
    if not ok.any():
        return np.full(size, 1.0 / size)
    per_sample = np.full(size, np.nan)
    per_sample[ok] = seconds[ok] / samples[ok]
    per_sample[~ok] = np.nanmean(per_sample[ok])
    fixed[~ok] = 0.0
    batch = float(global_batch)
    counts = np.ones(size)
    free = np.ones(size, dtype=bool)   # ranks above the one-sample minimum
    while free.any():
        # T such that the free ranks' (T - fixed) / per_sample fill what the others left
        arrival = ((batch - counts[~free].sum()) + (fixed[free] / per_sample[free]).sum()) \
            / (1.0 / per_sample[free]).sum()
        want = (arrival - fixed) / per_sample
        short = free & (want < 1.0)
        if not short.any():
            counts[free] = want[free]
            break
        free &= ~short   # a rank whose fixed cost alone outlasts the step keeps one sample
    return counts / counts.sum()


def smooth_shares(old, measured, smoothing):
    new = (1.0 - smoothing) * np.asarray(old) + smoothing * np.asarray(measured)
    new = new / new.sum()
    if np.max(np.abs(new - old) / np.maximum(old, 1e-12)) < MIN_CHANGE:
        return np.asarray(old)
    return new


class Balancer:
    """Per-rank shares of the global batch, rebalanced from measured throughput."""

    def __init__(self, size, rank, comm=None, warmup=None, interval=None, smoothing=None,
                 global_batch=None, timeout=None, initial=None):
        self.size = int(size)
        self.rank = int(rank)
        self.comm = comm
        self.warmup = settings.get("EDDIS_BALANCE_WARMUP") if warmup is None else int(warmup)
        self.interval = settings.get("EDDIS_BALANCE_INTERVAL") if interval is None else int(interval)
        self.smoothing = settings.get("EDDIS_BALANCE_SMOOTHING") if smoothing is None else float(smoothing)
        self.timeout = timeout
        if self.warmup < 1 or self.interval < 1:
            raise ConfigError(f"EDDIS_BALANCE_WARMUP ({self.warmup}) and EDDIS_BALANCE_INTERVAL "
                              f"({self.interval}) must be >= 1")
        if not 0.0 < self.smoothing <= 1.0:
            raise ConfigError(f"EDDIS_BALANCE_SMOOTHING must be in (0, 1], got {self.smoothing}")
        self.global_batch = None if global_batch is None else int(global_batch)
        if initial is None:
            self.shares = np.full(self.size, 1.0 / self.size)
        else:
            weights = np.asarray(initial, dtype=np.float64)
            if weights.shape != (self.size,) or not np.all(np.isfinite(weights)) or np.any(weights <= 0):
                raise ConfigError(f"initial balance weights need one positive number per rank "
                                  f"({self.size}), got {list(initial)}")
            self.shares = weights / weights.sum()
        self.schedule = [(0, self.shares.copy())]   # (first step, shares), ascending
        self.history = []                           # (decision step, measured shares, new shares)
        self.served = -1                            # highest step a loader handed out here
        self._samples = 0.0
        self._seconds = 0.0
        self._fixed = 0.0
        self._fixed_steps = 0

    # ------------------------------------------------------------ schedule
    def shares_for(self, step):
        current = self.schedule[0][1]
        for first, shares in self.schedule:
            if first > step:
                break
            current = shares
        return current

    def sizes_for(self, step, global_batch=None):
        batch = self._global_batch(global_batch)
        return balanced_sizes(batch, self.shares_for(step))

    def slice_for(self, step, global_batch=None):
        sizes = self.sizes_for(step, global_batch)
        start = sum(sizes[:self.rank])
        return slice(start, start + sizes[self.rank])

    def samples_for(self, step, global_batch=None):
        return self.sizes_for(step, global_batch)[self.rank]

    def note_served(self, step):
        """A data loader handed out this rank's batch of ``step`` (it may prefetch)."""
        self.served = max(self.served, int(step))

    def _global_batch(self, global_batch):
        if global_batch is not None:
            global_batch = int(global_batch)
            if self.global_batch is None:
                self.global_batch = global_batch
            elif global_batch != self.global_batch:
                raise ConfigError(f"balanced sync: global batch size {global_batch} differs from the "
                                  f"{self.global_batch} used so far; keep it constant")
        if self.global_batch is None:
            raise UsageError("balance=True needs the global batch size: iterate an "
                             "eddis.BalancedBatchSampler(dataset, global_batch_size) or take "
                             "optimizer.batch_slice(global_batch_size) of each global batch")
        return self.global_batch

    # ------------------------------------------------------------ measurement
    def record(self, samples, seconds, fixed=None):
        """This rank computed ``samples`` samples in ``seconds`` in the current step,
        after ``fixed`` seconds since the last reduction ended (None: not known)."""
        self._samples += float(samples)
        self._seconds += float(seconds)
        if fixed is not None:
            self._fixed += max(0.0, float(fixed))
            self._fixed_steps += 1

    def _reset_measurement(self):
        self._samples = self._seconds = self._fixed = 0.0
        self._fixed_steps = 0

    def is_decision_step(self, step):
        if step == PROVISIONAL < self.warmup:
            return True
        return step >= self.warmup and (step - self.warmup) % self.interval == 0

    def end_step(self, step):
        """Called by every rank after step ``step``; collective at decision steps.
        Returns True when the shares changed."""
        if step == 0:
            self._reset_measurement()  # warm-up step: not representative
            return False
        if not self.is_decision_step(step):
            return False
        fixed = self._fixed / self._fixed_steps if self._fixed_steps else 0.0
        mine = (self._samples, self._seconds, self.served, fixed)
        self._reset_measurement()
        everyone = collectives.allgather_object(mine, comm=self.comm, timeout=self.timeout,
                                                what="balanced sync (throughput exchange)")
        measured = arrival_shares([e[0] for e in everyone], [e[1] for e in everyone],
                                  [e[3] for e in everyone], self._global_batch(None))
        smoothing = 1.0 if step <= self.warmup else self.smoothing
        new = smooth_shares(self.shares, measured, smoothing)
        self.history.append((step, measured.tolist(), new.tolist()))
        if new is self.shares or np.array_equal(new, self.shares):
            return False
        first = max(step + 1, max(e[2] for e in everyone) + 1)
        self.shares = new
        self.schedule.append((first, new.copy()))
        if len(self.schedule) > 64:  # old entries are never consulted again
            self.schedule = self.schedule[-64:]
        log.info("balanced sync: step %d shares %s (measured %s), from step %d", step,
                 np.round(new, 3).tolist(), np.round(measured, 3).tolist(), first)
        return True
