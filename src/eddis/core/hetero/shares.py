"""Each global batch cut among the ranks that split it, and the gradient average weighted by the cut.

The data pipeline asks the step driver for this rank's slice of batch ``step``
(``HeteroStep.serve``, which a ``BalancedBatchSampler`` or ``eddis.balanced_batches`` calls);
this rank's weight in the gradient average is then its slice's sample count, so the average
is the gradient of the whole global batch. The ranks that split a batch are every rank, or in
mode hybrid the ranks of one group. :class:`EqualShares` cuts every batch equally (every mode
without balancing); :class:`BalancedShares` (``balance=True``) cuts it by each rank's measured
speed (:class:`.balance.Balancer`).
"""
from ...errors import ConfigError
from . import balance
from .hooks import StepHook

BALANCED_MODES = ("sync", "allreduce", "hybrid")


def for_mode(driver, mode, balanced, initial, group):
    """The shares hook of ``mode``. ``balanced``: balance the shares (``initial``: per-rank
    weights to start from, or None); ``group``: ``(world ranks, communicator)`` of this rank's
    hybrid group, whose ranks split its batches, or None where every rank splits them."""
    split_rank, split_size, members, comm = driver.rank, driver.size, None, None
    if group is not None:
        members, comm = group
        split_rank, split_size = members.index(driver.rank), len(members)
    if not balanced:
        return EqualShares(driver, split_rank, split_size)
    if mode not in BALANCED_MODES:
        raise ConfigError(f"balance=True balances synchronous training (mode 'sync', "
                          f"'allreduce', or the groups of 'hybrid'), not mode {mode!r}: "
                          "easgd already lets faster ranks do more iterations. Drop balance "
                          "or use mode='sync' or 'hybrid'.")
    if initial is not None and members is not None:
        if len(initial) != driver.size:
            raise ConfigError(f"initial balance weights need one positive number per rank "
                              f"({driver.size}), got {initial}")
        initial = [initial[r] for r in members]   # the group's own ranks
    return BalancedShares(driver, split_rank, split_size, comm, initial)


class EqualShares(StepHook):
    """Equal shares of every global batch; the weight of each step set from the share."""

    balancer = None

    def __init__(self, driver, split_rank, split_size):
        self.driver = driver
        self.split_rank, self.split_size = split_rank, split_size
        self.global_batch = None   # samples of one global batch, once a batch was asked for

    def sizes_for(self, step, global_batch):
        """Every splitting rank's sample count of batch ``step``."""
        if self.global_batch is None:
            self.global_batch = int(global_batch)
        return balance.balanced_sizes(int(global_batch), [1.0] * self.split_size)

    def note_served(self, step):
        """A data loader handed out this rank's slice of batch ``step`` (it may prefetch)."""

    def serve(self, step, global_batch):
        """This rank's slice of batch ``step``; sets its weight when ``step`` is the current one."""
        sizes = self.sizes_for(step, global_batch)
        self.global_batch = int(global_batch)
        self.note_served(step)
        if step == self.driver.step:
            self.set_weight(step)
        start = sum(sizes[:self.split_rank])
        return slice(start, start + sizes[self.split_rank])

    def set_weight(self, step):
        reducer = self.driver.reducer
        if reducer is None:
            return  # on_attach sets it
        if reducer.in_progress:
            return  # gradients of this step are already on their way; start_step sets the next
        reducer.set_weight(self.sizes_for(step, self.global_batch)[self.split_rank])

    def on_attach(self, plan, reducer):
        if self.global_batch is not None:
            self.set_weight(self.driver.step)

    def start_step(self, step):
        if self.global_batch is not None:
            self.set_weight(step)


class BalancedShares(EqualShares):
    """Shares that follow each rank's measured speed: the step's compute recorded when its
    gradients are final, the shares decided together at the end of the balancer's steps."""

    def __init__(self, driver, split_rank, split_size, comm, initial):
        super().__init__(driver, split_rank, split_size)
        self.balancer = balance.Balancer(split_size, split_rank, comm=comm, initial=initial)

    def sizes_for(self, step, global_batch):
        return self.balancer.sizes_for(step, global_batch)

    def note_served(self, step):
        self.balancer.note_served(step)

    def before_sync(self, elapsed, start, flat):
        if self.global_batch is not None:
            self.balancer.record(self.balancer.samples_for(self.driver.step), elapsed, self._fixed_cost(start))
        return elapsed

    def _fixed_cost(self, start):
        """Seconds from the end of the last step's reduction to this step's compute
        ``start`` (waking up, the optimizer's update, the counter claim), or None before
        a reduction."""
        reducer = self.driver.reducer
        completed = None if reducer is None else reducer.completed_at
        if completed is None or completed > start:
            return None
        return start - completed

    def end_step(self, step):
        self.balancer.end_step(step)   # collective at the balancer's decision steps
