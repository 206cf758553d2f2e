"""The collectives a script calls, on a thread of their own: in issue order, each one
announced first, so that a rank inside ``join()`` can take part in it.

    handle = engine.allreduce(array, "average", 1.0, 1.0, name="loss")   # returns at once
    handle.poll()                                                         # never blocks
    handle.wait()                     # the result, or the error (the same on every caller)

``eddis.allreduce``, ``allgather``, ``broadcast``, their ``*_async`` forms,
``broadcast_object``, ``allgather_object``, ``barrier``, and the announcements of the
composite calls (``broadcast_parameters``, ``broadcast_optimizer_state``,
``broadcast_variables``: :func:`announce`) all go through one background thread per
process, over a communicator of their own (``runtime.api_comm()``), strictly in the order
this rank issued them. Each operation is

1. a round of announcements (:mod:`eddis.core.comm.negotiate`): every rank's :class:`Call`,
   gathered with one small allgather;
2. the decision every rank draws from that round: run it, or refuse it with the same
   error on every rank that called it;
3. the data, moved with non-blocking MPI calls polled to completion, each wait bounded by
   EDDIS_COMM_TIMEOUT.

A rank in ``join()`` queues a :class:`JoinTicket`: the thread announces ``joined`` round
after round and takes its part in what the others call (zeros in allreduce, nothing in
barrier) until every rank announces ``joined``; that round carries every rank's join key.

Asynchronous handles: the thread moves the data while the caller computes (Open MPI
progresses a non-blocking collective only inside MPI calls, which this thread makes), and
completes handles in the order they were issued. Gradients never come here: the reducers
have communicators of their own, or SMB.
"""
import collections
import itertools
import logging
import pickle
import threading
import time

import numpy as np

from ... import settings
from ...errors import CollectiveTimeoutError, EddisError, UsageError
from . import adasum, collectives, negotiate, runtime, waits
from .negotiate import Call

log = logging.getLogger("eddis.core.engine")

THREAD_NAME = "eddis-collectives"
GRACE = 5.0   # seconds a waiter allows beyond the thread's own bounded waits


class Handle:
    """An operation's result on this rank. ``finish(result)``, where given, runs in the
    thread that waits (the adapter's conversion back to a tensor)."""

    def __init__(self, engine, what, finish=None):
        self.engine = engine
        self.what = what
        self.finish = finish
        self._done = threading.Event()
        self._result = None
        self._error = None

    def poll(self):
        """Whether the operation has completed (or failed); never blocks."""
        return self._done.is_set()

    def _complete(self, result=None, error=None):
        self._result, self._error = result, error
        self._done.set()

    def wait(self):
        """The result; raises the operation's error. Bounded: the thread's waits end within
        EDDIS_COMM_TIMEOUT each, and a thread that stops moving is reported."""
        while not self._done.wait(0.2):
            self.engine.check_moving(self)
        if self._error is not None:
            raise self._error
        return self._result if self.finish is None else self.finish(self._result)


class Operation:
    """One collective: its announcement, then ``move(engine, outcome)`` -> this rank's result."""

    def __init__(self, engine, call, move=None):
        self.call = call
        self.what = call.what
        self.move = move
        self.handle = Handle(engine, call.what)

    def run(self, engine):
        outcome = engine.announce(self.call)
        if outcome.error is not None:
            self.handle._complete(error=outcome.error)
            return
        self.handle._complete(result=None if self.move is None else self.move(engine, outcome))


