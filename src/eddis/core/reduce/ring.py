"""Mode ``sync`` at one rank a node: a ring across the nodes, through their SMB servers.

With one rank on each of n nodes there is nothing to sum on a node, and the hierarchy's
mesh (every node puts a share of its sum to every other server and reads it back) has each
node take in from n - 1 senders at once. A ring sends the same ``2 (n-1)/n`` S each way and
link, but each link carries one stream: node i only ever writes to node i+1's server.

A bucket is cut into n chunks. In each of ``2 (n-1)`` ring steps a node sends one chunk, in
pieces, into its *inbox* on the next node's server (a region per ring step, so nothing a
node still reads is written over), each write counted in on that server's arrival counter
once its data landed (the server counts on the write's last request); the next node reads
the piece from its server's mapped memory:

- steps 0 .. n-2 (reduce-scatter): the piece received plus the node's own gradient of it,
  weighted by its share of the step's samples, goes on; at step n-1 the piece holds every
  node's share and is the result of that chunk;
- steps n-1 .. 2n-3 (allgather): the result goes round until every node has every chunk.

Every node ends with the same bytes: the sums are written in the wire dtype before they are
sent on, and the node that completes a chunk keeps that rounded sum, not its own fp32 one.

A region of an inbox is never written over while it is read: bucket k's step s of the next
training step needs, for s < n-1, the n-1 nodes before this one to have finished this step,
for which this node has passed on every chunk it completed, that is read every region of the
reduce-scatter; for s >= n-1 it needs this node's own contribution of the next step.

The submit thread publishes the node's weight at the step's first bucket; the relay thread
(:meth:`RingSyncReducer._relay_loop`) runs every bucket's ring steps, the bucket the next
forward needs first (the highest index) first, with at most INFLIGHT_PIECES writes on
their way, and hands a bucket to the finish thread once its last piece is in and its own
writes are done.
"""
import logging
import time
from collections import deque

import numpy as np

from ... import timeline
from ...errors import ConfigError, SMBTimeoutError
from ...smb import _vecops
from ...timeline.events import CAT_COMM
from ..comm import collectives
from .base import check_total
from .join_board import JoinBoard
from .slots import SlotReducer, server_name

log = logging.getLogger("eddis.core.sync")

# a piece is the unit a node writes into the next node's inbox and counts in: a chunk is cut
# into PIECES_PER_CHUNK of them, so that the next ring step's first pieces go out while the
# last ones of this step still cross the link, unless that makes them smaller than
# MIN_PIECE_BYTES (a piece's round trips would then cost more than its bytes); never larger
# than PIECE_BYTES
PIECE_BYTES = 4 << 20
MIN_PIECE_BYTES = 128 << 10
PIECES_PER_CHUNK = 8
# writes on their way to the next node at once: enough to keep its connection busy while
# the relay adds the next piece
INFLIGHT_PIECES = 4
# how long the relay drives the transport before it looks at the arrivals again
RELAY_POLL_S = 0.0005
# with nothing on its way: the relay's first and longest sleep between looks at the arrivals
IDLE_PAUSE_S = (0.0001, 0.0005)


