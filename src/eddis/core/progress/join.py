"""``join()``: ranks with fewer batches than the others finish without hanging anyone.

Horovod's semantics: a rank that has run out of data calls ``join()``; until every
rank has joined, it keeps taking part in the gradient reductions the others still
do, contributing nothing, and ``join()`` then returns the same rank on every rank,
the one that joined last.

What a joined rank contributes. Zeros, with the weight :data:`JOINED_WEIGHT` in the
sample-weighted average (the smallest positive double: it vanishes exactly beside
any sample count, yet the weights of a step in which every rank has joined do not
sum to 0, which the servers refuse). So ``Average`` is the mean over the samples
of the ranks that still had data, the gradient of the batch that was really
computed. Horovod divides the sum by all ranks instead, which shrinks the step by
the share of ranks that joined; EDDIS keeps the step the one of the samples seen,
as its weighted reduction does everywhere. ``Sum`` is the sum over the ranks with
data, as in Horovod.

A joined rank steps its optimizer too. Each of its join steps hands the reduced
gradients to the wrapped optimizer like a normal step (the adapter's *idle step*),
so its parameters and optimizer state stay those of the others: the drift check
(EDDIS_CHECK_PARAMETERS) and balanced sync's collective decisions go on at the
same steps on every rank, and after ``join()`` every rank holds the final model.
A rank whose gradients go through a ``DistributedGradientTape`` has no optimizer
EDDIS can step: its variables stay where they were, and it leaves the drift
check to the others until it trains again (broadcast the last rank's variables
after ``join()``, as with Horovod).

How a joined rank learns whether another step comes, with nothing added to a
normal step's path:

- ``allreduce``: the one tiny allreduce every step already does (the total
  sample weight of the step, for ``Average``) carries a second number, how many
  ranks still have data. A step in which it is 0 is the last one. With ``Sum``
  that allreduce is new: one of two doubles per step.
- ``sync`` (every path: the servers' sum, the ranks' sum on one node, the
  hierarchy): a join board (:mod:`eddis.core.reduce.join_board`) of SMB counters, one per
  rank, created with the reducer; a rank that joins writes the step it joined at into its own
  (before it contributes to that step). After each step it took part in, a
  joined rank reads the board: once every rank has joined at that step or
  before, everyone contributed zeros to it, and every rank comes to that
  conclusion after the same step. The training ranks never touch the board.
- ``easgd`` (and ``hybrid`` with one rank a group): no rank waits for another in
  a step, so ``join()`` is a counted barrier on an SMB counter (bounded by
  EDDIS_COMM_TIMEOUT); the rank that arrived last is the one the last joined round
  names (its key is its place at the counter).

The collectives a script calls beside a joined rank (``eddis.allreduce`` of a metric,
``barrier``, ``allgather``, ``broadcast``, their ``*_async`` forms, the object
collectives, ``broadcast_parameters``...) are announced before they run
(:mod:`eddis.core.comm.engine`, :mod:`eddis.core.comm.negotiate`): while the joined rank's
optimizer takes its idle steps, its collectives thread announces ``joined`` and takes its
part in what the others call, as Horovod's joined ranks do: zeros in an allreduce
(``Average`` is then divided by all ranks, as in Horovod), nothing in a barrier; an
allgather, a broadcast or any call that moves a particular rank's data is refused with a
:class:`UsageError` on every rank that called it, as Horovod refuses it. The last round,
in which every rank announces ``joined``, carries every rank's join key (the step it
joined at, then the rounds it took part in before), so every rank names the same last one.

Every wait is bounded: a join step is a reduction step (EDDIS_COMM_TIMEOUT), the easgd
barrier counts with the same limit, and the joined rounds wait at most EDDIS_COMM_TIMEOUT
for the others' next call, a limit each of the joined rank's steps pushes back. A
collective that is not announced (``final_model``, a checkpoint) and that a training rank
calls while some rank has joined cannot be answered by the joined rank; it fails on the
training rank with a :class:`UsageError` naming the joined ranks (easgd: how many) within
a second or so (``probe``), instead of waiting out EDDIS_COMM_TIMEOUT.
"""
import logging
import sys
import weakref

