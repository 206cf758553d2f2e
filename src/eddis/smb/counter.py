"""The job's 64-bit counters: atomic across all clients, on one server each."""
import time

from ..errors import SMBTimeoutError, SMBValueError
from .protocol import COUNTER_REPLY, COUNTER_REQUEST
from .requests import Completed, Request

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def counter_value(value, counter, argument):
    """``value`` as an int a counter can hold (signed 64-bit), else SMBValueError naming the range."""
    number = int(value)
    if not INT64_MIN <= number <= INT64_MAX:
        raise SMBValueError(f"counter {counter!r}: {argument}={number} is outside a counter's signed "
                            f"64-bit range -2**63..2**63-1 ({INT64_MIN}..{INT64_MAX})")
    return number


class Counter:
    """A 64-bit counter, atomic across all clients of the job."""

    def __init__(self, client, name, initial=0, server=None):
        """``server``: the index of the server that holds it (default: by its name's hash);
        a counter that only one node's ranks use belongs on that node's server."""
        from . import _core

        self._client = client
        self.name = name
        self.server = self.home(client, name, server)
        info, _ = client._control(self.server, {
            "op": "region_create", "name": "counter:" + name, "slots": 1, "length": 1,
            "dtype": "int64", "meta": {"kind": "counter"},
            "initial": counter_value(initial, name, "initial")}, f"counter {name!r}")
        self._rid = info["id"]
        base = client.servers[self.server]["base"]
        self._local = base + info["offset"] if base else 0
        self._core = _core

    @staticmethod
    def home(client, name, server=None):
        """The index of the server that holds counter ``name``: ``server``, checked, or by
        the name's hash."""
        if server is None:
            return client.server_for("counter:" + name)
        if not 0 <= int(server) < client.num_servers:
            raise SMBValueError(f"counter {name!r}: server={server} outside 0..{client.num_servers - 1}")
        return int(server)

    def _remote_nb(self, kind, a=0, b=0):
        client = self._client
        pending = client._pending()
        client._post(pending, self.server, self._core.OP_COUNTER,
                     COUNTER_REQUEST.pack(self._rid, kind, 0, a, b))
        return Request(client, pending, f"counter {self.name!r}",
                       lambda replies: COUNTER_REPLY.unpack(replies[0])[0], [self.server])

    def _remote(self, kind, a=0, b=0):
        return self._remote_nb(kind, a, b).wait()

    def _check(self):
        self._client.check_alive([self.server], f"counter {self.name!r}")

    def fetch_add(self, n=1):
        """Add n; returns the value before. SMBValueError, the counter unchanged, where the
        sum would leave the signed 64-bit range (a wrapped counter repeats its values)."""
        n = counter_value(n, self.name, "fetch_add n")
        if self._local:
            with self._client._mapped_access("counter", self.name):
                self._check()
                return self._core.local_fetch_add(self._local, n, f"counter {self.name!r}")
        return self._remote(self._core.COUNTER_FETCH_ADD, n)

    def fetch_add_nb(self, n=1):
        """Start adding n; returns a Request whose ``wait()`` gives the value before (a
        :class:`~eddis.smb.requests.Completed` one on a mapped counter). Lets a caller that
        announces many pieces go on with the next instead of waiting a round trip for each."""
        if self._local:
            return Completed(self.fetch_add(n))
        return self._remote_nb(self._core.COUNTER_FETCH_ADD, counter_value(n, self.name, "fetch_add n"))

    def compare_swap(self, expected, desired):
        """Set to desired if it equals expected; returns the value before."""
        expected = counter_value(expected, self.name, "compare_swap expected")
        desired = counter_value(desired, self.name, "compare_swap desired")
        if self._local:
            with self._client._mapped_access("counter", self.name):
                self._check()
                return self._core.local_compare_swap(self._local, expected, desired)
        return self._remote(self._core.COUNTER_COMPARE_SWAP, expected, desired)

    def read(self):
        if self._local:
            with self._client._mapped_access("counter", self.name):
                self._check()
                return self._core.local_load(self._local)
        return self._remote(self._core.COUNTER_READ)

    def peek(self):
        """The value, for a caller that looks many times a millisecond: on a mapped counter an
        atomic load without read()'s transport progress and liveness check (that caller finds
        a dead server by its own deadline, with read()); elsewhere read()."""
        if self._local:
            with self._client._mapped_access("counter", self.name):
                return self._core.local_load(self._local)
        return self.read()

    def wait_for(self, target, timeout):
        """Poll until the counter reaches ``target``; returns the value read. Meant for
        parties moments away (ranks that step together): it yields the CPU first and
        then backs off to 0.5 ms between reads. SMBTimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        polls = 0
        while True:
            value = self.read()
            if value >= target:
                return value
            if time.monotonic() > deadline:
                raise SMBTimeoutError(f"counter {self.name!r} stayed at {value}, below {target}, "
                                      f"for {timeout:g} s")
            polls += 1
            time.sleep(0 if polls < 64 else min(5e-4, 2e-5 * (polls - 63)))