def piece_length(count, n, itemsize):
    """The elements of a piece of a bucket of ``count`` elements in a ring of ``n`` nodes."""
    chunk = -(-count // n)
    wanted = max(-(-chunk // PIECES_PER_CHUNK), MIN_PIECE_BYTES // itemsize)
    return max(1, min(wanted, PIECE_BYTES // itemsize))


def ring_problem(layout):
    """Why the ``layout`` (a NodeLayout) cannot run the ring, or None."""
    if layout.problem:
        return layout.problem
    if layout.pieces != 1:
        crowded = [layout.nodes[j] for j, m in enumerate(layout.members) if len(m) > 1]
        return (f"the ring takes one rank a node, and node(s) {crowded} have more (use "
                "EDDIS_SYNC_REDUCE=hierarchical there)")
    if layout.num_nodes < 2:
        return "the ring needs ranks on at least 2 nodes"
    return None


class RingSchedule:
    """Which pieces of a bucket of ``count`` elements node ``node`` of ``n`` handles at each
    ring step, and where they lie in an inbox (a pure function of its arguments)."""

    def __init__(self, count, n, node, piece):
        self.node = node
        self.chunk = max(1, -(-count // n))
        self.steps = 2 * (n - 1)
        self.pieces = []   # per chunk: [(lo, hi)] within the bucket, at most ``piece`` long
        for j in range(n):
            lo, hi = min(j * self.chunk, count), min((j + 1) * self.chunk, count)
            self.pieces.append([(a, min(hi, a + piece)) for a in range(lo, hi, piece)])
        # the chunk this node takes on at ring step s (sends at s < steps, keeps at the last)
        self.chunk_at = [(node - s) % n for s in range(self.steps + 1)]
        received = [(node - 1 - s) % n for s in range(self.steps)]   # what lands in region s
        # pieces that land in the inbox before region s (and all of a training step's, last)
        self.before = np.cumsum([0] + [len(self.pieces[j]) for j in received]).tolist()
        self.per_step = self.before[-1]

    def region(self, s, j, lo, hi):
        """Where piece [lo, hi) of chunk j lies in ring step s's region of an inbox."""
        at = s * self.chunk + lo - j * self.chunk
        return at, at + hi - lo


class _Bucket(RingSchedule):
    """One bucket's ring: its schedule, inbox and counters, and this step's cursor."""

    def __init__(self, client, prefix, k, bucket, n, node, servers, wire, piece):
        super().__init__(bucket.count, n, node, piece)
        self.k = k
        me, after = node, (node + 1) % n
        length = self.steps * self.chunk
        self.inbox = client.pool(f"{prefix}.{k}.{me}", length, wire, servers=[servers[me]])
        self.ahead = client.pool(f"{prefix}.{k}.{after}", length, wire, servers=[servers[after]])
        self.arrived = client.counter(f"{prefix}.{k}.arrived.{me}", server=servers[me])
        self.announce = client.counter(f"{prefix}.{k}.arrived.{after}", server=servers[after])
        self.base = self.arrived.read()
        self.received = self.inbox.mapped_views(0, 0, length)[0]
        # this step: the generation, the ring step and piece next, writes not done, since when
        self.generation = 0
        self.step = 0
        self.piece = 0
        self.unfinished = 0
        self.since = 0.0

    def start(self, generation):
        self.generation, self.step, self.piece, self.since = generation, 0, 0, time.monotonic()

    @property
    def sent_all(self):
        return self.step > self.steps

    def current(self):
        """(chunk, (lo, hi)) of the piece next, moving past chunks that have none."""
        while not self.sent_all:
            j = self.chunk_at[self.step]
            if self.piece < len(self.pieces[j]):
                return j, self.pieces[j][self.piece]
            self.step, self.piece = self.step + 1, 0
            self.since = time.monotonic()
        return None, None

    def needed(self):
        """The arrival count the piece next waits for (steps >= 1 take a piece from the node before)."""
        return self.base + (self.generation - 1) * self.per_step + self.before[self.step - 1] + self.piece + 1


class RingSyncReducer(SlotReducer):
    mode = "sync"
    WIRE_STAGING = False   # the pieces are converted to the wire dtype as they are summed

    def __init__(self, plan, compression="none", op="average", timeout=None, name="grads", layout=None):
        super().__init__(plan, compression, op, timeout, name)
        problem = ring_problem(layout) if layout is not None else "no node layout"
        if problem:
            raise ConfigError(f"mode sync's ring: {problem}")
        client = self.client
        self.join_board = JoinBoard(client, f"eddis.{name}", self.rank, self.size)  # before a collective
        self.layout = layout
        self.node = layout.node_of[self.rank]
        self.num_nodes = n = layout.num_nodes
        servers = layout.node_server
        self.before_node = layout.nodes[(self.node - 1) % n]
        self.after_node = layout.nodes[(self.node + 1) % n]
        self.dtype = plan.dtype.name
        wire = self.wire_dtype = self.codec.smb_dtype
        prefix = f"eddis.{name}.ring"
        self.buckets = [_Bucket(client, prefix, k, b, n, self.node, servers, wire,
                                piece_length(b.count, n, self.codec.itemsize))
                        for k, b in enumerate(plan.buckets)]
        # the sums on their way to the next node, each where its chunk lies in the bucket
        self._outgoing = np.empty(plan.total, dtype=self.buckets[0].inbox.np_dtype)
        # every node's weight of the step, on the first node's server
        self._weights_pool = client.pool(f"{prefix}.weights", 2 * n, "float64", servers=[servers[0]])
        self._totals = {}         # generation -> every node's weight added up
        self._last_total = None   # the total weight of the last step, every node's guess of this one's
        # every base read before any node counts on the counters
        collectives.barrier(timeout=self.timeout, what="mode sync's ring: counters read")
        log.info("mode sync: a ring over %d nodes, one rank each (%s on the wire)", n, wire)
        self._start_threads()

    # ------------------------------------------------------------ one step
    def _prepare_step(self):
        generation = self.step + 1
        if self.op == "average":
            # the last step's total, every node's guess of this one's (read here where no piece of
            # the last step held every node's contribution)
            self._last_total = self._total_of(generation - 1) if generation > 1 else None
        weight = self._step_weight if self.op == "average" else 1.0
        # two steps' weights side by side: a node a step ahead writes the other half
        self._weights_pool.write(np.array([weight], dtype=np.float64), start=generation % 2 * self.num_nodes
                                 + self.node, timeout=self.timeout)

    def _submit(self, k):
        return self.step + 1

    def _factor(self):
        """This node's factor in the sums on the way (op=average: its weight over the last
        step's total, the same guess on every node; the first step guesses the number of
        nodes): known without waiting for the others, and of the size of an average, so that
        half-precision partial sums stay in range."""
        if self.op != "average":
            return 1.0
        return self._step_weight / (self._last_total or self.num_nodes)

    def _correction(self, generation):
        """What turns the sum of the factors' products into the step's average: the guessed
        total over the true one. Called with a piece that holds every node's contribution,
        each sent after its node's weight was written: all weights of the step are in."""
        if self.op != "average":
            return 1.0
        return (self._last_total or self.num_nodes) / self._total_of(generation)

    def _total_of(self, generation):
        """Every node's weight of step ``generation`` added up (the weights are all in)."""
        if self._totals.get(generation) is None:
            n = self.num_nodes
            weights = self._weights_pool.read(start=generation % 2 * n, count=n, timeout=self.timeout)
            total = float(weights.sum())
            check_total(total, generation - 1, f"the {n} ranks {list(range(self.size))}")
            self._totals = {generation: total}
            self.total_weight = total
        return self._totals[generation]

    def _relay_loop(self):
        """Every handed-over bucket's ring steps, piece by piece (module docstring)."""
        active = {}        # bucket -> its _Bucket, this step
        writes = deque()   # (bucket, request, posted): counted writes
        pause = IDLE_PAUSE_S[0]
        while True:
            item = self._take_handed_over(bool(active or writes))
            if item is None:
                return
            if item:
                k, generation = item
                self.buckets[k].start(generation)
                active[k] = self.buckets[k]
                continue
            moved = False
            while writes and writes[0][1].done():
                k, request, posted = writes.popleft()
                request.wait(self.timeout)   # done: its result, or its error
                timeline.complete(timeline.PUSH, posted, args={"step": self.step, "bucket": k})
                self.buckets[k].unfinished -= 1
                moved = True
            for k in sorted(active, reverse=True):
                ring = active[k]
                while self._advance(ring, writes):
                    moved = True
                if ring.sent_all and not ring.unfinished:
                    del active[k]
                    self._relayed.put((k, None))
                    moved = True
            if moved:
                pause = IDLE_PAUSE_S[0]
                continue
            self._check_deadlines(active, writes)
            if writes:
                writes[0][1].wait_done(RELAY_POLL_S)
            elif active:
                # only pieces from the node before to wait for: back off while none come (a node
                # still in its backward), and take up a burst's next piece soon after the last
                time.sleep(pause)
                pause = min(2 * pause, IDLE_PAUSE_S[1])

    def _advance(self, ring, writes):
        """Take bucket ``ring``'s next piece one ring step on, if what it needs is in; posts
        its write to the next node (appended to ``writes``). False when it must wait."""
        j, span = ring.current()
        if j is None:
            return False
        s, (lo, hi) = ring.step, span
        if s < ring.steps and len(writes) >= INFLIGHT_PIECES:
            return False
        if s > 0 and ring.arrived.peek() < ring.needed():
            return False
        k, first = ring.k, self.plan.buckets[ring.k].start
        mine = self.plan.buffer[first + lo:first + hi]
        n = self.num_nodes
        if s > 0:
            a, b = ring.region(s - 1, j, lo, hi)
            incoming = ring.received[a:b]
        with timeline.span(timeline.REDUCE, cat=CAT_COMM, args={"step": self.step, "bucket": k,
                                                                "count": hi - lo, "by": "ring"}):
            if s < n:   # reduce-scatter: add this node's share of the piece
                out = self._outgoing[first + lo:first + hi]
                sources, weights = [mine], [self._factor()]
                dtypes = [self.dtype]
                if s > 0:
                    sources, weights, dtypes = [incoming, mine], [1.0, weights[0]], [self.wire_dtype, self.dtype]
                if s == n - 1:   # the whole sum: the step's average
                    correction = self._correction(ring.generation)
                    weights = [w * correction for w in weights]
                _vecops.weighted_sum(out, sources, weights, dtype=self.wire_dtype, src_dtypes=dtypes)
            else:
                out = incoming
            if s >= n - 1:   # the piece of the result: every node keeps the same rounded sum
                _vecops.convert(mine, out, dst_dtype=self.dtype, src_dtype=self.wire_dtype)
        if s < ring.steps:
            a, b = ring.region(s, j, lo, hi)
            writes.append((k, ring.ahead.write_nb(out, start=a, count_in=ring.announce), timeline.now_ns()))
            ring.unfinished += 1
        ring.piece += 1
        ring.since = time.monotonic()
        return True

    def _check_deadlines(self, active, writes):
        """Nothing moved: a counted write or an awaited piece past EDDIS_COMM_TIMEOUT ends in
        its error."""
        if writes and timeline.now_ns() - writes[0][2] > self.timeout * 1e9:
            try:
                # done meanwhile: its outcome; else given up, as any timed-out transfer is
                writes[0][1].wait(0.001)
            except SMBTimeoutError as error:
                raise SMBTimeoutError(
                    f"step {self.step}: mode sync's ring: the smb-server of node {self.after_node} took "
                    f"no piece of this node in (written and counted) within {self.timeout:g} s; that "
                    "server is lost or overloaded (raise EDDIS_COMM_TIMEOUT if it is slow)") from error
        now = time.monotonic()
        for ring in active.values():
            if now - ring.since > self.timeout:
                raise SMBTimeoutError(
                    f"step {self.step}, bucket {ring.k}: mode sync's ring: node {self.before_node} sent "
                    f"no piece of ring step {ring.step} within {self.timeout:g} s ({ring.arrived.read() - ring.base} "
                    f"arrived in all, counter on {server_name(self.client, ring.arrived.server)}; that "
                    "node's rank, or one before it in the ring, failed or is far slower; raise "
                    "EDDIS_COMM_TIMEOUT if it is slow)")

    def _release(self):
        pools = [ring.inbox for ring in self.buckets]
        if self.rank == 0:
            pools.append(self._weights_pool)
        self._free_when_all_arrive(f"eddis.{self.name}.ring.close", self.size, pools,
                                   f"the ring pools eddis.{self.name}.ring")