from ... import settings
from ...errors import CollectiveTimeoutError, ConfigError, SMBTimeoutError, UsageError
from ..comm import engine, runtime, waits
from . import driver

log = logging.getLogger("eddis.core.join")

JOINED_WEIGHT = sys.float_info.min   # a joined rank's weight (see the module docstring)

_participants = []   # (weak reducer, weak idle step) registered by the adapters


def register(reducer, reduce_zeros, apply_result):
    """The adapter's two halves of a step of this rank without data on ``reducer``:
    ``reduce_zeros()`` contributes zeros and waits for the result, ``apply_result()``
    hands it to the optimizer and ends the step (hooks, drift check). The last step,
    in which every rank has joined, is reduced but not applied. Held weakly."""
    _participants[:] = [entry for entry in _participants
                        if entry[0]() is not None and entry[0]() is not reducer]
    _participants.append((weakref.ref(reducer), _weak_callable(reduce_zeros), _weak_callable(apply_result)))


def _weak_callable(fn):
    try:
        return weakref.WeakMethod(fn)
    except TypeError:  # a plain function or a closure: held as it is
        return lambda: fn


def _live():
    live = []
    for ref, reduce_ref, apply_ref in _participants:
        reducer, reduce_zeros, apply_result = ref(), reduce_ref(), apply_ref()
        if reducer is not None and reduce_zeros is not None and apply_result is not None \
                and not reducer.closed:
            live.append((reducer, (reduce_zeros, apply_result)))
    return live


def _joined_elsewhere(reducer):
    """Ranks that have joined while this one has not, as far as this rank can tell
    without waiting (None: it cannot tell)."""
    board = getattr(reducer, "join_board", None)
    if board is not None:
        if getattr(reducer, "joined", False):
            return []
        return [r for r, s in enumerate(board.join_steps()) if s is not None]
    active = getattr(reducer, "active_ranks", None)
    if active is None or getattr(reducer, "joined", False):
        return []
    return None if active >= reducer.size else ["some"]


def probe(what):
    """Called by a collective that has waited a while: a UsageError when the wait is
    for ranks that joined (they answer the gradient reduction only). Only the calls a
    script makes (``eddis.allreduce(...)``, ``eddis.barrier()``, ``eddis.shutdown``: their
    descriptions start with ``eddis.``): the collectives of a step (the drift check,
    balanced sync's exchange) are made by joined ranks too, and may just be slow."""
    if not str(what).startswith("eddis.") or engine.on_engine_thread():
        return   # the engine's calls are announced: a joined rank takes part or all refuse
    for reducer, _ in _live():
        try:
            joined = _joined_elsewhere(reducer)
        except Exception:  # noqa: BLE001 - a probe must never turn a wait into another error
            return
        if joined:
            who = "some ranks" if joined == ["some"] else f"rank(s) {joined}"
            _refuse(what, who)
    try:
        arrived = _elastic_arrivals()
    except Exception:  # noqa: BLE001 - as above
        return
    if arrived:
        _refuse(what, f"{arrived} of the {runtime.size()} ranks")


def _elastic_arrivals():
    """easgd: how many ranks wait in the current join() while this one is not in it."""
    state = driver.current()
    barrier = None if state is None else getattr(state, "join_barrier", None)
    if barrier is None or barrier.waiting:
        return 0
    return barrier.counter.read() - barrier.base - barrier.calls * runtime.size()


def _refuse(what, who):
    runtime.mark_broken(what)
    raise UsageError(
        f"{what}: {who} called eddis.join() and answer no other collective until every rank "
        "has joined (in sync and allreduce they take part in the gradient reductions only), so "
        "this collective would wait for them forever. Call it before join() on every rank, or "
        "after join() returned.")


waits.add_wait_probe(probe)


def _pick(live, what):
    if len(live) > 1:
        raise ConfigError(
            f"{what}: {len(live)} gradient reducers (DistributedOptimizers or gradient tapes over "
            "different variables) are open, and a joined rank cannot tell which of them the "
            "other ranks step next. Close the ones no longer used (optimizer.close()) or train "
            "through one DistributedOptimizer.")
    return live[0] if live else (None, None)


def last_joined(join_keys):
    """The rank that joined last: the one with the greatest join key (the steps it took
    before joining, then the collective rounds it took part in; of equals, the highest
    rank), so that every rank names the same one."""
    latest = max(join_keys)
    return max(r for r, key in enumerate(join_keys) if key == latest)


