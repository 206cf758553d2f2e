"""Mode ``hybrid``'s reducer: the sync reduction among the ranks of this rank's group, on a pool
per group (slots: one per member plus the result) that lives on the servers of the group's own
nodes, so that only the elastic exchanges (:mod:`eddis.core.hetero.hybrid`) cross between the
groups' nodes; with the same threads, bucket order, overlap and compression as every reducer.
When the group's pool is on one server that every member maps, the members sum in their slots,
as mode sync's ranks do on one node."""
import itertools
import logging

from ...errors import ConfigError, SMBTimeoutError
from ...smb.client import servers_on_hosts
from ..comm import collectives, connection, elastic, runtime
from ..comm.groups import group_comm, group_ranks
from ..layout.buckets import column_share
from .base import Reducer
from .slots import arrivals, sum_bucket_share

log = logging.getLogger("eddis.core.hybrid")
_pool_ids = itertools.count()


class GroupSyncReducer(Reducer):
    """The sync reduction among the ranks of this rank's group (mode ``hybrid``)."""

    mode = "hybrid"

    def __init__(self, plan, compression="none", op="average", timeout=None, name="grads"):
        super().__init__(plan, compression, op, timeout, name)
        comm = group_comm()
        self.group = runtime.group()
        self.group_rank = comm.Get_rank()
        self.group_size = comm.Get_size()
        # one pool per group and instance; every member must get the same name
        instance = collectives.broadcast_object(next(_pool_ids), root=0, comm=comm,
                                                what="hybrid reducer set-up")
        self.alone = self.group_size == 1   # nothing to average: the gradients stay as they are
        client = self.client = connection.smb_client()
        self.servers = None if self.alone else self._group_servers(client, comm)
        self._comm = comm
        self._in_slot = not self.alone and self._agree_in_slot(client, comm)
        self.pool_name = f"eddis.hybrid.{name}.{instance}.g{self.group}"
        # summed in the members' slots, the result needs no slot of its own
        self.pool = None if self.alone else client.pool(
            self.pool_name, plan.total, dtype=self.codec.smb_dtype,
            slots=self.group_size + (0 if self._in_slot else 1), servers=self.servers)
        self.result_slot = self.group_size
        self._wire = None if self.codec.is_identity else self.codec.empty(plan.total)
        self._generation = 0
        self._weights_pool = None
        self._by_ranks = self._rank_sum_state(client, comm) if self._in_slot else None
        collectives.barrier(comm=comm, what="hybrid reducer set-up")
        self._start_threads()

    @property
    def sums_in_slots(self):
        """True when the group's members sum in their slots (no server round trip)."""
        return self._by_ranks is not None

    def _agree_in_slot(self, client, comm):
        """Whether the members sum in their slots (collective over the group), as mode sync's
        ranks do on one node: when the group's pool is on one server that every member maps,
        nothing is compressed and every member's buffer may move. Saves the server's round
        trip, the copy of each bucket into the slot and the read of the result."""
        mine = (self.servers is not None and len(self.servers) == 1 and client.is_local(self.servers[0])
                and self.codec.is_identity and self.plan.movable)
        return all(collectives.allgather_object(mine, comm=comm, timeout=self.timeout,
                                                what="hybrid: may the group sum in its slots?"))

    def _rank_sum_state(self, client, comm):
        """The plan's buffer staged in this member's slot, and per bucket the arrival counters
        and this member's share of the columns in every slot (collective over the group)."""
        server = self.servers[0]
        w = self.group_size
        self._weights_pool = client.pool(self.pool_name + ".weights", 1, "float64", slots=w,
                                         servers=[server])
        self._weights = [self._weights_pool.mapped_views(m, 0, 1)[0] for m in range(w)]
        views = self.pool.mapped_views(self.group_rank, 0, self.plan.total)
        views[0][...] = self.plan.buffer
        self.plan.use_buffer(views[0], movable=True)
        state = []
        for k, bucket in enumerate(self.plan.buckets):
            arrived = client.counter(f"{self.pool_name}.arrived.{k}", server=server)
            done = client.counter(f"{self.pool_name}.done.{k}", server=server)
            lo, hi = column_share(bucket.start, bucket.count, self.group_rank, w)
            pieces = [(None, [self.pool.mapped_views(m, lo, hi - lo)[0] for m in range(w)])] if hi > lo else []
            state.append({"arrived": arrived, "done": done, "pieces": pieces, "count": hi - lo,
                          "base": (arrived.read(), done.read())})
        bases = collectives.allgather_object([st["base"] for st in state], comm=comm, timeout=self.timeout,
                                             what="hybrid: the group's counter bases")
        if any(b != bases[0] for b in bases):
            raise ConfigError(f"hybrid group {self.group}: the members found different reduction counters; "
                              f"two optimizers share the name {self.pool_name!r} at once? Give each its own.")
        log.info("hybrid group %d: the %d members sum the buckets in their slots", self.group, w)
        return state

    @staticmethod
    def _group_servers(client, comm):
        """The servers on the group's own nodes (collective over the group), every server when
        none is. Found by host name, not by mapped memory, so that SMB_LOCAL_MAP=0 keeps them
        too: the every-step reduction stays off the network between groups, and a node lost
        as a whole takes no other group's pool with it (EDDIS_ELASTIC)."""
        hosts = collectives.allgather_object(runtime.hostname(), comm=comm,
                                             what="hybrid: the group's nodes")
        servers = servers_on_hosts([info["hostname"] for info in client.servers], hosts)
        if not servers and comm.Get_rank() == 0 and elastic.requested("hybrid") and elastic.mirroring(client):
            log.warning("hybrid group %d: no smb-server runs on its nodes (%s), so its reduction "
                        "pool spans every server and a node lost with its server stops this group "
                        "too; start one smb-server per node (the job script does)", runtime.group(),
                        ", ".join(sorted(set(hosts))))
        return servers or None

    def _prepare_step(self):
        self._generation += 1
        if self._by_ranks is not None:
            # read by the others after they saw this member arrive at a bucket of this step
            self._weights[self.group_rank][0] = self._step_weight if self.op == "average" else 1.0

    def _wire_view(self, k):
        return self.plan.bucket_view(k) if self._wire is None else self.plan.bucket_view(k, self._wire)

    def _submit(self, k):
        if self.alone:
            return None
        if self._by_ranks is not None:   # the bucket is in the slot already
            self._by_ranks[k]["arrived"].fetch_add(1)
            return self._generation
        bucket = self.plan.buckets[k]
        view = self.plan.bucket_view(k)
        wire = view if self._wire is None else self.codec.compress(view, out=self._wire_view(k))
        self.pool.write(wire, slot=self.group_rank, start=bucket.start, timeout=self.timeout)
        average = self.op == "average"
        return self.pool.reduce_nb(self.group_rank, self._step_weight if average else 1.0,
                                   self.group_size, self.result_slot, self._generation,
                                   start=bucket.start, count=bucket.count, average=average)

    def _finish(self, k, request):
        if request is None:
            return
        if self._by_ranks is not None:
            self._sum_in_slots(k, request)
            return
        request.wait(self.timeout)
        bucket = self.plan.buckets[k]
        wire = self._wire_view(k)
        self.pool.read(out=wire, slot=self.result_slot, start=bucket.start, timeout=self.timeout)
        if self._wire is not None:
            self.codec.decompress(wire, self.plan.bucket_view(k))

    def _sum_in_slots(self, k, generation):
        sum_bucket_share(self, k, self._by_ranks[k], generation, self.group_rank, self.group_size, True,
                         "group")

    def _wait_count(self, counter, target, what):
        try:
            counter.wait_for(target, self.timeout)
        except SMBTimeoutError as exc:
            ranks = group_ranks(self._comm)
            raise SMBTimeoutError(
                f"step {self.step}: hybrid group {self.group}: {what}: within {self.timeout:g} s only "
                f"{arrivals(self.client, counter, target, ranks)} (a member failed or is far slower; "
                "raise EDDIS_COMM_TIMEOUT if it is slow)", exc.code) from exc

    def _release(self):
        """Free the group's pool once every member is done with it (an SMB barrier over the
        group: a member may still be reading its last result). Each optimizer has a pool
        of its own, so a job that builds several would otherwise fill the servers. Elastic
        runs keep it: a lost member never arrives, and the servers free it at the job's end."""
        if self._in_slot:
            # the framework's gradients may still point here; the client unmaps it at shutdown
            self.plan.use_buffer(self.plan.buffer.copy(), movable=True)
            self._in_slot = False
        if self.pool is None or elastic.requested("hybrid"):
            return
        pools = [self.pool, self._weights_pool] if self.group_rank == 0 else []
        self.client.free_when_all_arrive(self.pool.name + ".close", self.group_size, pools,
                                         min(self.timeout, 60.0), f"the hybrid group pool {self.pool.name}")
