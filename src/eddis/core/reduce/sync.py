"""Mode ``sync``: gradients averaged by the SMB servers (the default mode).

Two pools of the plan's length, partitioned over all servers and in the wire
dtype (float32, float16 or bfloat16; float64 for a float64 plan, summed in float64):

- ``<name>.slots``: one slot (row) per rank, where each rank writes its
  compressed local gradients;
- ``<name>.result``: one slot with the reduced gradients.

Per bucket, on the reducer's threads: write this rank's slot range, then
``reduce_nb(weight=sample count, parties=W, generation=step)``: each server,
once all W contributions to its column range are in, writes the
sample-weighted average (fp32 accumulation) into the result pool and completes
every contributor's request; the finish thread then reads the result range and
decompresses it into the plan's buffer. One round trip per bucket and server;
bucket k+1 is written while bucket k is reduced.

When every rank and every server share one node (``EDDIS_SYNC_REDUCE=auto``,
the default, or ``ranks``), the ranks sum instead of the server, as an MPI
shared-memory allreduce does: each rank maps the servers' memory, so after
writing its slot it counts itself in (a per-bucket arrival counter, a CPU
atomic in the mapped memory), waits for all W, sums its 1/W share of the
bucket's columns over the W slots into the result pool with the same kernels
as the server (fp32 accumulation), counts itself done and, once all W are
done, reads the whole bucket back. The additions are spread over all ranks
instead of one server thread, and no request goes through the server. When
on every rank the slot is one piece of mapped memory (one server), nothing is
compressed and the buffer may move (not pinned for CUDA), the plan's buffer
*is* that slot: the framework stages the gradients there, which saves writing
a copy of every bucket into the slot, and each rank writes the sum of its
share into that share of *every* slot (its columns are read by nobody else),
so the whole result lands in every rank's own buffer without a result pool
(none is allocated) and the read back. All ranks or none do so, as they must:
an in-slot rank leaves its share's sum in the slots only. At close the buffer
moves back to private memory with its contents, before the client unmaps the
servers.

With op=Adasum, ``make_sync_reducer`` builds ``eddis.core.reduce.adasum_sync``'s reducer
instead: the servers combine the pairs of Adasum's tree.
"""
import logging

from ... import settings
from ...errors import ConfigError, SMBMemoryError, SMBTimeoutError
from ...smb import _core  # noqa: F401  (without the built SMB extension there is no mode sync)
from ..comm import collectives, connection
from ..layout.buckets import column_share
from .adasum_sync import AdasumSyncReducer
from .base import Reducer
from .hierarchical import HierarchicalSyncReducer, NodeLayout
from .join_board import JoinBoard
from .slots import arrivals, sum_bucket_share
from .smb_wire import bucket_on_the_wire, read_result

log = logging.getLogger("eddis.core.sync")