def join(what="eddis.join()"):
    """Collective: see the module docstring. Returns the rank that joined last."""
    runtime.require(what)
    if runtime.size() == 1:
        return 0
    reducer, idle_step = _pick(_live(), what)
    state = driver.current()
    mode = reducer.mode if reducer is not None else (state.mode if state is not None else None)
    if mode in ("easgd", "hybrid") or (reducer is None and state is not None and state.averager is not None):
        return _join_elastic(state, what)
    if reducer is None:
        # nothing reduces gradients: the joined rounds alone, until every rank has joined
        return last_joined(engine.join((0,), what).handle.wait())
    return _join_synchronous(reducer, idle_step, what)


def _join_synchronous(reducer, idle_step, what):
    if reducer.in_progress:
        raise UsageError(f"{what} was called while gradient buckets of a step are on their way: "
                         "call it after optimizer.step() (or synchronize()), between steps")
    start = reducer.step
    board = getattr(reducer, "join_board", None)
    saved_weight = reducer._weight
    ticket = engine.join((start,), what)
    reducer.joined = True
    if board is not None:
        board.publish(start)
    try:
        reduce_zeros, apply_result = idle_step
        while True:
            reducer.set_weight(JOINED_WEIGHT)
            reduce_zeros()
            ticket.alive()   # the others stepped with this rank: its joined rounds wait on
            step = reducer.step - 1
            if board is not None:
                if board.everyone_joined_by(step):
                    break
            elif reducer.active_ranks == 0:
                break
            apply_result()   # a step some rank had data for: take it as they do
    except BaseException:
        ticket.abandon()
        raise
    finally:
        reducer.joined = False
        reducer.active_ranks = None   # the last step's count would read as ranks joined
        if not reducer.in_progress and not reducer.closed:
            reducer.set_weight(saved_weight)
    if board is not None:
        board.since = step
    # every rank is here now, after the same step; the last joined round names them all
    last = last_joined(ticket.handle.wait())
    log.info("join: this rank joined at step %d, %d join step(s); last to join: rank %d",
             start, step + 1 - start, last)
    return last


class ElasticJoin:
    """easgd's counted barrier: one SMB counter, its base read at set-up (before the
    collective that ends it, so before any rank can count itself in)."""

    def __init__(self, client, name, mirrored=False):
        self.counter = client.counter(f"{name}.joined", mirrored=mirrored)
        self.base = self.counter.read()
        self.calls = 0          # join() calls this rank made
        self.waiting = False    # in one now


def _join_elastic(state, what):
    lockstep_group = state.group_comm is None or state.group_comm.Get_size() > 1
    if state.mode == "hybrid" and lockstep_group:
        raise ConfigError(
            f"{what} in mode hybrid: the ranks of a group reduce their gradients in lock-step, "
            "which a joined rank cannot follow across groups here. Give every rank the same "
            "number of batches in hybrid, or use mode easgd (each rank its own worker) or sync.")
    board = getattr(state, "join_barrier", None)
    if board is None:
        raise UsageError(f"{what}: mode {state.mode} has not set up its centre variable yet; "
                         "create the DistributedOptimizer (and take a step) on every rank first")
    if state.needs_centre:
        state.init_centre()   # the others wait for this rank there at their first step
    size = runtime.size()
    board.calls += 1
    order = board.counter.fetch_add(1) - board.base
    ticket = engine.join((order,), what)   # the others' metric collectives meanwhile
    target = board.base + board.calls * size
    timeout = settings.get("EDDIS_COMM_TIMEOUT")
    board.waiting = True
    try:
        board.counter.wait_for(target, timeout)
    except SMBTimeoutError as exc:
        ticket.abandon()
        missing = target - board.counter.read()
        raise CollectiveTimeoutError(
            f"{what} (mode {state.mode}): {missing} of the {size} ranks did not join within "
            f"{timeout:g} s. They are still training (raise EDDIS_COMM_TIMEOUT if they only need "
            "longer) or failed; every rank must call join() as often as the others.") from exc
    finally:
        board.waiting = False
    return last_joined(ticket.handle.wait())
