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

The submit thread stages a bucket and waits until the node's ranks all have; the relay
thread (:meth:`HierarchicalSyncReducer._relay_loop`) sums and posts the writes of step 2
piece by piece, at most INFLIGHT_PIECES pieces per other server on their way at a time and the bucket the next
forward needs first (the highest index) first, contributes each piece to the servers' sum once
its writes are in and posts its reads as soon as that sum is there; the finish thread
completes step 3. So bucket k+1 goes up the link while bucket k comes down it, a bucket that
becomes ready later overtakes what is not posted yet of earlier ones (with
EDDIS_OVERLAP_FORWARD the first layers' updates are then in while the last layers' gradients
still cross the network), and a bucket's reads never wait until another is done on the
whole node. The math is that of one big batch:
``sum_j W_j (sum_{i in j} w_i g_i / W_j) / sum_j W_j``.
"""
import logging
import time
from collections import deque
from typing import NamedTuple

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
# a rank's writes on their way at once, in pieces per other server: two keep each connection busy
# while the relay goes round, and a bucket handed over later waits behind no more than that
INFLIGHT_PIECES = 2
# how long the relay drives the transport for a request before it looks for a newly summed bucket
RELAY_WAIT_S = 0.002


class _Write(NamedTuple):
    request: object
    nbytes: int


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
        self._inflight_bytes = INFLIGHT_PIECES * PIECE_BYTES * max(1, self.num_nodes - 1)
        self._spread_pieces = [0] * self.num_buckets   # finish thread: this step's pieces spread
        self._settling = {}                            # finish thread: bucket -> (done count, deadline)
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
        return generation, node_weight, weights

    def _relay_loop(self):
        """The relay: the node sums of the summed buckets' pieces onto the link, the servers'
        sum of each once its writes are in, its reads once that sum is there (to the finish
        thread). Of the buckets the submit thread handed over, the one the next forward needs
        first (the highest index: the plan runs backwards through the model) goes first,
        and at most INFLIGHT_PIECES pieces' bytes per other server are on their way at a
        time, so that a bucket that is ready later still overtakes the pieces of earlier ones
        not yet posted. A summed piece's reads wait while a bucket the forward needs sooner
        is still on its way up, so that the first layers' results come back first."""
        waiting = {}              # bucket -> [generation, node weight, weights, next piece]
        writing = deque()         # posted pieces: (bucket, piece, writes, bytes, generation, weight, posted)
        summing = deque()         # pieces in the servers' sum: (bucket, piece, request, generation, posted)
        summed = {}               # bucket -> [(piece, generation)] whose reads wait for a sooner bucket
        in_flight = 0
        while True:
            item = self._take_handed_over(bool(waiting or writing or summing or summed))
            if item is None:
                return
            if item:
                k, (generation, node_weight, weights) = item
                if self.shares[k].pieces:
                    waiting[k] = [generation, node_weight, weights, 0]
                else:   # no column of it is this rank's: only the node's done count
                    self._relayed.put((k, (None, generation, None)))
                continue   # every bucket handed over first: one of them may go before the others
            moved = False
            while waiting and in_flight < self._inflight_bytes:
                k = max(waiting)
                entry = waiting[k]
                i = entry[3]
                lo, hi = self.shares[k].pieces[i]
                writes = self._node_sum(k, lo, hi, entry[2])
                nbytes = sum(w.nbytes for w in writes)
                writing.append((k, i, [w.request for w in writes], nbytes, entry[0], entry[1],
                                timeline.now_ns()))
                in_flight += nbytes
                entry[3] += 1
                if entry[3] == len(self.shares[k].pieces):
                    del waiting[k]
                moved = True
            while writing and all(request.done() for request in writing[0][2]):
                k, i, requests, nbytes, generation, node_weight, posted = writing.popleft()
                for request in requests:
                    request.wait(self.timeout)   # done: its result, or its error
                if requests:
                    timeline.complete(timeline.PUSH, posted, args={"step": self.step, "bucket": k,
                                                                   "requests": len(requests)})
                in_flight -= nbytes
                lo, hi = self.shares[k].pieces[i]
                first = self.plan.buckets[k].start
                summing.append((k, i, self.inter_result[k].reduce_nb(
                    self.node, node_weight if self.op == "average" else 1.0, self.num_nodes, 0, self.step,
                    src_pool=self.inter[k], start=lo - first, count=hi - lo, average=self.op == "average"),
                    generation, timeline.now_ns()))
                moved = True
            while summing and summing[0][2].done():
                k, i, request, generation, _ = summing.popleft()
                self._wait_servers(request, k, f"node of {self.layout.nodes}")
                summed.setdefault(k, []).append((i, generation))
                moved = True
            if summed:
                rising = max((*waiting, *(w[0] for w in writing), *(s[0] for s in summing)), default=-1)
                for k in sorted((k for k in summed if k >= rising), reverse=True):
                    for i, generation in summed.pop(k):
                        lo, hi = self.shares[k].pieces[i]
                        self._relayed.put((k, (i, generation, self._fetch(k, lo, hi))))
                        moved = True
            if moved:
                continue
            self._check_deadlines(writing, summing)
            # nothing to post: drive the transport until the oldest request is done (waiting
            # drives it; a poll loop of done() left the link idle between polls and took CPU
            # from the training ranks), looking for a newly summed bucket now and then
            oldest = next((r for r in writing[0][2] if not r.done()), None) if writing else summing[0][2]
            if oldest is not None:
                oldest.wait_done(RELAY_WAIT_S)

    def _check_deadlines(self, writing, summing):
        """Nothing moved: a write or a servers' sum past EDDIS_COMM_TIMEOUT ends in its error."""
        now = timeline.now_ns()
        if writing and now - writing[0][6] > self.timeout * 1e9:
            for request in writing[0][2]:
                request.wait(0.001)
        if summing and now - summing[0][4] > self.timeout * 1e9:
            self._wait_servers(summing[0][2], summing[0][0], f"node of {self.layout.nodes}")

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
                    writes.append(_Write(inter.write_nb(sources[0][s:e], slot=self.node, start=start),
                                         sources[0][s:e].nbytes))
                    continue
                if mapped:
                    dst = inter.mapped_views(self.node, start, count)[0]
                else:
                    dst = self._outgoing[first + start:first + start + count]
                _vecops.weighted_sum(dst, [src[s:e] for src in sources], weights, dtype=wire,
                                     src_dtypes=dtypes)
                if not mapped:
                    writes.append(_Write(inter.write_nb(dst, slot=self.node, start=start), dst.nbytes))
        return writes

    def _finish(self, k, token):
        """A piece of bucket k read back: spread on the node. Once all of this rank's pieces of
        it are, the rank counts itself done; the bucket is the node's once every rank is
        (``_settle``: waited for there, so that the ranks of a node, which may take their
        buckets in another order, never wait on each other here)."""
        i, generation, fetch = token
        share = self.shares[k]
        if i is not None:
            lo, hi = share.pieces[i]
            self._spread(k, lo, hi, fetch)
            self._spread_pieces[k] += 1
        if i is None or self._spread_pieces[k] == len(share.pieces):
            self._spread_pieces[k] = 0
            share.done.add()
            self._settling[k] = (generation * len(self.members), time.monotonic() + self.timeout)
        return []

    def _unsettled(self):
        return bool(self._settling)

    def _settle(self):
        """The buckets whose node is done with them since the last look."""
        settled = []
        for k, (target, deadline) in list(self._settling.items()):
            done = self.shares[k].done
            if done.counter.read() < done.base + target:
                if time.monotonic() > deadline:
                    self._wait_count(done, target, f"bucket {k} (the node's other pieces)", timeout=0.001)
                continue
            del self._settling[k]
            if self.path != "slots":
                bucket = self.plan.buckets[k]
                lo, hi = bucket.start, bucket.start + bucket.count
                self.plan.buffer[lo:hi] = self._result[lo:hi]
            settled.append(k)
        return settled

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

