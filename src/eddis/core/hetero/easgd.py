"""Mode ``easgd``: asynchronous elastic averaging SGD through the SMB pool.

Every worker trains on its own data with its own (local) optimizer; nothing
waits for anyone. The *centre variable* x~ lives in an SMB pool (slot 0; the
pool is partitioned over all servers). Every ``tau`` local steps a worker
does one exchange (Zhang, Choromanska and LeCun, "Deep learning with Elastic
Averaging SGD", 2015, asynchronous variant)::

    x~_seen = read(centre)                 # may interleave with other workers' updates
    d = pull (x - x~_seen)                 # pull = alpha for workers of equal speed
    x = x - d                              # the worker moves towards the centre
    centre += (push / pull) d              # server-side axpy: write d into this worker's
                                           # slot, then pool.axpy(0, my_slot, push / pull)

The axpy runs on the servers, one request per server shard, each applied
atomically in its server's request loop: concurrent exchanges of several workers
serialize per shard and none is lost. A worker does not wait for its axpy to
finish: it completes in the background and is waited for at the start of the
next exchange (so the next read sees this worker's own update). Reads of the
centre are not atomic across shards, which EASGD tolerates (as Hogwild does).

Workers of different speed (EDDIS_EASGD_WEIGHTING=throughput, the default). Plain
EASGD moves worker and centre by the same ``d``, so every worker pulls the centre
alike per exchange: a slow worker drags it back towards its older parameters
as hard as a fast one pushes it on, and the fast workers are pulled back with
it. Here each worker has a *mass*, its measured throughput (iterations per
second: its steps between two exchanges over the time they took, smoothed)
over the mean of all workers' (published in a small SMB pool), and the move is
split as between two bodies joined by a spring: the gap ``x - x~`` still closes
by ``2 alpha`` per exchange, but ``pull = 2 alpha / (1 + mass)`` of it is the
worker's move and ``push = 2 alpha mass / (1 + mass)`` the centre's (each at
most 1). So the centre follows the workers in proportion to the data they
process, as one global batch would weight it; with equal speeds (or
EDDIS_EASGD_WEIGHTING=equal, or before a worker has measured itself) the mass is
1 and this is plain EASGD. Measured (``bench/hetero.py``, hybrid,
{1,1,2,3}): the fast group reached the target loss 1.2x sooner, centre
accuracy unchanged.

Defaults (EDDIS_EASGD_TAU, EDDIS_EASGD_ALPHA). ``tau = 4``: the paper found
communication periods up to about 10 cost little accuracy, and 4 cuts the
exchange traffic to a quarter of per-step averaging while keeping the workers
close; ``alpha = 0.9 / p`` for p exchanging workers, the paper's recommended
``beta = p alpha = 0.9``, which keeps the centre's total pull per round below 1
so it neither lags the workers nor oscillates.

Overlapped exchanges (EDDIS_EASGD_OVERLAP, :meth:`ElasticAverager.start_exchange`): the
exchange runs in a thread of its own on a copy of the parameters, so the next step computes
while the centre is read and moved; the caller applies the move (:meth:`take_move`) after that
step, one step stale (``eddis.core.hetero.averaging.ElasticAveraging.exchange_flat``). They are striped: after
step t the worker exchanges only :meth:`stripe` ``(t)``, the ``t mod tau``-th of ``tau`` equal
parts of every server's piece of the vector, so every coordinate is still exchanged once every
``tau`` steps, and what
crosses the network per step is a ``tau``-th of a whole exchange, small enough to hide behind
one step (a whole exchange every ``tau`` steps, hidden behind one step only, left the rest of
its transfer to wait for).

The final model is the centre: ``read_center()`` after every worker did its
last exchange (``eddis.save_checkpoint`` does that).

    averager = ElasticAverager(client, length, worker=r, workers=W, name="eddis.easgd.1")
    if r == 0: averager.initialize(x)          # then a barrier before any exchange
    if averager.due(step): averager.exchange(x)
    averager.finish()                          # wait for the last axpy
"""
import threading
import time

import numpy as np

from ... import settings, timeline
from ...errors import ConfigError, SMBTimeoutError, UsageError

WEIGHTINGS = ("throughput", "equal")
RATE_SMOOTHING = 0.25   # weight of the newest interval in a worker's measured throughput