class JoinTicket:
    """This rank's part while it is in ``join()``: joined rounds until every rank has joined.

    ``key`` orders the ranks by when they joined (eddis.core.progress.join): the thread appends the
    number of rounds this rank took part in before it joined. The rounds wait up to
    EDDIS_COMM_TIMEOUT for the other ranks' next call, a limit that :meth:`alive` pushes
    back (the caller's gradient steps with the others show they are alive)."""

    def __init__(self, engine, key, what):
        self.key = tuple(key)
        self.what = what
        self.timeout = engine.timeout
        self.deadline = time.monotonic() + self.timeout
        self.handle = Handle(engine, what)

    def alive(self):
        self.deadline = max(self.deadline, time.monotonic() + self.timeout)

    def abandon(self):
        """join() failed: stop waiting (the communicator is left unusable)."""
        self.deadline = float("-inf")

    def run(self, engine):
        joined = Call(negotiate.JOINED, key=self.key + (engine.rounds,))
        while True:
            try:
                outcome = engine.announce(joined, deadline=lambda: self.deadline)
            except CollectiveTimeoutError as exc:
                if self.deadline == float("-inf"):
                    raise CollectiveTimeoutError(f"{self.what} failed; its collectives stopped") from exc
                raise CollectiveTimeoutError(
                    f"{self.what}: for {self.timeout:g} s no other rank made a collective call, "
                    "took a gradient step with this joined rank, or joined. They failed or are "
                    "stuck; raise EDDIS_COMM_TIMEOUT if they only compute that long between "
                    "two calls.") from exc
            if outcome.all_joined:
                self.handle._complete(result=[call.key for call in outcome.calls])
                return
            self.alive()
            if outcome.error is not None:
                log.info("%s: rank(s) %s called %s beside this joined rank and were refused: %s",
                         self.what, outcome.callers, outcome.first.what, outcome.error)
                continue
            if outcome.first.kind == "allreduce":
                engine.reduce(negotiate.identity(outcome.first), outcome.first.op, outcome.first.what)


class Engine:
    def __init__(self):
        self.comm = runtime.api_comm()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.timeout = settings.get("EDDIS_COMM_TIMEOUT")
        self.rounds = 0            # announcement rounds this rank took part in
        self.broken = None         # the failure that left the communicator unusable
        self.current = None        # the operation in progress
        self.beat = time.monotonic()
        self._queue = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
        self._thread.start()
        runtime.register_closable(self)

    # ------------------------------------------------------------ the caller's side
    def submit(self, op):
        with self._cond:
            if self.broken is not None:
                raise UsageError(f"{op.what}: this rank's collectives stopped after a failure "
                                 f"({self.broken}); the job cannot go on") from self.broken
            if self._closing:
                raise UsageError(f"{op.what} after eddis.shutdown(): call eddis.init() first")
            self._queue.append(op)
            self._cond.notify()
        return op.handle

    def check_moving(self, handle):
        """Raise when ``handle``'s wait can no longer end: the thread died or stopped moving."""
        if not self._thread.is_alive() and not handle.poll():
            raise UsageError(f"{handle.what}: the collectives thread has ended (eddis.shutdown()?)")
        quiet = time.monotonic() - self.beat
        limit = 2 * self.timeout + GRACE
        if quiet > limit and not handle.poll():
            current = self.current.what if self.current is not None else "nothing"
            raise CollectiveTimeoutError(
                f"{handle.what}: not done; this rank's collectives have not moved for {quiet:.0f} s "
                f"(at {current}, {len(self._queue)} queued), more than any of their waits may last "
                f"(EDDIS_COMM_TIMEOUT {self.timeout:g} s)")

    def close(self):
        """Run what was issued (each wait bounded), then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            ahead = len(self._queue) + 1
        self._thread.join(timeout=ahead * (2 * self.timeout + GRACE))
        runtime.unregister_closable(self)
        global _engine
        with _engine_lock:
            if _engine is self:
                _engine = None

    # ------------------------------------------------------------ the thread
    def _loop(self):
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                op = self._queue.popleft()
                self.current = op
            self.beat = time.monotonic()
            try:
                op.run(self)
            except BaseException as exc:  # noqa: BLE001 - every waiter must hear of it
                if _leaves_the_communicator_usable(exc):
                    op.handle._complete(error=exc)   # e.g. an object that does not unpickle here
                else:
                    self._break(op, exc)
            finally:
                self.current = None
                self.beat = time.monotonic()

    def _break(self, op, exc):
        if not isinstance(exc, EddisError):
            wrapped = UsageError(f"{op.what} failed: {type(exc).__name__}: {exc}")
            wrapped.__cause__ = exc
            exc = wrapped
        with self._cond:
            self.broken = exc
            queued = list(self._queue)
            self._queue.clear()
        log.error("%s failed; the script's collectives stop here: %s", op.what, exc)
        op.handle._complete(error=exc)
        for later in queued:
            error = UsageError(f"{later.what}: not run, this rank's collectives stopped at {op.what} ({exc})")
            error.__cause__ = exc
            later.handle._complete(error=error)

    def _deadline(self, end):
        def deadline():
            self.beat = time.monotonic()
            return end()
        return deadline

    def announce(self, call, deadline=None):
        """One round: every rank's Call, and what they all conclude."""
        from mpi4py import MPI

        mine = np.frombuffer(call.encode(), dtype=np.uint8)
        slots = np.empty(self.size * negotiate.SLOT, dtype=np.uint8)
        request = waits.start(self.comm.Iallgather, [mine, MPI.BYTE], [slots, MPI.BYTE])
        if deadline is None:
            end = time.monotonic() + self.timeout
            deadline = lambda: end  # noqa: E731
        waits.wait_request(request, self.timeout, call.what, deadline=self._deadline(deadline))
        self.rounds += 1
        width = negotiate.SLOT
        return negotiate.decide([Call.decode(slots[r * width:(r + 1) * width]) for r in range(self.size)])

    # ------------------------------------------------------------ moving the data
    def reduce(self, array, op, what):
        if op == "adasum":
            return adasum.allreduce_array(array, self.comm, self.timeout, what)
        return collectives.allreduce_array(array, op=op, comm=self.comm, timeout=self.timeout, what=what)

    def broadcast_bytes(self, data, root, what):
        return collectives.broadcast_array(data, root=root, comm=self.comm, timeout=self.timeout, what=what)

    def allgather_bytes(self, payload, lengths, what):
        return collectives.allgatherv_bytes(payload, lengths, comm=self.comm, timeout=self.timeout, what=what)


