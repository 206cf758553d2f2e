"""How much of the time each link of the emulated cluster carries bytes while a contender runs.

The bytes a step puts on a link say how far a contender is from the link's floor; they do
not say when the link idles. ``Sampler(read)`` calls ``read()`` (the cluster's counters,
``{node: {"tx": bytes, "rx": bytes}}``) every ``INTERVAL_S`` on a thread of its own until
``stop()``; ``idle_shares(samples, rate, nodes)`` gives, per node and way, the share of the
intervals in which the link carried less than ``IDLE_SHARE`` of ``rate``. Compute with no
bucket to send, a node waiting for a straggler and a transfer that uses one way only all
show there. ``busy_rates(samples, rate, nodes)`` gives what the link carried in the other
intervals, as a share of ``rate``: how full it was while it worked.
"""
import threading
import time

INTERVAL_S = 0.01
IDLE_SHARE = 0.05
MAX_SAMPLES = 400_000   # about 70 minutes of 10 ms samples: the thread's memory stays bounded


class Sampler:
    """``read()``'s counters, stamped with ``time.monotonic()``, every ``interval`` seconds."""

    def __init__(self, read, interval=INTERVAL_S):
        self._read = read
        self._interval = interval
        self._stop = threading.Event()
        self.samples = []
        self._thread = threading.Thread(target=self._run, name="link-usage", daemon=True)

    def start(self):
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set() and len(self.samples) < MAX_SAMPLES:
            self.samples.append((time.monotonic(), self._read()))
            self._stop.wait(self._interval)

    def stop(self):
        """The samples taken, the last one now."""
        self._stop.set()
        self._thread.join(timeout=10)
        self.samples.append((time.monotonic(), self._read()))
        return self.samples


def _per_link(samples, nodes, measure):
    """``{node: {"tx": measure(intervals), "rx": ...}}``, ``intervals`` being that link and
    way's [(seconds, bytes moved)] between consecutive samples (those of positive length).
    None where there are fewer than two samples."""
    if len(samples) < 2:
        return None
    pairs = list(zip(samples, samples[1:]))
    return {node: {way: measure([(t1 - t0, after[node][way] - before[node][way])
                                 for (t0, before), (t1, after) in pairs if t1 > t0])
                   for way in ("tx", "rx")}
            for node in nodes}


def idle_shares(samples, rate, nodes):
    """``{node: {"tx": share, "rx": share}}``: of the time between the first and the last
    sample, the share spent in intervals that moved less than IDLE_SHARE of ``rate`` (bytes
    per second) on that node's link and way. None where there are fewer than two samples."""
    def idle_share(intervals):
        total = sum(dt for dt, _ in intervals)
        idle = sum(dt for dt, moved in intervals if moved / dt < IDLE_SHARE * rate)
        return idle / total if total else None

    return _per_link(samples, nodes, idle_share)


def busy_rates(samples, rate, nodes):
    """``{node: {"tx": share, "rx": share}}``: what that node's link and way carried while it
    was not idle (the intervals at or above IDLE_SHARE of ``rate``), as a share of ``rate``.
    A link can idle little and still carry less than it could (streams that stall and
    restart, senders that wait on their peers); this says how full it was while it worked.
    None where there are fewer than two samples; a way that never worked has None."""
    def busy_rate(intervals):
        working = [(dt, moved) for dt, moved in intervals if moved / dt >= IDLE_SHARE * rate]
        busy = sum(dt for dt, _ in working)
        return sum(moved for _, moved in working) / busy / rate if busy else None

    return _per_link(samples, nodes, busy_rate)


def link_mean(shares):
    """The mean over the nodes and both ways of ``idle_shares``'s or ``busy_rates``'s result
    (None: unknown)."""
    if not shares:
        return None
    values = [v for ways in shares.values() for v in ways.values() if v is not None]
    return sum(values) / len(values) if values else None
