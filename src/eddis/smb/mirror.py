"""Mirrored pools and counters: state that outlives one lost smb-server.

A node lost as a whole takes its smb-server with it, and with it that server's share of
every pool and the counters it holds. A :class:`MirroredPool` keeps each element on two
servers: its primary copy is an ordinary :class:`~eddis.smb.pool.Pool` over the servers
in order (segment i on server i), its mirror a pool of the same partition over the servers
rotated by one (segment i on server i + 1), so a lost server takes one copy of two
segments and never both copies of one. A :class:`MirroredCounter` lives on its own server
and the next one.

- Updates (write, axpy) go to both copies and are waited for together; a counter's
  compare_swap is decided on its first live copy and, where it swapped, added to the other.
- Reads go to the primary copy; the segments whose primary server is lost are read from
  the mirror.
- A server is lost once its connection has failed (the server died, or its node: a
  connection error), or once it left a request of a mirrored object unanswered for the
  whole timeout (this client then gives it up, :meth:`Client.note_lost`, rather than
  wait on it again). Losses belong to the client, so all its mirrored objects know of
  them at once; an operation fails only when both copies of something it touches are
  lost (SMBConnectionError naming both servers).

The copies can differ slightly: concurrent axpys of several clients may apply in another
order on each copy (float addition is commutative, not associative), which EASGD's centre
tolerates; counters hold integers, so their copies agree once the operations in flight
are in. An operation that a client started on the primary copy and did not live to
repeat on the mirror is lost with that client.

Cost: twice the memory; every update sends its bytes twice (an easgd exchange reads the
centre once and writes the worker's move twice, 4 rather than 3 times the parameter
bytes) and every counter update is one more round trip; reads cost nothing more.
"""
import time

import numpy as np

from ..errors import SMBConnectionError, SMBTimeoutError, SMBValueError
from .counter import Counter
from .pool import Pool, as_array
from .protocol import partition

MIRROR_SUFFIX = "~mirror"


def mirror_servers(num_servers):
    """The servers of the mirror copy: the primary's order rotated by one."""
    order = list(range(num_servers))
    return order[1:] + order[:1]


class _Failed:
    """An operation that failed as it was issued (a same-node copy into a dead server's memory)."""

    def __init__(self, error):
        self.error = error

    def done(self):
        return True

    def wait_done(self, timeout):
        return True

    def wait(self, timeout=None):
        raise self.error

    def unanswered_servers(self):
        return []


def _issue(start):
    try:
        return start()
    except SMBConnectionError as exc:
        return _Failed(exc)


def wait_all(client, requests, timeout):
    """Wait for every request (each on its own servers); the servers they lost are noted on
    ``client``. True when all completed; raises what is neither a lost connection nor a timeout."""
    give_up, failed = [], False
    for request in requests:
        try:
            request.wait(timeout)
        except SMBConnectionError:
            failed = True
        except SMBTimeoutError:
            failed = True
            give_up.extend(request.unanswered_servers())
    if failed:
        client.note_lost(give_up)
    return not failed


class _InFlight:
    """The requests (``self.requests``) of one mirrored operation on its copies, polled and
    driven together."""

    def done(self):
        """True once every request of this round is done."""
        return all(request.done() for request in self.requests)

    def wait_done(self, timeout):
        """Drive the transport for up to ``timeout`` s in all, until every request is done; True
        once they are (``wait()`` then returns or raises at once), False while some go on."""
        deadline = time.monotonic() + float(timeout)
        return all(request.wait_done(max(0.0, deadline - time.monotonic())) for request in self.requests)


class _Read(_InFlight):
    """A mirrored read in flight: wait() reads again what a lost primary server held, so it may
    go on after done()."""

    def __init__(self, pool, arr, result, slot, start):
        self.pool, self.arr, self.result, self.slot, self.start = pool, arr, result, slot, start
        self.requests = pool._start_read(arr, slot, start)

    def wait(self, timeout=None):
        pool = self.pool
        # a round fails only when a server more is lost: bounded by the number of servers
        for _ in range(pool.client.num_servers):
            if wait_all(pool.client, self.requests, timeout):
                return self.result
            self.requests = pool._start_read(self.arr, self.slot, self.start)
        raise SMBConnectionError(f"pool {pool.name!r} read: smb-servers failed in every one of "
                                 f"{pool.client.num_servers} attempts", -25)


