"""Mode ``sync`` across nodes: reduce inside each node, cross the network once per node.

With k nodes of r ranks, the flat path (every rank writes its whole bucket into
slots spread over all servers and reads the result back) sends about
``2 r (k-1)/k`` of the gradient bytes S each way over each node's link per step.
Here each way carries ``2 (k-1)/k`` S, whatever r is: the node's sum of the other
servers' columns goes out and their result comes back ((k-1)/k S each), and the
other nodes' sums of its own server's columns come in and their result goes out
(as much again). That is the least a bandwidth-optimal allreduce among k parties
sends; a ring over all n = k r ranks sends ``2 (n-1)/n`` S:

1. **On the node.** Each rank stages its bucket in its slot of a pool (in the plan's
   dtype: fp32, or fp64 for a float64 model) that
   lives only on its node's server (mapped memory: no network, no compression)
   and counts itself in on a node counter.
2. **Between nodes.** The columns each server holds of the bucket are cut into
   the same P pieces on every node (P: the most ranks any node has); a node's
   ranks share its pieces, so each has columns of the own server and of the
   others, and the node's ranks cross the link side by side. For each of
   its pieces a rank sums the node's slots with the ranks' sample weights (fp32
   accumulation, fp64 for fp64; written in the wire dtype) into the node's row of the *inter*
   pool, whose columns are spread over the nodes' servers: the columns the own
   server holds are written in place, the others are put to their servers. It
   then contributes the row to the servers' ``reduce`` with the node's total
   weight; each server averages the k node rows of its columns.
3. **Back on the node.** The rank reads its pieces of the result (the own
   server's columns from mapped memory, the others with one get each), widens
   them to the plan's dtype into the node's result (or straight into every local rank's
   slot, when the slots are the ranks' gradient buffers; with the wire in the plan's
   dtype the reads land there directly), counts itself done,
   and once the node's ranks are all done each rank has the whole bucket.

Each node goes through the servers starting from the one after its own
(:func:`visiting_order`), so that at each turn every server serves one node, and a
piece's reads go out as soon as the servers' sum of it is there, side by side with
the other pieces'.

The submit thread sums and posts the writes of step 2 (so bucket k+1 goes up the link
while bucket k comes down it), the relay thread waits for them, contributes to the servers'
sum and posts the reads of step 3 as soon as that sum is there, and the finish thread
completes step 3: a bucket's reads never wait until the one before is done on the whole
node. The math is that of one big batch:
``sum_j W_j (sum_{i in j} w_i g_i / W_j) / sum_j W_j``.
"""
import logging

import numpy as np

from ... import timeline
from ...errors import ConfigError
from ...smb import _vecops
from ...timeline.events import CAT_COMM
from ..comm import collectives, runtime
from ..layout.buckets import column_share
from .join_board import JoinBoard
from .slots import BucketShare, SlotReducer

log = logging.getLogger("eddis.core.sync")

# the most bytes of a bucket's piece (a node's sum of some of one server's columns): the unit
# that is put, summed by the servers and read back, each as soon as the one before allows
PIECE_BYTES = 4 << 20


def visiting_order(servers, own):
    """The order in which a node goes through the ``servers`` pieces of a bucket (one a
    server, in server order): its own (``own``) first, then the one after it, and so on
    around, so that when every node goes through its order together, each server serves
    one node at each turn."""
    return [(own + turn) % servers for turn in range(servers)]


class NodeLayout:
    """Where every rank and server is, as all ranks agreed (``gather``)."""

    def __init__(self, hosts, local_servers):
        self.hosts = list(hosts)
        self.nodes = list(dict.fromkeys(self.hosts))
        self.node_of = [self.nodes.index(h) for h in self.hosts]
        self.members = [[r for r, n in enumerate(self.node_of) if n == j] for j in range(len(self.nodes))]
        self.local_servers = [list(s) for s in local_servers]
        self.node_server = []
        self.problem = None
        for j, members in enumerate(self.members):
            seen = {tuple(self.local_servers[r]) for r in members}
            servers = self.local_servers[members[0]]
            if len(seen) != 1 or len(servers) != 1:
                self.problem = (f"node {self.nodes[j]} maps SMB servers {sorted(seen)}; the hierarchy "
                                "needs exactly one server on every node with ranks (the job script "
                                "starts one per node)")
                break
            self.node_server.append(servers[0])
        if self.problem is None and len(set(self.node_server)) != len(self.node_server):
            self.problem = f"two nodes claim the same SMB server ({self.node_server}); host names clash?"
        self.pieces = max(len(m) for m in self.members)

    @classmethod
    def gather(cls, client, timeout):
        everyone = collectives.allgather_object((runtime.hostname(), client.mapped_servers()), timeout=timeout,
                                                what="mode sync: which node and server is every rank on?")
        return cls([h for h, _ in everyone], [m for _, m in everyone])

    @property
    def num_nodes(self):
        return len(self.nodes)