class SyncReducer(Reducer):
    mode = "sync"

    def __init__(self, plan, compression="none", op="average", timeout=None, name="grads"):
        super().__init__(plan, compression, op, timeout, name)
        self.client = connection.smb_client()
        self.pool_name = f"eddis.{name}"
        self.join_board = JoinBoard(self.client, self.pool_name, self.rank, self.size)  # before a collective
        self.slots_pool = self._pool(".slots", self.size)
        by_ranks, self._in_slot = self._choose_path()
        # the result pool is where the servers (or the ranks, with private buffers) put the
        # sums; ranks that sum in their slots put them straight into every slot
        self.result_pool = None if self._in_slot else self._pool(".result", 1)
        self._wire = None if self.codec.is_identity else self.codec.empty(plan.total)
        self._by_ranks = self._rank_reduction() if by_ranks else None
        if self._in_slot:
            self._stage_in_slot()
        self._start_threads()

    def _pool(self, suffix, slots):
        try:
            return self.client.pool(self.pool_name + suffix, self.plan.total, dtype=self.codec.smb_dtype,
                                    slots=slots)
        except SMBMemoryError as exc:
            need = (self.size + 1) * self.plan.total * self.codec.itemsize
            raise SMBMemoryError(
                f"{exc.message}. Mode sync needs up to {need / 2**20:.0f} MiB of SMB memory for this "
                f"model ({self.size} gradient slots + 1 result, {self.codec.name} on the wire) spread "
                f"over {self.client.num_servers} server(s): raise SMB_MEMORY / --memory, or use "
                "compression fp16/bf16 to halve it.", exc.code) from exc

    # ------------------------------------------------------------ who sums, where
    def _choose_path(self):
        """(ranks sum, in their slots) as all ranks agree (collective).

        The ranks sum when every rank maps every server (EDDIS_SYNC_REDUCE=auto) or
        when asked to (ranks). They sum in their slots, which become the plan's
        buffers, when moreover nothing is compressed and every rank's buffer may
        move and its slot is one piece of mapped memory (one server); all or none,
        since an in-slot rank leaves its share's sum in the slots only."""
        choice = settings.get("EDDIS_SYNC_REDUCE")
        client = self.client
        mapped = len(client.mapped_servers()) == client.num_servers
        in_slot = (mapped and self.codec.is_identity and self.plan.movable
                   and len(self.slots_pool.mapped_views(self.rank, 0, self.plan.total)) == 1)
        everyone = collectives.allgather_object((mapped, in_slot), timeout=self.timeout,
                                                what="mode sync: do all ranks map every SMB server?")
        all_mapped = all(m for m, _ in everyone)
        if choice == "server" or (choice == "auto" and not all_mapped):
            return False, False
        if not all_mapped:
            far = [r for r, (m, _) in enumerate(everyone) if not m]
            raise ConfigError(
                f"EDDIS_SYNC_REDUCE=ranks needs every rank on the node of every SMB server, but "
                f"rank(s) {far} are not; use EDDIS_SYNC_REDUCE=auto (or server) for multi-node jobs")
        return True, all(i for _, i in everyone)

    def _stage_in_slot(self):
        """Make this rank's slot the plan's buffer: saves a copy of every bucket into it."""
        views = self.slots_pool.mapped_views(self.rank, 0, self.plan.total)
        views[0][...] = self.plan.buffer
        self.plan.use_buffer(views[0], movable=True)

    def _rank_reduction(self):
        """Per-bucket state of the rank-side sum (collective)."""
        client = self.client
        # one column per server (a pool spreads its columns over all of them); column 0 is used
        self._weights_pool = client.pool(self.pool_name + ".weights", client.num_servers, dtype="float64",
                                         slots=self.size)
        self._weights = [self._weights_pool.mapped_views(r, 0, 1)[0] for r in range(self.size)]
        state = []
        for k, bucket in enumerate(self.plan.buckets):
            arrived = client.counter(f"{self.pool_name}.arrived.{k}")
            done = client.counter(f"{self.pool_name}.done.{k}")
            lo, hi = column_share(bucket.start, bucket.count, self.rank, self.size)
            slots = list(zip(*(self.slots_pool.mapped_views(r, lo, hi - lo) for r in range(self.size))))
            # per server piece of this rank's share: (result or None, [slot 0, ..., slot W-1])
            results = [None] * len(slots) if self._in_slot else self.result_pool.mapped_views(0, lo, hi - lo)
            # An earlier reducer of the same name may have left counts behind: start from them.
            state.append({"arrived": arrived, "done": done, "pieces": list(zip(results, slots)),
                          "count": hi - lo, "base": (arrived.read(), done.read())})
        # Read before anyone counts again: nobody leaves this collective before all have read.
        bases = collectives.allgather_object([st["base"] for st in state], timeout=self.timeout,
                                             what="mode sync: counter bases")
        if any(b != bases[0] for b in bases):
            raise ConfigError("mode sync: the ranks found different reduction counters; two "
                              f"optimizers share the name {self.pool_name!r} at once? Give each its own.")
        log.info("mode sync: the %d ranks sum the buckets in the servers' mapped memory%s", self.size,
                 " (in their slots)" if self._in_slot else "")
        return state

    def _wait_count(self, counter, target, what):
        try:
            counter.wait_for(target, self.timeout)
        except SMBTimeoutError as exc:
            raise SMBTimeoutError(
                f"step {self.step}: {what}: within {self.timeout:g} s only "
                f"{arrivals(self.client, counter, target, list(range(self.size)))} (another rank failed or is "
                "far slower; raise EDDIS_COMM_TIMEOUT if it is slow)", exc.code) from exc

    def _prepare_step(self):
        if self._by_ranks is not None:
            # read by the others after they saw this rank arrive at a bucket of this step
            self._weights[self.rank][0] = self._step_weight if self.op == "average" else 1.0

    def _submit(self, k):
        bucket = self.plan.buckets[k]
        wire = bucket_on_the_wire(self, k, self._wire)
        if not self._in_slot:  # else the bucket is staged in the slot already
            self.slots_pool.write(wire, slot=self.rank, start=bucket.start, timeout=self.timeout)
        if self._by_ranks is not None:
            self._by_ranks[k]["arrived"].fetch_add(1)
            return self.step + 1  # this bucket's generation: how often every rank has counted in
        average = self.op == "average"
        return self.result_pool.reduce_nb(
            self.rank, self._step_weight if average else 1.0, self.size, 0, self.step,
            src_pool=self.slots_pool, start=bucket.start, count=bucket.count, average=average)

    def _sum_share(self, k, generation):
        self.total_weight = sum_bucket_share(self, k, self._by_ranks[k], generation, self.rank, self.size,
                                             self._in_slot, "ranks")

    def _finish(self, k, request):
        if self._by_ranks is not None:
            self._sum_share(k, request)
            if not self._in_slot:  # else every slot holds the whole result already
                self._read_result(k)
            return
        try:
            request.wait(self.timeout)
        except SMBTimeoutError as exc:
            raise SMBTimeoutError(
                f"step {self.step}, bucket {k}: not every rank contributed within {self.timeout:g} s "
                f"({exc.message}; another rank failed or is far slower; raise EDDIS_COMM_TIMEOUT if it is "
                "slow)", exc.code) from exc
        self._read_result(k)

    def _read_result(self, k):
        read_result(self, k, self._wire)

    def _release(self):
        if self._in_slot:
            # the framework's gradients may still point here; the client unmaps it at shutdown
            self.plan.use_buffer(self.plan.buffer.copy(), movable=True)
            self._in_slot = False
        # Free the pools once every rank is done with them (an SMB barrier, so a
        # missing rank costs a bounded wait and never poisons MPI).
        pools = [self.slots_pool, self.result_pool,
                 self._weights_pool if self._by_ranks is not None else None] if self.rank == 0 else []
        self.client.free_when_all_arrive(self.pool_name + ".close", self.size, pools,
                                         min(self.timeout, 60.0), f"the sync pools {self.pool_name}")


