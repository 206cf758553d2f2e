"""``DistributedSampler``: each rank's shard of a data set, reshuffled per epoch,
with optional per-rank weights (unequal shares for ranks of unequal speed)."""
import torch.utils.data

from ..core.basics import basics as _basics
from ..core.comm import runtime
from ..core.layout import sampler


class DistributedSampler(torch.utils.data.Sampler):
    """Like ``torch.utils.data.DistributedSampler``, plus ``weights``.

    ``weights``: one number per rank; rank r gets a share of the data set
    proportional to ``weights[r]`` (no padding). Without weights the shards are
    equal (padded by wrapping around, or trimmed with ``drop_last``), exactly as
    torch's sampler does. ``set_epoch(e)`` reshuffles; ``set_weights(w)``
    rebalances from the next epoch on. All ranks must use the same seed.
    """

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
                 drop_last=False, weights=None):
        if num_replicas is None or rank is None:
            runtime.require("eddis.DistributedSampler() without num_replicas/rank")
        self.dataset = dataset
        self.num_replicas = runtime.size() if num_replicas is None else int(num_replicas)
        self.rank = runtime.rank() if rank is None else int(rank)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.epoch = 0
        self.weights = None
        self.set_weights(weights)

    def set_weights(self, weights):
        if weights is not None:
            sampler.check_weights(weights, self.num_replicas)
            weights = [float(w) for w in weights]
        self.weights = weights
        self._indices = None

    def set_epoch(self, epoch):
        self.epoch = int(epoch)
        self._indices = None
        _basics.note_epoch(self.epoch)   # where the epoch began, for checkpoints

    def indices(self):
        if self._indices is None:
            self._indices = sampler.shard_indices(
                len(self.dataset), self.rank, self.num_replicas, weights=self.weights,
                epoch=self.epoch, seed=self.seed, shuffle=self.shuffle, drop_last=self.drop_last)
        return self._indices

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self):
        return len(self.indices())