_engine = None
_engine_lock = threading.Lock()


def _leaves_the_communicator_usable(exc):
    """An error of this rank's own after (or instead of) its part of the MPI calls: the
    others saw a complete collective. A timeout, an MPI failure or an interruption leave
    requests posted, which nothing can match any more."""
    from mpi4py import MPI

    return isinstance(exc, Exception) and not isinstance(exc, (CollectiveTimeoutError, MPI.Exception))


def current():
    """This runtime's engine, its thread started on first use."""
    global _engine
    runtime.require("eddis collectives")
    with _engine_lock:
        if _engine is None:
            _engine = Engine()
        return _engine


def on_engine_thread():
    return threading.current_thread().name == THREAD_NAME


def _bytes_of(array):
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


# ------------------------------------------------------------------ the operations
def allreduce(data, op, prescale_factor=1.0, postscale_factor=1.0, name=None):
    """``data`` (numpy) reduced over all ranks, in its dtype and shape. Floats are summed in
    float64 (metrics, not gradients: exactness over speed); the rules (no integer average,
    Adasum of floats only) are checked in the round, so every rank refuses alike."""
    engine = current()
    data = np.asarray(data)
    floating = data.dtype.kind == "f" or data.dtype.name == "bfloat16"
    work = data.astype(np.float64).reshape(-1) if floating else np.array(data, copy=True).reshape(-1)
    if floating and prescale_factor != 1.0:
        work *= prescale_factor
    call = Call("allreduce", name=name, dtype=data.dtype.name, wire=work.dtype.str, shape=data.shape, op=op,
                factors=(float(prescale_factor), float(postscale_factor)))

    def move(engine, outcome):
        out = engine.reduce(work, op, call.what)
        if postscale_factor != 1.0:
            out *= postscale_factor
        return np.asarray(out).reshape(data.shape).astype(data.dtype, copy=False)

    return engine.submit(Operation(engine, call, move))


def allgather(data, name=None):
    """Every rank's ``data`` concatenated along the first dimension (its length may differ)."""
    engine = current()
    data = np.array(data, copy=True)
    call = Call("allgather", name=name, dtype=data.dtype.name, shape=data.shape)

    def move(engine, outcome):
        rows = [outcome.calls[r].shape[0] for r in range(engine.size)]
        row_bytes = data.dtype.itemsize * int(np.prod(data.shape[1:], dtype=np.int64))
        gathered, _ = engine.allgather_bytes(_bytes_of(data), [n * row_bytes for n in rows], call.what)
        return gathered.view(data.dtype).reshape((sum(rows),) + data.shape[1:])

    return engine.submit(Operation(engine, call, move))


