"""Which samples each rank trains on: equal or weighted shares of a data set or batch.

- ``split_sizes(total, weights)``: integer shares proportional to ``weights``
  that add up to ``total`` (largest remainder; ties go to lower ranks).
- ``shard_indices(num_samples, rank, size, weights=None, epoch=0, seed=0,
  shuffle=True, drop_last=False)``: this rank's sample indices for an epoch.
  Every rank draws the same permutation (seeded by ``seed + epoch``).
  Without weights it behaves like ``torch.utils.data.DistributedSampler``
  (strided shards, padded by wrapping around to a multiple of ``size``, or
  trimmed with ``drop_last``). With weights each rank gets a contiguous slice
  of the permutation, proportional to its weight, with no padding, so ranks
  with larger weights (faster GPUs) see more samples per epoch.
- ``batch_slice(global_batch, rank, size, weights=None)``: the ``slice`` of a
  global batch that ``rank`` computes on (for equal-steps training with
  unequal per-rank batch sizes).
"""
import numpy as np

from ...errors import ConfigError


def check_weights(weights, size):
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (size,):
        raise ConfigError(f"need one weight per rank ({size}), got {len(w)}; pass weights=[w0, ..., w{size - 1}]")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ConfigError(f"rank weights must be finite, >= 0 and not all 0; got {list(weights)}")
    return w


def split_sizes(total, weights):
    """Integer shares of ``total`` proportional to ``weights`` (sum == total)."""
    w = check_weights(weights, len(weights))
    exact = total * w / w.sum()
    sizes = np.floor(exact).astype(np.int64)
    short = int(total - sizes.sum())
    order = np.argsort(-(exact - sizes), kind="stable")
    sizes[order[:short]] += 1
    return [int(s) for s in sizes]


def batch_slice(global_batch, rank, size, weights=None):
    """The slice of a global batch of ``global_batch`` samples that ``rank`` takes."""
    sizes = split_sizes(global_batch, check_weights(weights, size) if weights is not None else [1.0] * size)
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def shard_indices(num_samples, rank, size, weights=None, epoch=0, seed=0, shuffle=True, drop_last=False):
    """This rank's sample indices (np.int64) for ``epoch``."""
    if not 0 <= rank < size:
        raise ConfigError(f"rank {rank} is outside 0..{size - 1}")
    if shuffle:
        order = np.random.default_rng(seed + epoch).permutation(num_samples)
    else:
        order = np.arange(num_samples)
    if weights is not None:
        sizes = split_sizes(num_samples, check_weights(weights, size))
        start = sum(sizes[:rank])
        return order[start:start + sizes[rank]].astype(np.int64)
    if drop_last:
        per_rank = num_samples // size
        order = order[:per_rank * size]
    else:
        per_rank = -(-num_samples // size)
        padding = per_rank * size - num_samples
        if padding and num_samples:
            order = np.concatenate([order, np.resize(order, padding)])
    return order[rank::size].astype(np.int64)