class _Update(_InFlight):
    """A mirrored update in flight: done once every live copy has it."""

    def __init__(self, pool, requests, start, count, what):
        self.pool, self.requests, self.start, self.count, self.what = pool, requests, start, count, what

    def wait(self, timeout=None):
        if not wait_all(self.pool.client, self.requests, timeout):
            self.pool._check_copies(self.start, self.count, self.what)


class MirroredPool:
    """A pool whose every element lives on two servers (see the module docstring).
    Takes the calls of :class:`~eddis.smb.pool.Pool` that a training state needs."""

    def __init__(self, client, name, length, dtype="float32", slots=1, create=True):
        if client.num_servers < 2:
            raise SMBValueError(f"pool {name!r}: a mirrored pool needs at least 2 servers, the client "
                                f"has {client.num_servers}")
        self.client = client
        self.name = name
        self.primary = Pool(client, name, length, dtype=dtype, slots=slots, create=create)
        self.mirror = Pool(client, name + MIRROR_SUFFIX, length, dtype=dtype, slots=slots, create=create,
                           servers=mirror_servers(client.num_servers))
        self.length, self.dtype, self.slots = self.primary.length, dtype, self.primary.slots
        self.np_dtype = self.primary.np_dtype
        # segment i: its columns and the servers of its two copies
        self._segments = [(lo, hi, p, m) for (lo, hi), p, m in
                          zip(partition(self.length, client.num_servers), self.primary.servers,
                              self.mirror.servers)]

    def __repr__(self):
        return f"MirroredPool({self.name!r}, length={self.length}, dtype={self.dtype!r}, slots={self.slots})"

    def _touched(self, start, count):
        """(lo, hi, primary server, mirror server) of the segments that [start, start+count) touches."""
        end = start + count
        return [(max(lo, start), min(hi, end), p, m) for lo, hi, p, m in self._segments
                if max(lo, start) < min(hi, end)]

    def _range(self, start, count):
        _, start, count = self.primary._range(0, start, count)   # bounds, with the pool's own message
        return start, count

    def _check_copies(self, start, count, what):
        lost = self.client.lost_servers
        for lo, hi, p, m in self._touched(start, count):
            if p in lost and m in lost:
                raise SMBConnectionError(
                    f"pool {self.name!r} {what}: both copies of elements [{lo}, {hi}) are lost (smb-servers "
                    f"{p} and {m}); a mirrored pool survives the loss of one server", -25)

    # ------------------------------------------------------------ transfers
    def _start_read(self, arr, slot, start):
        lost = self.client.lost_servers
        self._check_copies(start, arr.size, "read")
        touched = self._touched(start, arr.size)
        if not any(p in lost for _, _, p, _ in touched):
            return [_issue(lambda: self.primary.read_nb(arr, slot, start))]
        return [_issue(lambda c=(self.mirror if p in lost else self.primary), lo=lo, hi=hi:
                       c.read_nb(arr[lo - start:hi - start], slot, lo)) for lo, hi, p, _ in touched]

    def read_nb(self, out=None, slot=0, start=0, count=None):
        if out is None:
            start, count = self._range(start, count)
            out = arr = np.empty(count, dtype=self.np_dtype)
        else:
            arr = as_array(out, self.dtype, True, self.np_dtype)
            if count is not None and int(count) != arr.size:
                raise SMBValueError(f"count={count} but out holds {arr.size} elements")
            start, count = self._range(start, arr.size)
        return _Read(self, arr, out, slot, start)

    def read(self, out=None, slot=0, start=0, count=None, timeout=None):
        return self.read_nb(out, slot, start, count).wait(timeout)

    def _update_nb(self, start, count, what, issue):
        """``issue(copy, lo, count)`` starts the update of [lo, lo+count) on one copy."""
        lost = self.client.lost_servers
        self._check_copies(start, count, what)
        touched = self._touched(start, count)
        if not any(p in lost or m in lost for _, _, p, m in touched):
            requests = [_issue(lambda c=c: issue(c, start, count)) for c in (self.primary, self.mirror)]
        else:
            requests = [_issue(lambda c=c, lo=lo, hi=hi: issue(c, lo, hi - lo))
                        for lo, hi, p, m in touched
                        for c, server in ((self.primary, p), (self.mirror, m)) if server not in lost]
        return _Update(self, requests, start, count, what)

    def write_nb(self, buf, slot=0, start=0):
        arr = as_array(buf, self.dtype, False, self.np_dtype)
        start, count = self._range(start, arr.size)
        return self._update_nb(start, count, "write",
                               lambda c, lo, n: c.write_nb(arr[lo - start:lo - start + n], slot, lo))

    def write(self, buf, slot=0, start=0, timeout=None):
        self.write_nb(buf, slot, start).wait(timeout)

    def axpy_nb(self, y_slot, x_slot, alpha, start=0, count=None):
        """y += alpha * x on the servers, on both copies (x and y: slots of this pool)."""
        start, count = self._range(start, count)
        return self._update_nb(start, count, "axpy", lambda c, lo, n: c.axpy_nb(y_slot, x_slot, alpha, lo, n))

    def axpy(self, y_slot, x_slot, alpha, start=0, count=None, timeout=None):
        self.axpy_nb(y_slot, x_slot, alpha, start, count).wait(timeout)


