"""Gradient reducers: average a flat buffer over all ranks, bucket by bucket,
on background threads, while the framework is still computing.

The buffer holds the plan's dtype (``plan.dtype``): float32, or float64 for float64
models, which every mode that takes them reduces in float64 (``Compression.none``
is exact); modes and codecs that cannot refuse a float64 plan with a ConfigError.

A framework adapter owns a :class:`~eddis.core.layout.buckets.BucketPlan`, fills
``plan.buffer`` with the local gradients and calls, for each step::

    reducer.set_weight(samples)   # optional: this rank's sample count (default 1)
    reducer.mark_ready(k)         # bucket k of plan.buffer holds final local gradients
    ...                           # (from backward hooks, in any order, any thread)
    reducer.wait()                # all buckets reduced: plan.buffer holds the result

or ``reducer.reduce(weight)`` for all buckets at once. ``op="average"`` gives
``sum_i w_i g_i / sum_i w_i`` (with equal weights, the plain mean), so ranks with
unequal shares of a global batch still compute the gradient of the whole batch;
``op="sum"`` gives ``sum_i g_i``; ``op="adasum"`` the Adasum of the ranks' gradients
per tensor (``eddis.core.comm.adasum``; no weights).

Buckets go on the wire strictly in plan order (bucket 0 first), the same on
every rank. A *submit* thread compresses and sends bucket k as soon as it is
ready; a *finish* thread collects the results and decompresses them into
``plan.buffer``; so sending bucket k+1 overlaps receiving bucket k, and both
overlap the backward pass.

This module holds the base class of every mode: the threads, the bucket state, the events.
:mod:`eddis.core.reduce.registry` knows the modes and builds one (``make_reducer(mode, plan,
...)``).

Observability: ``add_listener(fn)`` calls ``fn(event, step, bucket, nbytes,
t_ns)`` for ``ready``, ``push_start``, ``push_end`` and ``done`` events (from
the thread where they happen); ``record_events()`` keeps them in
``event_log``; ``stats`` counts steps, buckets, bytes and ``overlapped`` (pushes
that started while some bucket of the same step was not ready yet).
"""
import logging
import queue
import threading
import time

from ... import settings
from ...errors import ConfigError, ReductionError, ReductionTimeoutError, UsageError
from ..comm import adasum, observe, runtime
from ..layout.compression import get_codec

log = logging.getLogger("eddis.core.reducer")
_built = [0]  # gradient reducers built in this process: something synchronises the ranks


def any_built():
    """Whether this process built a gradient reducer (a DistributedOptimizer or gradient tape)."""
    return _built[0] > 0


INNER_ERROR_GRACE = 1.0
# how often the finish thread looks at the buckets that wait for other ranks (_settle)
FINISH_POLL_S = 0.001


def check_total(total, step, who):
    """The zero-total rule, the same in every mode: a step whose weights add up to 0 over all
    of ``who`` (every rank contributed zero samples) has no average, and its reduction fails
    here instead of dividing by 0 or handing on zeros as if they were a gradient. (A rank in
    eddis.join() weighs the smallest positive double, so that a step of joined ranks only never
    adds up to 0; a part of a step, one node of the hierarchy, may: it then contributes nothing.)"""
    if not total > 0:
        raise ConfigError(f"step {step}: the sample counts of {who} add up to {total:g}, so the step "
                          "has no average to take: every step needs samples on some rank (check "
                          "set_sample_count / sample_count=), or reduce with op=Sum")


def op_name(op):
    key = str(getattr(op, "name", op)).lower()
    if key in ("average", "mean", "avg"):
        return "average"
    if key in ("sum", "adasum"):
        return key
    raise ConfigError(f"unknown reduction op {op!r}; use Average, Sum or Adasum")