def broadcast(data, root, name=None):
    """Root's ``data`` (a new array) on every rank."""
    engine = current()
    data = np.array(data, copy=True, order="C")
    call = Call("broadcast", name=name, dtype=data.dtype.name, shape=data.shape, root=int(root))

    def move(engine, outcome):
        engine.broadcast_bytes(_bytes_of(data), call.root, call.what)
        return data

    return engine.submit(Operation(engine, call, move))


def _pickled(obj, kind, name):
    """``obj`` pickled, or the Call that tells every rank why it cannot be."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as exc:  # noqa: BLE001 - any pickling failure; every rank must hear of it
        what = Call(kind, name=name).what
        return None, Call(negotiate.INVALID, name=name, message=(
            f"{what}: the object does not pickle: pass plain values ({type(exc).__name__}: {exc})"))


def broadcast_object(obj, root, name=None):
    engine = current()
    is_root = engine.rank == root
    payload, invalid = _pickled(obj, "broadcast_object", name) if is_root else (b"", None)
    if invalid is not None:
        return engine.submit(Operation(engine, invalid))
    call = Call("broadcast_object", name=name, root=int(root), nbytes=len(payload))

    def move(engine, outcome):
        if is_root:
            engine.broadcast_bytes(np.frombuffer(payload, dtype=np.uint8).copy(), call.root, call.what)
            return obj
        data = np.empty(outcome.calls[call.root].nbytes, dtype=np.uint8)
        engine.broadcast_bytes(data, call.root, call.what)
        return pickle.loads(data.tobytes())

    return engine.submit(Operation(engine, call, move))


def allgather_object(obj, name=None):
    engine = current()
    pickled, invalid = _pickled(obj, "allgather_object", name)
    if invalid is not None:
        return engine.submit(Operation(engine, invalid))
    payload = np.frombuffer(pickled, dtype=np.uint8)
    call = Call("allgather_object", name=name, nbytes=payload.size)

    def move(engine, outcome):
        lengths = [c.nbytes for c in outcome.calls]
        data, offsets = engine.allgather_bytes(payload, lengths, call.what)
        return [pickle.loads(data[o:o + n].tobytes()) for o, n in zip(offsets, lengths)]

    return engine.submit(Operation(engine, call, move))


def barrier():
    engine = current()
    return engine.submit(Operation(engine, Call("barrier")))


def announce(kind, root=None):
    """A composite call's round (``broadcast_parameters``...): returns once every rank made
    the same call, after which the caller moves its data itself; raises the refusal."""
    engine = current()
    engine.submit(Operation(engine, Call(kind, root=None if root is None else int(root)))).wait()


def join(key, what):
    """Queue this rank's joined rounds (see :class:`JoinTicket`)."""
    engine = current()
    ticket = JoinTicket(engine, key, what)
    engine.submit(ticket)
    return ticket


# ------------------------------------------------------------------ handles by number
_numbers = itertools.count(1)
_handles = {}
_handles_lock = threading.Lock()


def number(handle):
    """Horovod's handles are integers: this one's, for poll() and synchronize()."""
    with _handles_lock:
        n = next(_numbers)
        _handles[n] = handle
    return n


def _lookup(n, what):
    with _handles_lock:
        handle = _handles.get(n)
    if handle is None:
        raise UsageError(f"{what}({n!r}): no such handle; it was synchronized already, or did not "
                         "come from an *_async call of this process")
    return handle


def poll(n):
    """Whether the operation of handle ``n`` has completed; never blocks."""
    return _lookup(n, "poll").poll()


def synchronize(n):
    """Wait for handle ``n``'s operation and return its result (once: the handle is then gone)."""
    handle = _lookup(n, "synchronize")
    try:
        return handle.wait()
    finally:
        if handle.poll():
            with _handles_lock:
                _handles.pop(n, None)
