"""Mode ``easgd``: asynchronous elastic averaging SGD through the SMB pool.

Every worker trains on its own data with its own (local) optimizer; nothing
waits for anyone. The *centre variable* x~ lives in an SMB pool (slot 0; the
pool is partitioned over all servers). Every ``tau`` local steps a worker
does one exchange (Zhang, Choromanska and LeCun, "Deep learning with Elastic
Averaging SGD", 2015, asynchronous variant)::

    x~_seen = read(centre)                 # may interleave with other workers' updates
    d = alpha (x - x~_seen)
    x = x - d                              # the worker moves towards the centre
    centre += d                            # server-side axpy: write d into this worker's
                                           # slot, then pool.axpy(0, my_slot, 1.0)

The axpy runs on the servers, one request per server shard, each applied
atomically in its server's request loop: concurrent exchanges of several workers
serialize per shard and none is lost. A worker does not wait for its axpy to
finish: it completes in the background and is waited for at the start of the
next exchange (so the next read sees this worker's own update). Reads of the
centre are not atomic across shards, which EASGD tolerates (as Hogwild does).

Defaults (EDDIS_EASGD_TAU, EDDIS_EASGD_ALPHA). ``tau = 4``: the paper found
communication periods up to about 10 cost little accuracy, and 4 cuts the
exchange traffic to a quarter of per-step averaging while keeping the workers
close; ``alpha = 0.9 / p`` for p exchanging workers, the paper's recommended
``beta = p alpha = 0.9``, which keeps the centre's total pull per round below 1
so it neither lags the workers nor oscillates.

The final model is the centre: ``read_center()`` after every worker did its
last exchange (``eddis.save_checkpoint`` does that).

    averager = ElasticAverager(client, length, worker=r, workers=W, name="eddis.easgd.1")
    if r == 0: averager.initialize(x)          # then a barrier before any exchange
    if averager.due(step): averager.exchange(x)
    averager.finish()                          # wait for the last axpy
"""
import time

import numpy as np

from .. import settings, timeline
from ..errors import ConfigError
from .reducer import LocalReducer, register_mode


class ElasticAverager:
    """A worker's side of EASGD over a flat float32 parameter vector."""

    def __init__(self, client, length, worker, workers, tau=None, alpha=None, name="eddis.easgd",
                 timeout=None):
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
        self.timeout = timeout
        self.name = name
        self.pool = client.pool(name, self.length, dtype="float32", slots=1 + self.workers)
        self.center = np.empty(self.length, dtype=np.float32)
        self.scratch = np.empty(self.length, dtype=np.float32)   # d of the last exchange
        self._pending = None
        self.exchanges = 0
        self.seconds = 0.0

    @property
    def my_slot(self):
        return 1 + self.worker

    def initialize(self, x):
        """Set the centre to ``x`` (one worker does it, before any exchange)."""
        self.pool.write(np.ascontiguousarray(x, dtype=np.float32), slot=0, timeout=self.timeout)

    def due(self, step):
        """True after local step ``step`` (0-based) when an exchange is due."""
        return (int(step) + 1) % self.tau == 0

    def exchange(self, x):
        """One elastic exchange; moves ``x`` (flat float32, in place) and the centre.
        Returns the move ``d`` (valid until the next exchange)."""
        start = time.perf_counter()
        with timeline.span(timeline.EASGD_EXCHANGE,
                           args={"bytes": 3 * self.length * 4, "worker": self.worker}):
            self.finish()
            self.pool.read(out=self.center, slot=0, timeout=self.timeout)
            d = self.scratch
            np.subtract(x, self.center, out=d)
            d *= np.float32(self.alpha)
            np.subtract(x, d, out=x)
            self.pool.write(d, slot=self.my_slot, timeout=self.timeout)
            self._pending = self.pool.axpy_nb(0, self.my_slot, 1.0)
        self.exchanges += 1
        self.seconds += time.perf_counter() - start
        return d

    def finish(self):
        """Wait until this worker's last centre update is applied."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait(self.timeout)

    def read_center(self, out=None):
        """The centre variable now (flat float32)."""
        self.finish()
        out = np.empty(self.length, dtype=np.float32) if out is None else out
        return self.pool.read(out=out, slot=0, timeout=self.timeout)


class LocalGradients(LocalReducer):
    """The reducer of mode ``easgd``: gradients stay local (workers meet only
    through the centre variable, in ``ElasticAverager.exchange``)."""

    mode = "easgd"


register_mode("easgd", LocalGradients)