class Reducer:
    """Base class: threads, bucket state, events. Subclasses implement
    ``_prepare_step()``, ``_submit(k) -> token``, ``_finish(k, token)`` and
    optionally ``_relay_loop()`` and ``_release()``.

    A mode whose bucket passes a stage between the two that waits on other ranks (the
    servers' sum of it) defines ``_relay_loop``, which takes the submitted ``(k, token)``
    items from ``_queue`` and hands ``(k, token)`` items to ``_relayed`` until it takes
    None, which it passes on: a thread of its own then runs it, so that the submit thread
    goes on to the next bucket meanwhile, and the finish thread's waits for bucket k never
    hold back what bucket k+1 can already post.

    ``_finish`` may return the buckets it completed (default: bucket k); a mode whose
    buckets complete once other ranks are done too returns none there, says with
    ``_unsettled()`` that some are still open, and ``_settle()`` returns those that
    completed since (polled while the finish thread has nothing else to do).
    """

    mode = None

    def __init__(self, plan, compression="none", op="average", timeout=None, name="grads"):
        self.plan = plan
        self.codec = get_codec(compression).for_dtype(plan.dtype)
        self.op = op_name(op)
        self.timeout = settings.get("EDDIS_COMM_TIMEOUT") if timeout is None else float(timeout)
        self.name = name
        self.rank = runtime.rank()
        self.size = runtime.size()
        self.num_buckets = len(plan.buckets)
        self.listeners = []
        self.event_log = None
        self.stats = {"steps": 0, "buckets": 0, "bytes_sent": 0, "bytes_received": 0, "overlapped": 0}
        self._cond = threading.Condition()
        self._ready = [False] * self.num_buckets
        self._done = [False] * self.num_buckets
        self._fences = [None] * self.num_buckets
        self._nready = 0
        self._weight = 1.0
        self._step_weight = 1.0
        self.weight_given = False  # set_weight() was called: the weight is a sample count
        self.step = 0
        self.completed_at = None   # perf_counter() when the last step's reduction completed here
        # every rank's weight of the last step added up, where the mode's reduction learns it
        # (the job's samples, when the weights are sample counts); None: unknown
        self.total_weight = None
        self._error = None
        self._closed = False
        self._threads = []
        # eddis.join(): this rank contributes zeros (eddis.core.progress.join); how many ranks had data
        # in the last step, where the mode's step tells (allreduce); the SMB modes' board
        self.joined = False
        self.active_ranks = None
        self.join_board = None
        _built[0] += 1
        observe.attach_reducer(self)  # timeline/profile listener, only when on

    @property
    def closed(self):
        return self._closed

    @property
    def weight(self):
        """This rank's weight in the average of the steps marked from now on."""
        return self._weight

    # ------------------------------------------------------------ lifecycle
    def _start_threads(self):
        self._queue = queue.Queue()
        loops = [(self._submit_loop, "submit"), (self._finish_loop, "finish")]
        self._relayed = self._queue
        if self._relay_loop is not None:
            self._relayed = queue.Queue()
            loops.insert(1, (self._run_relay, "relay"))
        for target, tag in loops:
            t = threading.Thread(target=target, name=f"eddis-{self.mode}-{tag}", daemon=True)
            t.start()
            self._threads.append(t)
        runtime.register_closable(self)

    def close(self):
        """Stop the threads and release communication resources (idempotent)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._threads:
            self._queue.put(None)
            for t in self._threads:
                t.join(timeout=5.0)
        runtime.unregister_closable(self)
        self._release()

    def _release(self):
        pass

    # ------------------------------------------------------------ events
    def add_listener(self, fn):
        self.listeners.append(fn)

    def record_events(self, on=True):
        self.event_log = [] if on else None

    def _emit(self, event, bucket, nbytes=0, t=None):
        if t is None:
            t = time.perf_counter_ns()
        if self.event_log is not None:
            self.event_log.append((t, event, self.step, bucket))
        for fn in self.listeners:
            try:
                fn(event, self.step, bucket, nbytes, t)
            except Exception:  # an observer must never break training
                log.exception("reducer listener failed")

    # ------------------------------------------------------------ framework side
    def set_weight(self, weight):
        """This rank's weight (sample count) in the average, from the next step on."""
        weight = float(weight)
        if not weight >= 0:
            raise ConfigError(f"reduction weight must be >= 0, got {weight}")
        if self.op == "adasum":
            adasum.check_weight(weight)
        with self._cond:
            if self._nready:
                raise UsageError("set the sample count before backward(): some gradient "
                                 "buckets of this step are already on their way")
            self._weight = weight
            self.weight_given = True

    def mark_ready(self, k, fence=None):
        """Bucket ``k`` of ``plan.buffer`` holds this rank's final gradients for this step.

        ``fence``: an object whose ``synchronize()`` returns once the data is really
        in ``plan.buffer`` (a CUDA event after an asynchronous device-to-host copy);
        the communication thread calls it before reading the bucket.
        """
        with self._cond:
            self._check_usable()
            if self._ready[k]:
                raise UsageError(
                    f"gradient bucket {k} was marked ready twice in one step: backward() ran "
                    "more often than backward_passes_per_step before optimizer.step(). Call "
                    "step() (or synchronize()) after each backward, or raise "
                    "backward_passes_per_step.")
            if self._nready == 0:
                self._step_weight = self._weight
            self._ready[k] = True
            self._fences[k] = fence
            self._nready += 1
            # stamped before the communication thread can take the bucket: stamped after, a
            # descheduled caller put "ready" after that bucket's push on the timeline
            ready_ns = time.perf_counter_ns()
            self._cond.notify_all()
        self._emit("ready", k, t=ready_ns)

    def mark_all_ready(self):
        for k in range(self.num_buckets):
            if not self._ready[k]:
                self.mark_ready(k)

    def pending(self):
        """Buckets not marked ready in this step."""
        return [k for k in range(self.num_buckets) if not self._ready[k]]

    @property
    def in_progress(self):
        return self._nready > 0

    def wait(self, timeout=None, counted=True):
        """Wait until every bucket of this step is reduced; then start the next step.
        ``counted``: this reduction ends a training step (False: one of several in a step,
        such as a closure's evaluations; the adapter tells ``observe.train_step_done``)."""
        waited_from = time.perf_counter_ns()
        with self._cond:
            self._wait_locked(lambda: all(self._done), timeout)
            self._ready = [False] * self.num_buckets
            self._done = [False] * self.num_buckets
            self._nready = 0
            self.step += 1
            self.stats["steps"] += 1
        observe.reducer_waited(self, waited_from, counted)

    def wait_bucket(self, k, timeout=None):
        """Wait until bucket ``k`` of this step is reduced (its result is in ``plan.buffer``),
        while later buckets may still be on their way; the step still ends with :meth:`wait`."""
        waited_from = time.perf_counter_ns()
        with self._cond:
            self._wait_locked(lambda: self._done[k], timeout)
        observe.reducer_waited_bucket(self, k, waited_from)

    def wait_next(self, waiting, timeout=None):
        """Wait until one of the buckets ``waiting`` of this step is reduced and return it
        (of several, the first in ``waiting``): the buckets need not complete in plan order."""
        waited_from = time.perf_counter_ns()
        with self._cond:
            self._wait_locked(lambda: any(self._done[k] for k in waiting), timeout)
            k = next(k for k in waiting if self._done[k])
        observe.reducer_waited_bucket(self, k, waited_from)
        return k

    def _wait_locked(self, finished, timeout):
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self._check_usable()
        while not finished() and self._error is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                # the comm threads' own waits end at about the same time, and their error
                # says whom they waited for: give it a moment to arrive
                self._cond.wait(INNER_ERROR_GRACE)
                inner = f" ({self._error})" if isinstance(self._error, TimeoutError) else ""
                not_ready = [k for k in range(self.num_buckets) if not self._ready[k]]
                unfinished = [k for k in range(self.num_buckets) if self._ready[k] and not self._done[k]]
                raise ReductionTimeoutError(
                    f"step {self.step}: gradient reduction ({self.mode}) did not finish within "
                    f"{timeout:g} s; buckets not marked ready here: {not_ready or 'none'}, "
                    f"ready but not reduced (waiting for other ranks): {unfinished or 'none'}{inner}. "
                    "Another rank failed or is far slower; raise EDDIS_COMM_TIMEOUT if it is slow.")
            self._cond.wait(remaining)
        self._check_usable()

    def reduce(self, weight=None):
        """Reduce the whole buffer now (for frameworks without per-parameter hooks)."""
        if weight is not None:
            self.set_weight(weight)
        self.mark_all_ready()
        self.wait()

    def _check_usable(self):
        if self._error is not None:
            raise ReductionError(
                f"gradient reduction ({self.mode}) failed on rank {self.rank}: "
                f"{type(self._error).__name__}: {self._error}") from self._error
        if self._closed:
            raise UsageError("this reducer was closed (eddis.shutdown() or optimizer closed)")

    # ------------------------------------------------------------ comm threads
    def _fail(self, exc):
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def _submit_loop(self):
        try:
            my_step = 0
            while True:
                for k in range(self.num_buckets):
                    with self._cond:
                        while not (self._ready[k] and self.step == my_step) and not self._closed:
                            self._cond.wait()
                        if self._closed:
                            return
                        overlapped = self._nready < self.num_buckets
                        fence = self._fences[k]
                    if fence is not None:
                        fence.synchronize()
                    nbytes = self.plan.buckets[k].count * self.codec.itemsize
                    self._emit("push_start", k, nbytes)
                    if k == 0:
                        self._prepare_step()
                    token = self._submit(k)
                    self._emit("push_end", k, nbytes)
                    self.stats["bytes_sent"] += nbytes
                    if overlapped:
                        self.stats["overlapped"] += 1
                    self._queue.put((k, token))
                my_step += 1
        except BaseException as exc:
            self._fail(exc)

    def _run_relay(self):
        try:
            self._relay_loop()
        except BaseException as exc:
            self._relayed.put(None)   # the finish thread ends too; the waits report the error
            self._fail(exc)

    def _take_handed_over(self, busy):
        """The relay's next item from the submit thread: ``(k, token)``; False when none is
        there and the relay is ``busy`` (it waits for one otherwise); None at the end, which
        goes on to the finish thread."""
        try:
            item = self._queue.get_nowait() if busy else self._queue.get()
        except queue.Empty:
            return False
        if item is None:
            self._relayed.put(None)
        return item

    def _finish_loop(self):
        try:
            while True:
                try:
                    item = self._relayed.get(timeout=FINISH_POLL_S if self._unsettled() else None)
                except queue.Empty:
                    item = False
                if item is None:
                    return
                done = []
                if item:
                    k, token = item
                    done = self._finish(k, token)
                    done = [k] if done is None else list(done)
                if self._unsettled():
                    done += self._settle()
                for k in done:
                    self._complete(k)
        except BaseException as exc:
            self._fail(exc)

    def _complete(self, k):
        self.stats["buckets"] += 1
        self.stats["bytes_received"] += self.plan.buckets[k].count * self.codec.itemsize
        self._emit("done", k)
        with self._cond:
            self._done[k] = True
            if all(self._done):
                # the reduction needs every rank: about when the step ended for all
                self.completed_at = time.perf_counter()
            self._cond.notify_all()

    # ------------------------------------------------------------ subclass API
    def _prepare_step(self):
        pass

    def _submit(self, k):
        raise NotImplementedError

    _relay_loop = None   # the mode's relay stage, on a thread of its own (class docstring)

    def _finish(self, k, token):
        return None

    def _unsettled(self):
        return False

    def _settle(self):
        return []
