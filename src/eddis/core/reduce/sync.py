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
from ..._sync_route import auto_route
from ...errors import ConfigError, SMBMemoryError
from ...smb import _core  # noqa: F401  (without the built SMB extension there is no mode sync)
from ..comm import collectives, connection
from ..layout.buckets import column_share
from .adasum_sync import AdasumSyncReducer
from .hierarchical import HierarchicalSyncReducer, NodeLayout
from .join_board import JoinBoard
from .ring import RingSyncReducer, ring_problem
from .slots import BucketShare, SlotReducer

log = logging.getLogger("eddis.core.sync")


class SyncReducer(SlotReducer):
    mode = "sync"

    def __init__(self, plan, compression="none", op="average", timeout=None, name="grads"):
        super().__init__(plan, compression, op, timeout, name)
        self.pool_name = f"eddis.{name}"
        self.join_board = JoinBoard(self.client, self.pool_name, self.rank, self.size)  # before a collective
        self.slots_pool = self._pool(".slots", self.size)
        self.path = self._choose_path()
        # the result pool is where the servers (or the ranks, with private buffers) put the
        # sums; ranks that sum in their slots put them straight into every slot
        self.result_pool = None if self.path == "slots" else self._pool(".result", 1)
        if self.path != "servers":
            self._rank_reduction()
        if self.path == "slots":
            self._stage_in_slot(self.slots_pool.mapped_views(self.rank, 0, self.plan.total)[0])
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
        """Who sums, as all ranks agree (collective): ``servers``, ``ranks`` or ``slots``.

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
            return "servers"
        if not all_mapped:
            far = [r for r, (m, _) in enumerate(everyone) if not m]
            raise ConfigError(
                f"EDDIS_SYNC_REDUCE=ranks needs every rank on the node of every SMB server, but "
                f"rank(s) {far} are not; use EDDIS_SYNC_REDUCE=auto (or server) for multi-node jobs")
        return "slots" if all(i for _, i in everyone) else "ranks"

    def _rank_reduction(self):
        """The weights and the per-bucket state of the ranks' sum (collective)."""
        # one column per server (a pool spreads its columns over all of them); column 0 is used
        self._mapped_weights(self.pool_name + ".weights", self.size, length=self.client.num_servers)
        self.shares = []
        for k, bucket in enumerate(self.plan.buckets):
            lo, hi = column_share(bucket.start, bucket.count, self.rank, self.size)
            slots = list(zip(*(self.slots_pool.mapped_views(r, lo, hi - lo) for r in range(self.size))))
            # per server piece of this rank's share: (result or None, [slot 0, ..., slot W-1])
            results = ([None] * len(slots) if self.path == "slots"
                       else self.result_pool.mapped_views(0, lo, hi - lo))
            self.shares.append(BucketShare(self.client, self.pool_name, k, None, list(zip(results, slots)),
                                           hi - lo))
        self._agree_on_bases()
        log.info("mode sync: the %d ranks sum the buckets in the servers' mapped memory%s", self.size,
                 " (in their slots)" if self.path == "slots" else "")

    # ------------------------------------------------------------ one step
    def _prepare_step(self):
        if self.shares is not None:
            self._publish_weight(self.rank)

    def _submit(self, k):
        bucket = self.plan.buckets[k]
        wire = self._on_the_wire(k)
        if self.path != "slots":  # else the bucket is staged in the slot already
            self.slots_pool.write(wire, slot=self.rank, start=bucket.start, timeout=self.timeout)
        if self.shares is not None:
            self.shares[k].arrived.add()
            return self.step + 1  # this bucket's generation: how often every rank has counted in
        average = self.op == "average"
        return self.result_pool.reduce_nb(
            self.rank, self._step_weight if average else 1.0, self.size, 0, self.step,
            src_pool=self.slots_pool, start=bucket.start, count=bucket.count, average=average)

    def _finish(self, k, request):
        if self.shares is not None:
            self.total_weight = self._sum_share(k, request, self.rank, "ranks")
            if self.path != "slots":  # else every slot holds the whole result already
                self._read_result(k, self.result_pool)
            return
        self._wait_servers(request, k, "rank")
        self._read_result(k, self.result_pool)

    def _release(self):
        self._leave_slot()
        pools = [self.slots_pool, self.result_pool, self._weights_pool] if self.rank == 0 else []
        self._free_when_all_arrive(self.pool_name + ".close", self.size, pools,
                                   f"the sync pools {self.pool_name}")


def make_sync_reducer(plan, compression="none", op="average", timeout=None, name="grads"):
    """Mode sync's reducer (collective): hierarchical when the ranks span several nodes.

    EDDIS_SYNC_REDUCE: auto (the ring at one rank on each of 3 or more nodes, else
    hierarchical across nodes, the ranks' sum on one node), hierarchical (also on one node),
    ring (one rank a node: :mod:`.ring`), server (flat: every rank's slot to the servers) or
    ranks (one node only). op=Adasum: the servers combine the tree's pairs (auto, server)."""
    choice = settings.get("EDDIS_SYNC_REDUCE")
    if str(getattr(op, "name", op)).lower() == "adasum":
        # The servers combine the pairs of the tree (adasum_sync); the node-local sums of
        # the other paths would have to be Adasum's pairs too, which they are not.
        if choice in ("hierarchical", "ranks", "ring"):
            raise ConfigError(f"EDDIS_SYNC_REDUCE={choice} has no Adasum: with op=Adasum mode sync "
                              "combines the gradients on the SMB servers; set EDDIS_SYNC_REDUCE=auto "
                              "(or server) for that flat path, or use op=Average")
        return AdasumSyncReducer(plan, compression, op, timeout, name)
    if choice in ("auto", "hierarchical", "ring"):
        wait = settings.get("EDDIS_COMM_TIMEOUT") if timeout is None else float(timeout)
        layout = NodeLayout.gather(connection.smb_client(), wait)
        if choice == "ring":
            problem = ring_problem(layout)
            if problem:
                raise ConfigError(f"EDDIS_SYNC_REDUCE=ring: {problem}; use auto")
            return RingSyncReducer(plan, compression, op, timeout, name, layout=layout)
        if choice == "hierarchical" or layout.num_nodes > 1:
            if (choice == "auto" and auto_route(len(m) for m in layout.members) == "ring"
                    and ring_problem(layout) is None):
                return RingSyncReducer(plan, compression, op, timeout, name, layout=layout)
            if layout.problem is None:
                return HierarchicalSyncReducer(plan, compression, op, timeout, name, layout=layout)
            if choice == "hierarchical":
                raise ConfigError(f"EDDIS_SYNC_REDUCE=hierarchical: {layout.problem}; use auto or server")
            log.warning("mode sync: %s; every rank's slot goes to the servers instead (flat path)",
                        layout.problem)
    return SyncReducer(plan, compression, op, timeout, name)