class HierarchicalSyncReducer(SlotReducer):
    mode = "sync"
    WIRE_STAGING = False   # the node sums are converted to the wire dtype as they are written

    def __init__(self, plan, compression="none", op="average", timeout=None, name="grads", layout=None):
        super().__init__(plan, compression, op, timeout, name)
        if layout is None or layout.problem:
            raise ConfigError(f"hierarchical mode sync: {layout.problem if layout else 'no node layout'}")
        client = self.client
        # before this reducer's first collective (eddis.core.progress.join)
        self.join_board = JoinBoard(client, f"eddis.{name}", self.rank, self.size)
        self.layout = layout
        self.node = layout.node_of[self.rank]
        self.members = self.parties = layout.members[self.node]
        self.who = f" on node {layout.nodes[self.node]}"
        self.local = self.members.index(self.rank)
        self.server = layout.node_server[self.node]
        self.num_nodes = layout.num_nodes
        base = f"eddis.{name}"
        node = f"{base}.node{self.node}"
        wire = self.codec.smb_dtype
        r = len(self.members)
        # on the node: slots in the plan's dtype (no compression needed in memory) and the ranks' weights
        self.dtype = plan.dtype.name
        self.node_slots = client.pool(node + ".slots", plan.total, self.dtype, slots=r, servers=[self.server])
        self._mapped_weights(node + ".weights", r, servers=[self.server])
        # between the nodes, in the wire dtype, a pair of pools per bucket (a row per node, the
        # servers' result), so that every bucket is spread evenly over the nodes' servers: each
        # node's link then carries its share of every bucket in both directions at once
        servers = sorted(layout.node_server)
        self.inter = [client.pool(f"{base}.inter.{k}", b.count, wire, slots=self.num_nodes, servers=servers)
                      for k, b in enumerate(plan.buckets)]
        self.inter_result = [client.pool(f"{base}.inter.result.{k}", b.count, wire, slots=1, servers=servers)
                             for k, b in enumerate(plan.buckets)]
        self.wire_dtype = wire
        # the remote columns on their way up (submit thread) and down (finish thread)
        self._outgoing = np.empty(plan.total, dtype=self.inter[0].np_dtype)
        self._incoming = np.empty(plan.total, dtype=self.inter[0].np_dtype)
        # the node's ranks always sum (in the node's memory); in their slots when every buffer may move
        self.path = "slots" if self._agree_in_slot() else "ranks"
        self.node_result = None if self.path == "slots" else client.pool(
            node + ".result", plan.total, self.dtype, slots=1, servers=[self.server])
        self._slots = [self.node_slots.mapped_views(m, 0, plan.total)[0] for m in range(r)]
        self._result = None if self.path == "slots" else self.node_result.mapped_views(0, 0, plan.total)[0]
        self.shares = [BucketShare(client, node, k, self.server, self._my_pieces(k, layout.pieces, r))
                       for k in range(self.num_buckets)]
        self._agree_on_bases(members=self.members,
                             who=f"mode sync: the ranks of node {layout.nodes[self.node]}")
        if self.path == "slots":
            self._stage_in_slot(self._slots[self.local])
        log.info("mode sync: hierarchical over %d nodes (%d rank(s) on this node, %d pieces a bucket, "
                 "%s on the wire%s)", self.num_nodes, r, layout.pieces, wire,
                 ", in the ranks' slots" if self.path == "slots" else "")
        self._start_threads()

    def _agree_in_slot(self):
        everyone = collectives.allgather_object(self.plan.movable, timeout=self.timeout,
                                                what="mode sync: may every rank's buffer move?")
        return all(everyone)

    def _my_pieces(self, k, pieces, r):
        """This rank's pieces of bucket k: [(lo, hi)], in rounds: in each, a piece of every
        other node's server, then one of its own.

        Every server's columns of the bucket are cut into the same pieces on every node (P of
        them, times as many as keep each within PIECE_BYTES), so each rank of a node gets a
        share of the columns that cross the network and of those its own server holds: the
        node's ranks push and read their shares side by side, and a rank that is descheduled
        leaves the link to the others' transfers. (Cut the bucket as a whole into P pieces
        instead, and with 2 servers one rank of each node did all the network work and the
        other none.) Round j carries piece j of every server from every node at about the
        same time, so that each server has its first pieces from all nodes, sums them and
        serves their reads while the later ones are still on the link; a node's own piece
        closes its round, summed while the others' cross the link."""
        bucket = self.plan.buckets[k]
        segments = self.inter[k].layout(0, bucket.count)
        # every node visits the other servers starting from the one after its own, so that at
        # each turn each server serves one node: in server order, all nodes read from the same
        # server first while the others idle (at 4 x 1 the links carried 0.6 of their rate)
        own = next((i for i, (_, _, mapped) in enumerate(segments) if mapped),
                   min(sorted(self.layout.node_server).index(self.server), len(segments) - 1))
        itemsize = self.inter[k].np_dtype.itemsize
        order = visiting_order(len(segments), own)
        per_server = []
        for i in order[1:] + order[:1]:
            start, count, _ = segments[i]
            cuts = pieces * max(1, -(-count * itemsize // (pieces * PIECE_BYTES)))
            shares = (column_share(bucket.start + start, count, p, cuts) for p in range(self.local, cuts, r))
            per_server.append([(lo, hi) for lo, hi in shares if hi > lo])
        return [server[j] for j in range(max(map(len, per_server), default=0))
                for server in per_server if j < len(server)]

    # ------------------------------------------------------------ one step
    def _prepare_step(self):
        self._publish_weight(self.local)

    def _submit(self, k):
        bucket = self.plan.buckets[k]
        share = self.shares[k]
        if self.path != "slots":
            lo, hi = bucket.start, bucket.start + bucket.count
            self._slots[self.local][lo:hi] = self.plan.buffer[lo:hi]
        share.arrived.add()
        generation = self.step + 1
        self._wait_count(share.arrived, generation * len(self.members), f"bucket {k}")
        weights, node_weight = self._weighted(whole=False)   # a node whose ranks had no samples adds 0
        # every piece summed and on its way before the first wait: the local pieces are summed
        # while the remote ones cross the link, and the next bucket's while these do (_relay)
        posted = [self._node_sum(k, lo, hi, weights) for lo, hi in share.pieces]
        return generation, node_weight, posted

    def _relay(self, k, token):
        """Each piece into the servers' sum once its writes are in, and its reads out once the
        servers' sum is there: on a thread of its own (the base class's relay), so that neither
        the next bucket's sum and writes nor the reads of this one wait for the other."""
        generation, node_weight, posted = token
        share, first = self.shares[k], self.plan.buckets[k].start
        requests, fetched = [], []

        def fetch_summed(block):
            # each piece's reads go out as soon as its servers' sum is there, in order, side by
            # side with the other pieces' (one server at a time, a node's link carried 0.65 of
            # its rate at 4 x 1)
            while len(fetched) < len(requests) and (block or requests[len(fetched)].done()):
                lo, hi = share.pieces[len(fetched)]
                self._wait_servers(requests[len(fetched)], k, f"node of {self.layout.nodes}")
                fetched.append(self._fetch(k, lo, hi))

        for (lo, hi), writes in zip(share.pieces, posted):
            if writes:
                with timeline.span(timeline.PUSH, args={"step": self.step, "bucket": k, "requests": len(writes)}):
                    for request in writes:
                        request.wait(self.timeout)
            requests.append(self.inter_result[k].reduce_nb(
                self.node, node_weight if self.op == "average" else 1.0, self.num_nodes, 0, self.step,
                src_pool=self.inter[k], start=lo - first, count=hi - lo, average=self.op == "average"))
            fetch_summed(block=False)
        fetch_summed(block=True)
        return generation, fetched

    def _node_sum(self, k, lo, hi, weights):
        """The node's weighted sum of columns [lo, hi) into its row of the inter pool; returns
        the writes of the columns other servers hold (not waited for)."""
        sources = [slot[lo:hi] for slot in self._slots]
        dtypes = [self.dtype] * len(sources)
        wire, inter, first = self.wire_dtype, self.inter[k], self.plan.buckets[k].start
        # one rank with the node's whole weight and the wire in the plan's dtype: its sum is its
        # gradient, which goes to the other servers as it lies in its slot (no copy on the way)
        as_it_lies = len(sources) == 1 and weights[0] == 1.0 and wire == self.dtype
        writes = []
        with timeline.span(timeline.REDUCE, cat=CAT_COMM, args={"step": self.step, "bucket": k,
                                                                "count": hi - lo, "by": "node"}):
            for start, count, mapped in inter.layout(lo - first, hi - lo):
                s, e = start + first - lo, start + first - lo + count
                if as_it_lies and not mapped:
                    writes.append(inter.write_nb(sources[0][s:e], slot=self.node, start=start))
                    continue
                if mapped:
                    dst = inter.mapped_views(self.node, start, count)[0]
                else:
                    dst = self._outgoing[first + start:first + start + count]
                _vecops.weighted_sum(dst, [src[s:e] for src in sources], weights, dtype=wire,
                                     src_dtypes=dtypes)
                if not mapped:
                    writes.append(inter.write_nb(dst, slot=self.node, start=start))
        return writes

    def _finish(self, k, token):
        generation, fetched = token
        share = self.shares[k]
        for (lo, hi), fetch in zip(share.pieces, fetched):
            self._spread(k, lo, hi, fetch)
        share.done.add()
        self._wait_count(share.done, generation * len(self.members),
                         f"bucket {k} (the node's other pieces)")
        if self.path != "slots":
            bucket = self.plan.buckets[k]
            lo, hi = bucket.start, bucket.start + bucket.count
            self.plan.buffer[lo:hi] = self._result[lo:hi]

    def _target(self):
        """Where this rank puts the result: its slot (in slot), else the node's result."""
        return self._slots[self.local] if self.path == "slots" else self._result

    def _fetch(self, k, lo, hi):
        """Post the reads of columns [lo, hi) of the result that other servers hold; returns
        (reads, [(column, columns to widen into place)], when they were posted)."""
        target = self._target()
        result, first = self.inter_result[k], self.plan.buckets[k].start
        # the wire in the plan's dtype: the other servers' columns come straight into place
        as_they_are = self.wire_dtype == self.dtype
        posted = timeline.now_ns()
        reads, pieces = [], []
        for start, count, mapped in result.layout(lo - first, hi - lo):
            if mapped:
                pieces.append((first + start, result.mapped_views(0, start, count)[0]))
            elif as_they_are:
                reads.append(result.read_nb(out=target[first + start:first + start + count], slot=0,
                                            start=start))
            else:
                buf = self._incoming[first + start:first + start + count]
                reads.append(result.read_nb(out=buf, slot=0, start=start))
                pieces.append((first + start, buf))
        return reads, pieces, posted

    def _spread(self, k, lo, hi, fetch):
        """Columns [lo, hi) of the result, in the plan's dtype, where the node's ranks find them."""
        reads, pieces, posted = fetch
        target = self._target()
        for request in reads:
            request.wait(self.timeout)
        timeline.complete(timeline.PULL, posted, args={"step": self.step, "bucket": k, "count": hi - lo})
        for start, src in pieces:
            _vecops.convert(target[start:start + src.size], src, dst_dtype=self.dtype,
                            src_dtype=self.wire_dtype)
        if self.path == "slots":
            for m, slot in enumerate(self._slots):
                if m != self.local:
                    slot[lo:hi] = target[lo:hi]

    def _release(self):
        self._leave_slot()
        pools = [self.node_slots, self._weights_pool, self.node_result] if self.local == 0 else []
        if self.rank == 0:
            pools += self.inter + self.inter_result
        self._free_when_all_arrive(f"eddis.{self.name}.close", self.size, pools,
                                   f"the hierarchical sync pools eddis.{self.name}")