class ElasticAverager:
    """A worker's side of EASGD over a flat float32 parameter vector."""

    def __init__(self, client, length, worker, workers, tau=None, alpha=None, name="eddis.easgd",
                 timeout=None, iterations_per_step=1, weighting=None, mirrored=False):
        """``mirrored``: the centre and the throughputs on two servers each (elastic runs,
        :mod:`eddis.smb.mirror`), so that they outlive a lost smb-server."""
        self.length = int(length)
        self.worker = int(worker)
        self.workers = int(workers)
        if not 0 <= self.worker < self.workers:
            raise ConfigError(f"EASGD worker index {worker} outside 0..{workers - 1}")
        self.tau = settings.get("EDDIS_EASGD_TAU") if tau is None else int(tau)
        if self.tau < 1:
            raise ConfigError(f"EDDIS_EASGD_TAU must be >= 1 (steps between exchanges), got {self.tau}")
        if alpha is None:
            alpha = settings.get("EDDIS_EASGD_ALPHA")
        self.alpha = 0.9 / self.workers if alpha is None else float(alpha)
        if not 0.0 < self.alpha <= 1.0:
            raise ConfigError(f"EDDIS_EASGD_ALPHA must be in (0, 1], got {self.alpha}; the default is "
                              f"0.9 / workers = {0.9 / self.workers:g}")
        self.weighting = str(settings.get("EDDIS_EASGD_WEIGHTING") if weighting is None else weighting)
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(f"EDDIS_EASGD_WEIGHTING must be one of {', '.join(WEIGHTINGS)}, "
                              f"got {self.weighting!r}")
        self.iterations_per_step = int(iterations_per_step)
        self.timeout = timeout
        self.name = name
        self.pool = client.pool(name, self.length, dtype="float32", slots=1 + self.workers, mirrored=mirrored)
        # the exchange's bytes as the timeline counts them; a mirrored pool takes the move twice
        self.exchange_bytes = (4 if mirrored else 3) * self.length * 4
        # every worker's throughput, iterations/s (0: not measured yet)
        self.rates = None if self.weighting == "equal" else client.pool(
            f"{name}.rates", self.workers, dtype="float64", slots=1, mirrored=mirrored)
        self._rates = np.zeros(self.workers, dtype=np.float64)
        self.rate = 0.0
        self.mass = 1.0
        self._last_exchange = None
        self.center = np.empty(self.length, dtype=np.float32)
        self.scratch = np.empty(self.length, dtype=np.float32)   # d of the last exchange
        self._pending = None   # the axpy requests of the last exchange
        self._stripes = self._cut_stripes()
        self.exchanges = 0
        self.seconds = 0.0
        # EDDIS_EASGD_OVERLAP: the exchange in a thread of its own, on a copy of the parameters
        self._snapshot = None
        self._thread = None
        self._move = None
        self._error = None

    @property
    def my_slot(self):
        return 1 + self.worker

    def initialize(self, x):
        """Set the centre to ``x`` (one worker does it, before any exchange)."""
        self.pool.write(np.ascontiguousarray(x, dtype=np.float32), slot=0, timeout=self.timeout)

    def due(self, step):
        """True after local step ``step`` (0-based) when an exchange is due."""
        return (int(step) + 1) % self.tau == 0

    @property
    def pull(self):
        """Share of ``x - centre`` the worker moves (``alpha`` at mass 1)."""
        return min(1.0, 2.0 * self.alpha / (1.0 + self.mass))

    @property
    def push(self):
        """Share of ``x - centre`` the centre moves (``alpha`` at mass 1)."""
        return min(1.0, 2.0 * self.alpha * self.mass / (1.0 + self.mass))

    def _weigh(self, now):
        """Measure this worker's throughput since the last exchange; publish it and
        derive the mass from everyone's."""
        last, self._last_exchange = self._last_exchange, now
        if self.rates is None or last is None or now <= last:
            return
        rate = self.tau * self.iterations_per_step / (now - last)
        self.rate = rate if self.rate == 0.0 else (1.0 - RATE_SMOOTHING) * self.rate + RATE_SMOOTHING * rate
        self._rates[:1] = self.rate
        self.rates.write(self._rates[:1], slot=0, start=self.worker, timeout=self.timeout)
        self.rates.read(out=self._rates, slot=0, timeout=self.timeout)
        known = self._rates[self._rates > 0]
        self.mass = self.rate / known.mean() if known.size else 1.0

    def stripe(self, step):
        """``[(start, count), ...]``: the part of the vector a striped exchange after local step
        ``step`` moves, the ``step mod tau``-th of ``tau`` parts of (nearly) equal length, cut
        from every server's piece of the centre alike: each exchange then reads and writes
        every server, and the links between nodes carry a share of each, every step (stripes
        of whole server pieces crossed one link after another, each for several steps)."""
        return self._stripes[int(step) % self.tau]

    def _cut_stripes(self):
        """The ``tau`` stripes: stripe i is the i-th ``tau``-th of every server's piece."""
        # a mirrored pool (elastic runs) keeps each element on two servers: no one piece each
        layout = getattr(self.pool, "layout", None)
        pieces = [(start, count) for start, count, _ in layout()] if layout is not None else [(0, self.length)]
        stripes = [[] for _ in range(self.tau)]
        for start, count in pieces:
            bounds = [start + count * i // self.tau for i in range(self.tau + 1)]
            for stripe, lo, hi in zip(stripes, bounds, bounds[1:]):
                if lo < hi:
                    stripe.append((lo, hi - lo))
        return stripes

    def exchange(self, x, measure=True, part=None):
        """One elastic exchange; moves ``x`` (flat float32, in place) and the centre.
        Returns the worker's move ``d`` (valid until the next exchange).
        ``measure=False``: not ``tau`` steps since the last exchange (the final one),
        so the time since then is no measure of this worker's throughput.
        ``part``: a :meth:`stripe`, only those ranges of ``x`` and the centre (the throughput
        is measured at the first stripe, once every ``tau`` steps); the move returned is
        then a list of views of ``d``, one per range."""
        ranges = [(0, self.length)] if part is None else [(int(lo), int(n)) for lo, n in part]
        size = sum(n for _, n in ranges)
        start = time.perf_counter()
        with timeline.span(timeline.EASGD_EXCHANGE,
                           args={"bytes": self.exchange_bytes * size // max(1, self.length), "worker": self.worker}):
            if measure and (part is None or ranges == self._stripes[0]):
                self._weigh(start)
            self.finish()
            reads = [self.pool.read_nb(out=self.center[lo:lo + n], slot=0, start=lo, count=n)
                     for lo, n in ranges]
            for request in reads:
                request.wait(self.timeout)
            pull, push = self.pull, self.push
            moves = []
            for lo, n in ranges:
                d, xs = self.scratch[lo:lo + n], x[lo:lo + n]
                np.subtract(xs, self.center[lo:lo + n], out=d)
                d *= np.float32(pull)
                np.subtract(xs, d, out=xs)
                moves.append(d)
            writes = [self.pool.write_nb(d, slot=self.my_slot, start=lo) for d, (lo, _) in zip(moves, ranges)]
            for request in writes:
                request.wait(self.timeout)
            self._pending = [self.pool.axpy_nb(0, self.my_slot, push / pull, start=lo, count=n)
                             for lo, n in ranges]
        self.exchanges += 1
        self.seconds += time.perf_counter() - start
        return self.scratch if part is None else moves

    def start_exchange(self, x, measure=True, part=None):
        """:meth:`exchange` (of ``part``, or all) on a copy of ``x`` in a thread of its own, so
        that the training goes on while the centre is read and moved; :meth:`take_move` gives
        its move. The one started before must have been taken."""
        if self._thread is not None:
            raise UsageError("an overlapped EASGD exchange is still pending; take its move first")
        if self._snapshot is None:
            self._snapshot = np.empty(self.length, dtype=np.float32)
        for lo, n in [(0, self.length)] if part is None else part:
            np.copyto(self._snapshot[lo:lo + n], x[lo:lo + n])
        self._move = self._error = None
        self._thread = threading.Thread(target=self._exchange_in_background, args=(measure, part),
                                        name=f"eddis-exchange-{self.name}", daemon=True)
        self._thread.start()

    def _exchange_in_background(self, measure, part):
        try:
            self._move = self.exchange(self._snapshot, measure, part)
        except BaseException as exc:   # raised where the move is taken
            self._error = exc

    @property
    def exchange_pending(self):
        return self._thread is not None or self._move is not None or self._error is not None

    def take_move(self):
        """The move ``d`` of the exchange :meth:`start_exchange` began (waiting for it; valid until
        the next exchange), or None when none was begun; its error, if it failed."""
        self._join_background()
        move, error, self._move, self._error = self._move, self._error, None, None
        if error is not None:
            raise error
        return move

    def _join_background(self):
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        # its SMB operations (at most 6 waits: the last axpy, the throughputs, the centre, the
        # move) are each bounded by the pool's timeout, so the thread ends within their sum
        bound = 6 * (self.timeout if self.timeout is not None else self.pool.client.timeout)
        thread.join(bound)
        if thread.is_alive():
            raise SMBTimeoutError(f"the overlapped EASGD exchange of {self.name} did not end within "
                                  f"{bound:g} s (6 x its SMB timeout); an smb-server may be stuck")
        self._thread = None

    def finish(self):
        """Wait until this worker's last centre update is applied (an overlapped exchange's too;
        its move is kept for :meth:`take_move`)."""
        self._join_background()
        pending, self._pending = self._pending or [], None
        for request in pending:
            request.wait(self.timeout)

    def read_center(self, out=None):
        """The centre variable now (flat float32)."""
        self.finish()
        out = np.empty(self.length, dtype=np.float32) if out is None else out
        return self.pool.read(out=out, slot=0, timeout=self.timeout)
