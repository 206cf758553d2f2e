"""Waiting for a non-blocking MPI call with a time limit: what every MPI call of the runtime
polls, so that a rank that crashed or skipped a call turns into an error instead of a hang.

- ``start(method, *args)``: begin the call (under the MPI lock where MPI lacks THREAD_MULTIPLE);
- ``wait_request(request, timeout, what)``: poll it until done; after ``timeout`` seconds (or
  once ``deadline()`` has passed) mark the runtime broken, so that ``eddis.shutdown()`` aborts
  the MPI job instead of finalizing it, and raise :class:`CollectiveTimeoutError` naming ``what``;
- ``add_wait_probe(fn)``: ``fn(what)`` is asked once a wait has lasted PROBE_AFTER seconds, and
  raises when it knows the others cannot come (:mod:`eddis.core.progress.join`).
"""
import time

from ...errors import CollectiveTimeoutError
from . import runtime

PROBE_AFTER = 1.0   # seconds a collective waits before asking the probes why
_wait_probes = []


def add_wait_probe(fn):
    """``fn(what)`` is called once in a collective's wait that lasts PROBE_AFTER seconds; it
    raises an EddisError when it knows the others cannot come (eddis.core.progress.join)."""
    if fn not in _wait_probes:
        _wait_probes.append(fn)


def start(method, *args, **kwargs):
    """Start a non-blocking MPI call (under the MPI lock when threads must take turns)."""
    with runtime.mpi_lock():
        return method(*args, **kwargs)


def wait_request(request, timeout, what, deadline=None):
    """Poll an MPI request until done; raise CollectiveTimeoutError after ``timeout`` s, or
    once ``deadline()`` (a callable: a monotonic time that may move later while the caller
    sees the others alive) has passed."""
    begun = time.monotonic()
    end = begun + timeout
    probed = False
    delay = 2e-6
    while True:
        with runtime.mpi_lock():
            if request.Test():
                return

        now = time.monotonic()
        if not probed and now - begun > PROBE_AFTER:
            probed = True
            for probe in _wait_probes:
                probe(what)
        if now > (end if deadline is None else deadline()):
            runtime.mark_broken(what)
            raise CollectiveTimeoutError(
                f"{what}: not every rank joined within {timeout:g} s. Another rank failed, "
                "is stuck, or skipped this call (every rank must make the same collective "
                "calls in the same order); raise EDDIS_COMM_TIMEOUT if it is only slow.")
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)
