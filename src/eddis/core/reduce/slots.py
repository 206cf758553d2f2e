"""The slot-reduction protocol: what every reducer through SMB does the same way.

Mode sync (the flat path and the hierarchy), mode hybrid's group reducer and sync's Adasum
all reduce through *slots*: every party of the reduction (all ranks, a node's or a group's)
writes its part of a bucket into its own slot of a pool and counts itself in on an SMB
counter, and the others wait for that count before they read. :class:`SlotReducer` holds
that protocol once:

- the counters (:class:`Count`): each counts from the value it had when the reducer set it
  up, since an earlier reducer of the same name may have left counts behind; the parties
  agree on those bases before anyone counts (:meth:`SlotReducer._agree_on_bases`);
- the timed wait on a count (:meth:`SlotReducer._wait_count`), whose timeout says who is
  missing: how many of which ranks arrived, and on which server the counter is
  (:func:`arrivals`); a counter counts, it does not say who, so the ranks named are the
  parties; and the wait for the servers' sum (:meth:`SlotReducer._wait_servers`), whose
  timeout names the servers;
- the parties' weights (sample counts) in mapped memory, and the sum of this party's share of
  a bucket's columns over every party's slot (:meth:`SlotReducer._sum_share`);
- *in slot*: when every party's slot is one piece of memory it maps, nothing is compressed
  and the plan's buffer may move, the buffer becomes the slot (no copy of the gradients into
  it), and the sums land in every slot; all parties or none, since an in-slot party leaves
  its share's sum in the slots only. At close the buffer moves back to private memory;
- the wire: a bucket compressed into the wire dtype on its way into a pool, and the result
  read back and widened (:meth:`SlotReducer._on_the_wire`, :meth:`SlotReducer._read_result`),
  each with its COMPRESS/DECOMPRESS span on the timeline.

The zero-total rule, one for every mode (:func:`eddis.core.reduce.base.check_total`): a step
whose weights add up to 0 over all its ranks (every rank contributed zero samples) has no
average, and its reduction raises a ConfigError (the servers refuse such a sum too). A part of
a step whose weights add up to 0 (a node of the hierarchy whose ranks all had no samples)
contributes nothing: its sum is zeros, with weight 0 in the whole (:meth:`SlotReducer._weighted`).
"""
import numpy as np

from ... import timeline
from ...errors import ConfigError, SMBTimeoutError
from ...smb import _core, _vecops
from ...timeline.events import CAT_COMM
from ..comm import collectives, connection
from .base import Reducer, check_total


def server_name(client, index):
    host = client.servers[index].get("hostname") if index < client.num_servers else None
    return f"smb-server {index}@{host}" if host else f"smb-server {index}"


def arrivals(client, counter, target, ranks):
    """Who a timed-out arrival counter was waiting for, from its value: 'k of the n ranks
    [...] arrived (counter on smb-server s@host): n - k missing'. The counter counts, it
    does not say who, so the ranks are those that take part."""
    where = server_name(client, counter.server)
    try:
        value = counter.read()
    except Exception:  # noqa: BLE001 - the server is gone: that is the answer
        return f"the arrival counter on {where} cannot be read any more (that server died?); ranks {ranks}"
    arrived = len(ranks) - max(0, target - value)
    return (f"{arrived} of the {len(ranks)} ranks {ranks} arrived (counter on {where}), "
            f"{len(ranks) - arrived} missing")


class Count:
    """An SMB counter counted from the value it had when the reducer set it up."""

    def __init__(self, client, name, server=None):
        self.counter = client.counter(name, server=server)
        self.base = self.counter.read()

    def add(self):
        self.counter.fetch_add(1)


class BucketShare:
    """One bucket of a reduction that the parties sum themselves: its arrival and done counts,
    and this party's share of it (``pieces``, ``count`` columns)."""

    def __init__(self, client, prefix, k, server, pieces, count=None):
        self.arrived = Count(client, f"{prefix}.arrived.{k}", server)
        self.done = Count(client, f"{prefix}.done.{k}", server)
        self.pieces = pieces
        self.count = count

    @property
    def bases(self):
        return self.arrived.base, self.done.base


