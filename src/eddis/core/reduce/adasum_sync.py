"""Mode ``sync`` with op=Adasum: the ranks' gradients combined by the SMB servers.

Three pools of the plan's length, co-partitioned over all servers:

- ``<name>.slots`` (wire dtype): one slot per rank, its compressed gradients;
- ``<name>.tree`` (float32, W/2 slots; only for W > 2 ranks): the inner nodes
  of the tree, so the partial results are never rounded to the wire dtype;
- ``<name>.result`` (wire dtype): the Adasum of all W ranks.

The tree is Horovod's: at distance d = 1, 2, 4, ... the rank r with r % 2d == 0
*drives* the pair (r, r + d), whose vectors are the results of the two
subtrees below (a rank's own slot at d = 1, its tree slot above). Every server
holds only its columns, while a tensor's coefficients need its dot products
over all of them, so a pair takes two rounds:

1. ``dot_norms``: each server returns (a.b, a.a, b.b) of its part of every
   tensor of the bucket (fp32 products, float64 partial sums); the driver adds
   up the servers' partials per tensor and computes the coefficients;
2. ``pair_sum``: each server writes w_a a + w_b b per tensor of its columns
   (fp32 accumulation) into the driver's tree slot, or into the result pool at
   the top of the tree.

The partner tells its driver that its subtree is in place by counting on a
per-bucket counter of its own (an odd rank as soon as its slot is written);
rank 0 counts on its counter once the result is complete, and every rank
then reads the bucket back. Counters are cumulative over steps: a rank waits
for ``base + generation``, the value read before the first step.
"""
import logging

from ... import timeline
from ...errors import SMBMemoryError
from ...timeline.events import CAT_COMM
from ..comm import adasum, collectives
from .slots import Count, SlotReducer

log = logging.getLogger("eddis.core.sync")


def tree_schedule(rank, size):
    """([(distance, partner)] this rank drives, the distance at which it hands its subtree
    to its driver, or None for rank 0, the root)."""
    drives = []
    for distance in adasum.tree_levels(size):
        if rank % (2 * distance):
            return drives, distance
        drives.append((distance, rank + distance))
    return drives, None


class AdasumSyncReducer(SlotReducer):
    mode = "sync"

    def __init__(self, plan, compression="none", op="adasum", timeout=None, name="grads"):
        super().__init__(plan, compression, op, timeout, name)
        adasum.check_ranks(self.size, "mode 'sync'")
        self.pool_name = f"eddis.{name}.adasum"
        self.slots_pool = self._pool(".slots", self.size, self.codec.smb_dtype)
        self.tree_pool = self._pool(".tree", self.size // 2, "float32") if self.size > 2 else None
        self.result_pool = self._pool(".result", 1, self.codec.smb_dtype)
        self._segments = [adasum.bucket_segments(plan, k) for k in range(self.num_buckets)]
        self._drives, self._hands_over_at = tree_schedule(self.rank, self.size)
        # the counters this rank counts on or waits for: its own, its partners', the root's
        ranks = sorted({self.rank, 0} | {partner for _, partner in self._drives})
        self._counts = {(k, r): Count(self.client, f"{self.pool_name}.ready.{k}.{r}")
                        for k in range(self.num_buckets) for r in ranks}
        # nobody counts before every rank has read its bases (each rank reads other counters)
        collectives.barrier(timeout=self.timeout, what="mode sync (Adasum): counter bases")
        log.info("mode sync: Adasum on the SMB servers, %d ranks, this rank drives %s", self.size,
                 [partner for _, partner in self._drives] or "no pair")
        self._start_threads()

    def _pool(self, suffix, slots, dtype):
        try:
            return self.client.pool(self.pool_name + suffix, self.plan.total, dtype=dtype, slots=slots)
        except SMBMemoryError as exc:
            itemsize = self.codec.itemsize
            need = self.plan.total * ((self.size + 1) * itemsize + (self.size // 2) * 4 * (self.size > 2))
            raise SMBMemoryError(
                f"{exc.message}. Mode sync with Adasum needs up to {need / 2**20:.0f} MiB of SMB memory "
                f"for this model ({self.size} gradient slots + 1 result in {self.codec.name}, and "
                f"{self.size // 2 if self.size > 2 else 0} fp32 slots of the tree) spread over "
                f"{self.client.num_servers} server(s): raise SMB_MEMORY / --memory, or use compression "
                "fp16/bf16.", exc.code) from exc

    # ------------------------------------------------------------ where a subtree's vector lives
    def _vector(self, rank, distance):
        """(pool, slot) holding rank's subtree before the level at ``distance``."""
        if distance == 1:
            return self.slots_pool, rank
        return self.tree_pool, rank // 2

    def _wait_ready(self, k, rank, generation, what):
        """Rank ``rank`` counted bucket ``k`` in ``generation`` times: its subtree is in place."""
        self._wait_count(self._counts[(k, rank)], generation, f"bucket {k}: {what} (rank {rank})", [rank])

    # ------------------------------------------------------------ the reducer's threads
    def _submit(self, k):
        bucket = self.plan.buckets[k]
        self.slots_pool.write(self._on_the_wire(k), slot=self.rank, start=bucket.start, timeout=self.timeout)
        if not self._drives:  # a leaf of the tree's first level: its slot is its subtree
            self._counts[(k, self.rank)].add()
        return self.step + 1

    def _combine(self, k, distance, partner):
        segments = self._segments[k]
        a_pool, a_slot = self._vector(self.rank, distance)
        b_pool, b_slot = self._vector(partner, distance)
        top = 2 * distance == self.size
        dst_pool, dst_slot = (self.result_pool, 0) if top else (self.tree_pool, self.rank // 2)
        with timeline.span(timeline.REDUCE, cat=CAT_COMM, args={"step": self.step, "bucket": k,
                                                                "by": "adasum", "partner": partner}):
            dots = dst_pool.dot_norms(a_slot, b_slot, segments, a_pool=a_pool, b_pool=b_pool,
                                      timeout=self.timeout)
            dst_pool.pair_sum(dst_slot, a_slot, b_slot, segments, adasum.pair_weights(dots),
                              a_pool=a_pool, b_pool=b_pool, timeout=self.timeout)

    def _finish(self, k, generation):
        for distance, partner in self._drives:
            self._wait_ready(k, partner, generation, f"the subtree at distance {distance}")
            self._combine(k, distance, partner)
        if self._drives:  # its tree slot (the root: the result) is complete
            self._counts[(k, self.rank)].add()
        if self.rank != 0:
            self._wait_ready(k, 0, generation, "the combined result")
        self._read_result(k, self.result_pool)

    def _release(self):
        pools = [self.slots_pool, self.tree_pool, self.result_pool] if self.rank == 0 else []
        self._free_when_all_arrive(self.pool_name + ".close", self.size, pools,
                                   f"the Adasum pools {self.pool_name}")
