"""Mode ``hybrid``'s reducer: the sync reduction among the ranks of this rank's group, on a pool
per group (slots: one per member plus the result) that lives on the servers of the group's own
nodes, so that only the elastic exchanges (:mod:`eddis.core.hetero.hybrid`) cross between the
groups' nodes; with the same threads, bucket order, overlap and compression as every reducer.
When the group's pool is on one server that every member maps, the members sum in their slots,
as mode sync's ranks do on one node."""
import itertools
import logging

from ...smb.client import servers_on_hosts
from ..comm import collectives, elastic, runtime
from ..comm.groups import group_comm, group_ranks
from ..layout.buckets import column_share
from .slots import BucketShare, SlotReducer

log = logging.getLogger("eddis.core.hybrid")
_pool_ids = itertools.count()


class GroupSyncReducer(SlotReducer):
    """The sync reduction among the ranks of this rank's group (mode ``hybrid``)."""

    mode = "hybrid"

    def __init__(self, plan, compression="none", op="average", timeout=None, name="grads"):
        super().__init__(plan, compression, op, timeout, name)
        comm = group_comm()
        self.group = runtime.group()
        self.group_rank = comm.Get_rank()
        self.group_size = comm.Get_size()
        self.parties = group_ranks(comm)
        self.who = f" in hybrid group {self.group}"
        # one pool per group and instance; every member must get the same name
        instance = collectives.broadcast_object(next(_pool_ids), root=0, comm=comm,
                                                what="hybrid reducer set-up")
        self.alone = self.group_size == 1   # nothing to average: the gradients stay as they are
        self.servers = None if self.alone else self._group_servers(self.client, comm)
        if not self.alone and self._agree_in_slot(comm):
            self.path = "slots"
        self.pool_name = f"eddis.hybrid.{name}.{instance}.g{self.group}"
        # summed in the members' slots, the result needs no slot of its own
        self.pool = None if self.alone else self.client.pool(
            self.pool_name, plan.total, dtype=self.codec.smb_dtype,
            slots=self.group_size + (0 if self.path == "slots" else 1), servers=self.servers)
        self.result_slot = self.group_size
        self._generation = 0
        if self.path == "slots":
            self._sum_in_slots_state(comm)
        collectives.barrier(comm=comm, what="hybrid reducer set-up")
        self._start_threads()

    def _agree_in_slot(self, comm):
        """Whether the members sum in their slots (collective over the group), as mode sync's
        ranks do on one node: when the group's pool is on one server that every member maps,
        nothing is compressed and every member's buffer may move. Saves the server's round
        trip, the copy of each bucket into the slot and the read of the result."""
        servers = self.servers
        mine = (servers is not None and len(servers) == 1 and self.client.is_local(servers[0])
                and self.codec.is_identity and self.plan.movable)
        return all(collectives.allgather_object(mine, comm=comm, timeout=self.timeout,
                                                what="hybrid: may the group sum in its slots?"))

    def _sum_in_slots_state(self, comm):
        """The plan's buffer staged in this member's slot, the members' weights, and per bucket
        the arrival counters and this member's share of the columns in every slot (collective
        over the group)."""
        server = self.servers[0]
        w = self.group_size
        self._mapped_weights(self.pool_name + ".weights", w, servers=[server])
        self._stage_in_slot(self.pool.mapped_views(self.group_rank, 0, self.plan.total)[0])
        self.shares = []
        for k, bucket in enumerate(self.plan.buckets):
            lo, hi = column_share(bucket.start, bucket.count, self.group_rank, w)
            pieces = [(None, [self.pool.mapped_views(m, lo, hi - lo)[0] for m in range(w)])] if hi > lo else []
            self.shares.append(BucketShare(self.client, self.pool_name, k, server, pieces, hi - lo))
        self._agree_on_bases(comm=comm, who=f"hybrid group {self.group}: the members")
        log.info("hybrid group %d: the %d members sum the buckets in their slots", self.group, w)

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
        if self.shares is not None:
            self._publish_weight(self.group_rank)

    def _submit(self, k):
        if self.alone:
            return None
        if self.shares is not None:   # the bucket is in the slot already
            self.shares[k].arrived.add()
            return self._generation
        bucket = self.plan.buckets[k]
        self.pool.write(self._on_the_wire(k), slot=self.group_rank, start=bucket.start, timeout=self.timeout)
        average = self.op == "average"
        return self.pool.reduce_nb(self.group_rank, self._step_weight if average else 1.0,
                                   self.group_size, self.result_slot, self._generation,
                                   start=bucket.start, count=bucket.count, average=average)

    def _finish(self, k, request):
        if request is None:
            return
        if self.shares is not None:
            self._sum_share(k, request, self.group_rank, "group")
            return
        self._wait_servers(request, k, f"member of hybrid group {self.group}")
        self._read_result(k, self.pool, self.result_slot)

    def _release(self):
        """Free the group's pool once every member is done with it (an SMB barrier over the
        group: a member may still be reading its last result). Each optimizer has a pool
        of its own, so a job that builds several would otherwise fill the servers. Elastic
        runs keep it: a lost member never arrives, and the servers free it at the job's end."""
        self._leave_slot()
        if self.pool is None or elastic.requested("hybrid"):
            return
        pools = [self.pool, self._weights_pool] if self.group_rank == 0 else []
        self._free_when_all_arrive(self.pool.name + ".close", self.group_size, pools,
                                   f"the hybrid group pool {self.pool.name}")