def make_sync_reducer(plan, compression="none", op="average", timeout=None, name="grads"):
    """Mode sync's reducer (collective): hierarchical when the ranks span several nodes.

    EDDIS_SYNC_REDUCE: auto (hierarchical across nodes, the ranks' sum on one node),
    hierarchical (also on one node), server (flat: every rank's slot to the servers) or
    ranks (one node only). op=Adasum: the servers combine the tree's pairs (auto, server)."""
    choice = settings.get("EDDIS_SYNC_REDUCE")
    if str(getattr(op, "name", op)).lower() == "adasum":
        # The servers combine the pairs of the tree (adasum_sync); the node-local sums of
        # the other paths would have to be Adasum's pairs too, which they are not.
        if choice in ("hierarchical", "ranks"):
            raise ConfigError(f"EDDIS_SYNC_REDUCE={choice} has no Adasum: with op=Adasum mode sync "
                              "combines the gradients on the SMB servers; set EDDIS_SYNC_REDUCE=auto "
                              "(or server) for that flat path, or use op=Average")
        return AdasumSyncReducer(plan, compression, op, timeout, name)
    if choice in ("auto", "hierarchical"):
        wait = settings.get("EDDIS_COMM_TIMEOUT") if timeout is None else float(timeout)
        layout = NodeLayout.gather(connection.smb_client(), wait)
        if choice == "hierarchical" or layout.num_nodes > 1:
            if layout.problem is None:
                return HierarchicalSyncReducer(plan, compression, op, timeout, name, layout=layout)
            if choice == "hierarchical":
                raise ConfigError(f"EDDIS_SYNC_REDUCE=hierarchical: {layout.problem}; use auto or server")
            log.warning("mode sync: %s; every rank's slot goes to the servers instead (flat path)",
                        layout.problem)
    return SyncReducer(plan, compression, op, timeout, name)