class SlotReducer(Reducer):
    """Base of the reducers through SMB slots (see the module docstring). A subclass sets
    ``parties`` (the world ranks that count on its counters) and ``who`` (how a timeout names
    them, after the count), and ``path``: ``servers`` (the servers sum), ``ranks`` (the parties
    sum in mapped memory, into a result pool) or ``slots`` (they sum in their slots)."""

    WIRE_STAGING = True   # the buckets pass through a wire buffer when compressed

    def __init__(self, plan, compression="none", op="average", timeout=None, name="grads"):
        super().__init__(plan, compression, op, timeout, name)
        self.client = connection.smb_client()
        self.parties = list(range(self.size))
        self.who = ""
        self.path = "servers"
        self.shares = None          # per bucket, when the parties sum: BucketShare
        self._weights = None        # every party's weight of this step, in mapped memory
        self._weights_pool = None
        self._wire = None if self.codec.is_identity or not self.WIRE_STAGING else self.codec.empty(plan.total)

    @property
    def sums_in_slots(self):
        """True when the parties sum in their slots (no server round trip, no copy)."""
        return self.path == "slots"

    # ------------------------------------------------------------ counters
    def _agree_on_bases(self, comm=None, members=None, who="mode sync: the ranks"):
        """Collective over ``comm``: nobody counts before every party has read its counters'
        bases, and ``members`` (indices into ``comm``'s ranks: the parties) must have found the
        same ones, or two reducers of one name count on the same counters."""
        mine = [share.bases for share in self.shares]
        everyone = collectives.allgather_object(mine, comm=comm, timeout=self.timeout,
                                                what=f"{who}: the reduction counters' bases")
        if any(everyone[m] != mine for m in (range(len(everyone)) if members is None else members)):
            raise ConfigError(f"{who} found different reduction counters; two optimizers share the name "
                              f"{self.name!r} at once? Give each its own.")

    def _wait_count(self, count, target, what, ranks=None, timeout=None):
        """Wait until ``count`` reached ``target`` counts past its base; the timeout says how many
        of ``ranks`` (the parties) arrived. ``timeout``: what is left of EDDIS_COMM_TIMEOUT, where
        the caller polled the count for the rest of it."""
        try:
            count.counter.wait_for(count.base + target, self.timeout if timeout is None else timeout)
        except SMBTimeoutError as exc:
            ranks = self.parties if ranks is None else ranks
            raise SMBTimeoutError(
                f"step {self.step}: {what}: within {self.timeout:g} s only "
                f"{arrivals(self.client, count.counter, count.base + target, list(ranks))}{self.who} "
                "(a rank failed or is far slower; raise EDDIS_COMM_TIMEOUT if it is slow)", exc.code) from exc

    def _wait_servers(self, request, k, who):
        """Wait for the servers' sum of bucket ``k`` (a reduce request); its timeout names the
        servers waited for, and says that not every one of ``who`` contributed."""
        try:
            request.wait(self.timeout)
        except SMBTimeoutError as exc:
            raise SMBTimeoutError(
                f"step {self.step}, bucket {k}: not every {who} contributed within {self.timeout:g} s "
                f"({exc.message}; one failed or is far slower; raise EDDIS_COMM_TIMEOUT if it is slow)",
                exc.code) from exc

    # ------------------------------------------------------------ weights
    def _mapped_weights(self, name, parties, length=1, servers=None):
        """Every party's weight of the step, in mapped memory (column 0 of its slot)."""
        self._weights_pool = self.client.pool(name, length, "float64", slots=parties, servers=servers)
        self._weights = [self._weights_pool.mapped_views(m, 0, 1)[0] for m in range(parties)]

    def _publish_weight(self, index):
        """This party's weight of the step, read by the others once they saw it arrive."""
        self._weights[index][0] = self._step_weight if self.op == "average" else 1.0

    def _weighted(self, whole=True):
        """The parties' weights as the sum applies them, and their total (op=average: divided by
        it). ``whole``: these are all the weights of the step (the zero-total rule raises);
        else a part of it, which contributes nothing when its total is 0."""
        weights = np.array([w[0] for w in self._weights])
        total = float(weights.sum())
        if self.op == "average":
            if whole:
                check_total(total, self.step, f"the {len(weights)} ranks {list(self.parties)}")
            weights = weights / total if total > 0 else np.zeros_like(weights)
        return weights, total

    # ------------------------------------------------------------ the parties' sum
    def _sum_share(self, k, generation, index, by):
        """Bucket ``k`` summed by the parties on this one's thread: wait until all arrived, sum
        this party's share of the columns weighted by the parties' weights, count in as done and
        wait for the others' shares. A share's ``pieces`` hold, per server piece of it, (result
        view or None, [the share's view in slot 0, ..., slot W-1]). In slot: the sum goes into
        this party's own slot, then into the same columns of every other slot (nobody else
        writes them), so every slot ends with the whole result. Returns the parties' weights
        added up."""
        share = self.shares[k]
        parties = len(self._weights)
        self._wait_count(share.arrived, generation * parties, f"bucket {k}")
        weights, total = self._weighted()
        dtype = self.codec.smb_dtype
        in_slot = self.path == "slots"
        # the event the server records for its sum, here on the rank's own thread: comm, not server
        with timeline.span(timeline.REDUCE, cat=CAT_COMM, args={"step": self.step, "bucket": k,
                                                                "count": share.count, "by": by}):
            for dst, sources in share.pieces:
                if in_slot:
                    dst = sources[index]
                _vecops.weighted_sum(dst, sources, weights, dtype=dtype, src_dtypes=[dtype] * len(sources))
                if in_slot:
                    for r, other in enumerate(sources):
                        if r != index:  # GIL released: the other threads go on meanwhile
                            _core.memcpy_nogil(other.ctypes.data, dst.ctypes.data, dst.nbytes)
        share.done.add()
        self._wait_count(share.done, generation * parties, f"bucket {k} (the others' shares)")
        return total

    # ------------------------------------------------------------ in slot
    def _stage_in_slot(self, view):
        """Make ``view`` (this party's slot, mapped) the plan's buffer: saves a copy of every
        bucket into it."""
        view[...] = self.plan.buffer
        self.plan.use_buffer(view, movable=True)

    def _leave_slot(self):
        """At close: the framework's gradients may still point into the slot, which the client
        unmaps at shutdown: the buffer moves back to private memory, with its contents."""
        if self.path == "slots":
            self.plan.use_buffer(self.plan.buffer.copy(), movable=True)

    # ------------------------------------------------------------ the wire
    def _on_the_wire(self, k):
        """Bucket k as it goes into the pools: the plan's own view, or compressed into the wire
        buffer (the codec's, over the whole plan)."""
        view = self.plan.bucket_view(k)
        if self.codec.is_identity:
            return view
        with timeline.span(timeline.COMPRESS, args={"step": self.step, "bucket": k, "bytes": view.nbytes}):
            return self.codec.compress(view, out=self.plan.bucket_view(k, self._wire))

    def _read_result(self, k, pool, slot=0):
        """Bucket k of the result (``slot`` of ``pool``) into the plan's buffer, through the wire
        buffer and the codec when the pool holds half precision."""
        view = self.plan.bucket_view(k)
        start = self.plan.buckets[k].start
        if self.codec.is_identity:
            pool.read(out=view, slot=slot, start=start, timeout=self.timeout)
            return
        staged = self.plan.bucket_view(k, self._wire)
        pool.read(out=staged, slot=slot, start=start, timeout=self.timeout)
        with timeline.span(timeline.DECOMPRESS,
                           args={"step": self.step, "bucket": k, "bytes": staged.nbytes}):
            self.codec.decompress(staged, view)

    # ------------------------------------------------------------ the end
    def _free_when_all_arrive(self, name, parties, pools, what):
        """Free ``pools`` (the first party passes them, the others none) once the ``parties``
        are all done with them: an SMB barrier, so a missing one costs a bounded wait and never
        poisons MPI."""
        self.client.free_when_all_arrive(name, parties, pools, min(self.timeout, 60.0), what)
