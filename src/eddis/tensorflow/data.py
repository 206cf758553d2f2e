"""``tf.data`` sharding that honours per-rank shares (weights).

- ``shard(dataset, weights=None, block_size=None)``: this rank's elements. The
  dataset is read in blocks of ``block_size`` elements; of each block rank r
  keeps a contiguous run whose length is its share (``eddis.core.split_sizes``
  of the block by ``weights``; equal shares without weights). A final partial
  block is dropped, so every rank gets the same number of blocks, hence the
  same number of steps.
- ``shard_batches(dataset, global_batch_size, weights=None)``: each global batch
  of ``global_batch_size`` consecutive elements, cut into per-rank batches: rank r
  gets ``local_batch_size(global_batch_size, weights)`` samples of every global
  batch (the ``batch_slice`` of :mod:`eddis.core.layout.sampler`). One step of N ranks
  then computes exactly the gradient of the global batch (give the optimizer the
  local batch size as its sample count when the shares differ).
- ``local_batch_size(global_batch_size, weights=None)``.
- ``balanced_batches(dataset, global_batch_size, optimizer=None)``: like
  ``shard_batches``, but each global batch is cut with the shares of the
  ``DistributedOptimizer`` (``balance=True``: shares that follow each rank's
  measured speed, rebalanced during training; equal shares otherwise), and the
  optimizer's weight of this rank follows. Iterate whole epochs (no
  ``steps_per_epoch`` shorter than the data): global batches are numbered as
  the pipeline produces them.

Shuffle *before* sharding with a seed that is the same on every rank
(``dataset.shuffle(n, seed=42)``): the ranks then agree on the order and their
shards do not overlap. Every rank reads the whole input (and keeps its part), so
put expensive ``map`` calls after ``shard``.
"""
import itertools

import numpy as np
import tensorflow as tf

from ..core.comm import runtime
from ..core.layout import sampler
from ..errors import ConfigError


def _rank_size(rank, size):
    if rank is None or size is None:
        runtime.require("eddis.data.shard() without rank/size")
    return (runtime.rank() if rank is None else int(rank), runtime.size() if size is None else int(size))


def local_batch_size(global_batch_size, weights=None, rank=None, size=None):
    """This rank's part of a global batch (equal parts, or proportional to ``weights``)."""
    rank, size = _rank_size(rank, size)
    s = sampler.batch_slice(int(global_batch_size), rank, size, weights)
    return s.stop - s.start


def shard(dataset, weights=None, block_size=None, rank=None, size=None):
    """This rank's share of ``dataset`` (see the module docstring)."""
    rank, size = _rank_size(rank, size)
    if not isinstance(dataset, tf.data.Dataset):
        raise ConfigError(f"shard() needs a tf.data.Dataset, got {type(dataset).__name__}")
    if block_size is None:
        block_size = size if weights is None else 64 * size
    block_size = int(block_size)
    if block_size < size:
        raise ConfigError(f"block_size {block_size} is smaller than the number of ranks ({size}); "
                          "every rank needs at least a chance of one element per block")
    part = sampler.batch_slice(block_size, rank, size, weights)
    if part.stop == part.start:
        raise ConfigError(f"rank {rank} gets no element of each block of {block_size} with weights "
                          f"{list(weights) if weights is not None else None}; raise block_size or its weight")
    blocks = None
    cardinality = int(dataset.cardinality())
    if cardinality >= 0:
        blocks = cardinality // block_size
        if blocks == 0:
            raise ConfigError(f"the dataset has {cardinality} elements, fewer than one block of "
                              f"{block_size}: every rank would get nothing")
        dataset = dataset.take(blocks * block_size)
    start, stop, block = np.int64(part.start), np.int64(part.stop), np.int64(block_size)

    def mine(index, *_):
        position = index % block
        return tf.logical_and(position >= start, position < stop)

    def drop_index(index, element):
        return element

    out = dataset.enumerate().filter(mine).map(drop_index)
    if blocks is not None:
        out = out.apply(tf.data.experimental.assert_cardinality(blocks * (part.stop - part.start)))
    return out


def shard_batches(dataset, global_batch_size, weights=None, rank=None, size=None):
    """This rank's batches: its slice of each global batch (see the module docstring)."""
    local = local_batch_size(global_batch_size, weights, rank, size)
    return shard(dataset, weights, block_size=global_batch_size, rank=rank, size=size).batch(
        local, drop_remainder=True)


def balanced_batches(dataset, global_batch_size, optimizer=None):
    """This rank's part of each global batch, as the optimizer's (balanced) shares say."""
    from ..core.progress import driver

    state = driver.current() if optimizer is None else getattr(getattr(optimizer, "_eddis", None),
                                                                "hetero", None)
    if state is None:
        raise ConfigError("balanced_batches needs an eddis.DistributedOptimizer: create it first "
                          "(DistributedOptimizer(opt, balance=True)) and pass optimizer=")
    global_batch = int(global_batch_size)
    if global_batch < state.split_size:
        raise ConfigError(f"global_batch_size {global_batch} is smaller than the number of ranks that "
                          f"split it ({state.split_size})")
    steps = itertools.count()

    def bounds():
        part = state.serve(next(steps), global_batch)
        return np.int64(part.start), np.int64(part.stop)

    def cut(*batch):
        start, stop = tf.numpy_function(bounds, [], [tf.int64, tf.int64], stateful=True,
                                        name="eddis_balanced_slice")
        element = batch[0] if len(batch) == 1 else batch
        return tf.nest.map_structure(lambda t: t[start:stop], element)

    return dataset.batch(global_batch, drop_remainder=True).map(cut)