class _LostCopy:
    """The copy of a counter on a server that was lost before this client reached it; skipped,
    as every copy on a lost server is."""

    def __init__(self, server):
        self.server = server


def _note_lost_copy(client, server, error):
    """After ``error`` from the copy on ``server``: a timeout gives that server up, a
    connection error has already marked its connection failed; both become lost servers."""
    client.note_lost([server] if isinstance(error, SMBTimeoutError) else ())


def _counter_copy(client, name, initial, server):
    """The copy of counter ``name`` on ``server``, or a _LostCopy where that server is lost
    (known, or found as the copy is set up)."""
    if server not in client.lost_servers:
        try:
            return Counter(client, name, initial, server)
        except (SMBConnectionError, SMBTimeoutError) as exc:
            _note_lost_copy(client, server, exc)
            if server not in client.lost_servers:
                raise
    return _LostCopy(server)


class MirroredCounter:
    """A counter on its server (by name, or ``server``) and on the next one (see the module
    docstring). Updates go to the primary copy first, so that a value read from it never
    runs ahead of the mirror by more than the operations in flight.

    A client may first reach a counter after one of its servers is lost (the checkpoint
    schedule's counters are set up at a rank's first step boundary, which a slow rank may
    reach after a node died): it then uses the live copy alone."""

    def __init__(self, client, name, initial=0, server=None):
        if client.num_servers < 2:
            raise SMBValueError(f"counter {name!r}: a mirrored counter needs at least 2 servers, the client "
                                f"has {client.num_servers}")
        self._client = client
        self.name = name
        self.server = Counter.home(client, name, server)
        self._copies = [_counter_copy(client, name, initial, s)
                        for s in (self.server, (self.server + 1) % client.num_servers)]
        if all(copy.server in client.lost_servers for copy in self._copies):
            raise self._both_lost("setup")

    def _both_lost(self, what):
        servers = " and ".join(str(c.server) for c in self._copies)
        return SMBConnectionError(f"counter {self.name!r} {what}: both copies are lost (smb-servers {servers}); "
                                  "a mirrored counter survives the loss of one server", -25)

    def _apply(self, operation, what, every=True):
        """``operation(copy)`` on every live copy (``every``, else the first that answers),
        primary first; the primary's result, else the mirror's."""
        results = []
        for copy in self._copies:
            if copy.server in self._client.lost_servers:
                continue
            try:
                results.append(operation(copy))
            except (SMBConnectionError, SMBTimeoutError) as exc:
                _note_lost_copy(self._client, copy.server, exc)
            if results and not every:
                break
        if not results:
            raise self._both_lost(what)
        return results[0]

    def fetch_add(self, n=1):
        """Add n on both copies; returns the value before (the primary's while it lives)."""
        return self._apply(lambda copy: copy.fetch_add(n), "fetch_add")

    def compare_swap(self, expected, desired):
        """Set to ``desired`` if it equals ``expected``, decided on the first live copy (the
        primary while it lives); returns the value before there. Where it swapped, the other
        copy gets the same change as an addition, not a swap of its own: another client's
        fetch_add may reach the copies in another order, and additions agree in any order."""
        swapped = []

        def operation(copy):
            if not swapped:
                before = copy.compare_swap(expected, desired)
                swapped.append(before == expected)
                return before
            if swapped[0]:
                copy.fetch_add(desired - expected)
            return None
        return self._apply(operation, "compare_swap")

    def read(self):
        return self._apply(lambda copy: copy.read(), "read", every=False)

    wait_for = Counter.wait_for
