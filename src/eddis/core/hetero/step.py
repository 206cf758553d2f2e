"""Framework-agnostic step driver for the heterogeneity features.

What a framework adapter's optimizer wrapper needs for ``easgd``, ``hybrid``,
balanced ``sync``, the simulated slowdown and progress control, without
knowing the framework: the adapter gives the bucket plan, the reducer and two
functions that copy its parameters to and from a flat float32 vector in plan
layout (``gather(flat)``, ``scatter(flat)``), and calls the hooks:

    state = HeteroStep(plan, reducer, mode, balance, gather, scatter)
    state.before_push()     # before the step's first gradient bucket is marked ready
    state.before_sync()     # the step's gradients are final, before reducer.wait()
    ...                     # the wrapped optimizer's own update
    state.after_step()      # easgd/hybrid exchange when due, rebalancing, next step

Adapters that cannot call Python between the update and the next step as one
unit (TensorFlow graphs) split ``after_step`` into ``exchange_due()``,
``exchange_flat(flat)`` and ``end_step()``.

The algorithms themselves are the core's: :mod:`eddis.core.hetero.easgd`
(``ElasticAverager``), :mod:`eddis.core.hetero.hybrid` (group reducer and
``exchange_group``), :mod:`eddis.core.hetero.balance` (``Balancer``),
:mod:`eddis.core.hetero.simulate` (``Slowdown``) and :mod:`eddis.core.progress.counter`.
``should_stop()`` here wraps ``progress.should_stop()`` and notes when the
loop's waiting ended, so that waiting is not measured as compute.
"""
import itertools
import logging
import threading
import time
import warnings

import numpy as np

from ... import settings
from ...errors import ConfigError, FinalModelWarning, UsageError
from ...smb import rundir
from ..comm import collectives, connection, elastic, groups, runtime
from ..progress import counter as progress, driver, join
from . import balance as _balance
from . import easgd, hybrid, simulate

log = logging.getLogger("eddis.core.hetero")
CLOSE_TIMEOUT_S = 60.0   # how long close() waits for the other ranks before leaving the centre

_loop_mark = [0.0]  # when should_stop() last returned
_names = [0]
_serials = itertools.count(1)


def should_stop():
    """progress.should_stop(), noting when the loop's wait ended (not compute time).

    A rank that stops before its first step (the others claimed every iteration left, as
    after a resume near the total) still passes the centre variable's initialization, where
    the others wait for it at their first step; its end-of-training collectives then meet
    theirs."""
    try:
        stop = progress.should_stop()
    finally:
        _loop_mark[0] = time.perf_counter()
    state = driver.current()
    if stop and state is not None and state.needs_centre:
        state.init_centre()
    return stop


def centre_crosses_network(client):
    """EDDIS_EASGD_OVERLAP=auto (collective): whether some rank does not map every smb-server's
    memory, so that its exchanges with the centre (spread over every server) cross the network
    and are worth hiding behind the next step. On one node they are memory copies: a move one
    step stale would buy nothing."""
    far = len(client.mapped_servers()) < client.num_servers
    return any(collectives.allgather_object(far, what="easgd: does the centre cross the network?"))


class HeteroStep:
    """Heterogeneity hooks of one distributed optimizer (see the module docstring)."""

    def __init__(self, plan=None, reducer=None, mode=None, balance=None, gather=None, scatter=None,
                 measure_first_step=True, partial_copies=False):
        """``plan``/``reducer`` may come later (``attach``), when the framework knows its
        parameters only at the first step but the data pipeline needs the shares
        before. ``measure_first_step=False``: the first step's compute is not a
        measure of this rank's speed (a graph framework traces and compiles in it),
        so the simulated slowdown neither sleeps in it nor learns from it.
        ``partial_copies``: ``gather(flat, parts)`` and ``scatter(flat, parts)`` also copy only
        ``parts``, a list of ``(start, count)`` of the flat vector (what a striped exchange
        reads and moves; without it they copy every parameter)."""
        self.mode = str(settings.get("EDDIS_MODE") if mode is None else mode).lower()
        # the same on every rank, which builds its optimizers in the same order: what names
        # this optimizer's SMB objects that ranks set up apart, without a collective
        self.serial = next(_serials)
        initial = None
        if balance is None:
            balance = settings.get("EDDIS_BALANCE")
        elif isinstance(balance, (list, tuple, np.ndarray)):
            initial, balance = [float(w) for w in balance], True   # initial per-rank weights
        else:
            balance = bool(balance)
        self.rank, self.size = runtime.rank(), runtime.size()
        self.group, self.num_groups = runtime.group(), runtime.num_groups()
        self.plan = None
        self.reducer = None
        self.gather_fn = gather
        self.scatter_fn = scatter
        self.partial_copies = bool(partial_copies)
        self.step = 0
        self.slowdown = simulate.from_settings(self.rank, self.group, self.size, self.num_groups)
        self._lock = threading.Lock()
        self._pushed_step = -1
        self._compute_estimate = None
        self._slept_this_step = 0.0
        self._last = time.perf_counter()
        self._measure_first = bool(measure_first_step)
        self.global_batch = None
        self.balancer = None
        # the ranks that split one batch between them: every rank in sync, a group's in hybrid
        self.split_rank, self.split_size, split_comm, split_members = self.rank, self.size, None, None
        if self.mode == "hybrid" and self.size > 1:
            members = groups.group_members()
            split_members = members[self.group]
            split_comm = groups.group_comm()
            self.split_rank, self.split_size = split_members.index(self.rank), len(split_members)
        if balance:
            if self.mode not in ("sync", "allreduce", "hybrid"):
                raise ConfigError(f"balance=True balances synchronous training (mode 'sync', "
                                  f"'allreduce', or the groups of 'hybrid'), not mode {self.mode!r}: "
                                  "easgd already lets faster ranks do more iterations. Drop balance "
                                  "or use mode='sync' or 'hybrid'.")
            if initial is not None and split_members is not None:
                if len(initial) != self.size:
                    raise ConfigError(f"initial balance weights need one positive number per rank "
                                      f"({self.size}), got {initial}")
                initial = [initial[r] for r in split_members]   # the group's own ranks
            self.balancer = _balance.Balancer(self.split_size, self.split_rank, comm=split_comm,
                                              initial=initial)
        self.averager = None
        self.join_barrier = None   # easgd's counted barrier of eddis.join()
        self.elastic = self.size > 1 and elastic.requested(self.mode)   # refused in sync modes
        self.members = None   # elastic: who is alive (core/comm/elastic.py)
        self.group_comm = None
        self.exchanging = False
        self._centre_ready = False
        self._final_model_step = None   # self.step at the last final_model()
        self.stopped_for_checkpoint = None   # the checkpoint a requested stop wrote: not the end
        self._final_model_check = None
        self._centre_freed = False
        # EDDIS_EASGD_OVERLAP: a stripe exchanged in the background after every step, its move
        # applied a step later (auto: decided with the centre, _setup_averaging)
        self._overlap_setting = settings.get("EDDIS_EASGD_OVERLAP")
        self.overlap = self._overlap_setting is True
        self._move_pending = False
        self._move_part = None   # the stripe of the pending move: [(start, count), ...]
        self.flat = None
        self._when_attached = []   # e.g. a resumed centre variable, once its pool exists
        progress.set_mode_hint(self.mode)
        driver.make_current(self)
        if plan is not None:
            self.attach(plan, reducer)

    def attach(self, plan, reducer, gather=None, scatter=None):
        """The parameters' plan and the gradient reducer (collective for easgd/hybrid:
        the centre variable's pool is set up here). Attached again (other parameters), the
        old centre variable is freed first, as at close, and a new one set up."""
        if self.averager is not None:
            self.close()
        self._centre_freed = False
        self.plan = plan
        self.reducer = reducer
        if gather is not None:
            self.gather_fn = gather
        if scatter is not None:
            self.scatter_fn = scatter
        self.flat = np.empty(plan.total, dtype=np.float32)
        self.averager = None
        self._move_pending = False
        self._centre_ready = False
        if self.averages:
            self._setup_averaging()
        if self.global_batch is not None:
            self._set_weight(self.step)
        pending, self._when_attached = self._when_attached, []
        for fn in pending:
            fn(self)

    def on_attached(self, fn):
        """Call ``fn(self)`` once the parameters are attached (now, if they are): what a
        resume restores into the pools that ``attach`` creates (collective when ``fn`` is)."""
        if self.plan is not None:
            fn(self)
        else:
            self._when_attached.append(fn)

    def _setup_averaging(self):
        if self.elastic:
            self.members = elastic.join(self.mode)
        if self.mode == "hybrid":
            members = groups.group_members()
            hybrid.check_groups(members)
            worker, workers = self.group, len(members)
            self.group_comm = groups.group_comm()
            if workers == 1:
                # one group is plain sync: an elastic pull towards a centre that only
                # this group moves would merely damp its progress
                self.group_comm = None
                return
            iterations_per_step = len(members[self.group])
            if self.members is not None:
                self.members.depend_on(members[self.group], f"hybrid group {self.group}")
        else:
            worker, workers = self.rank, self.size
            iterations_per_step = 1
        _names[0] += 1
        name = collectives.broadcast_object(f"eddis.{self.mode}.centre.h{_names[0]}", root=0,
                                            what=f"{self.mode} set-up")
        client = connection.smb_client()
        mirrored = self.members is not None and elastic.mirroring(client)   # outlives a lost node
        self.averager = easgd.ElasticAverager(client, self.plan.total, worker, workers,
                                              alpha=hybrid.default_alpha(workers), name=name,
                                              iterations_per_step=iterations_per_step, mirrored=mirrored)
        # read before the centre's initialization barrier, which every rank passes before it joins
        self.join_barrier = join.ElasticJoin(client, name, mirrored=mirrored)
        self.exchanging = self.group_comm is None or self.group_comm.Get_rank() == 0
        if self._overlap_setting == "auto":
            self.overlap = centre_crosses_network(client)
        if self._final_model_check is None:
            self._final_model_check = _FinalModelCheck(self)
            runtime.register_closable(self._final_model_check)

    # ------------------------------------------------------------ parameters <-> flat
    def gather(self, parts=None):
        """The parameters into ``self.flat`` (``parts``: at least those ``(start, count)``)."""
        if self.gather_fn is None:
            raise UsageError("this HeteroStep was built without a gather function")
        if parts is None or not self.partial_copies:
            self.gather_fn(self.flat)
        elif parts:
            self.gather_fn(self.flat, parts)
        return self.flat

    def scatter(self, flat, parts=None):
        """``flat`` into the parameters (``parts``: only those ``(start, count)``, when the
        parameters outside them are as ``flat`` has them)."""
        if self.scatter_fn is None:
            raise UsageError("this HeteroStep was built without a scatter function")
        if parts is None or not self.partial_copies:
            self.scatter_fn(flat)
        elif parts:
            self.scatter_fn(flat, parts)

    # ------------------------------------------------------------ hooks
    def _compute_start(self):
        return max(self._last, _loop_mark[0])

    def before_push(self):
        """Before this step's first gradient bucket is marked ready: the simulated
        slowdown sleeps here, so a slowed rank's gradients really leave late."""
        if not self.slowdown.active or (self.step == 0 and not self._measure_first):
            return
        with self._lock:
            if self._pushed_step == self.step:
                return
            self._pushed_step = self.step
        estimate = self._compute_estimate
        if estimate is None:  # first step: what it computed so far
            estimate = time.perf_counter() - self._compute_start()
        self._slept_this_step = self.slowdown.stretch(estimate)

    def before_sync(self, flat=None):
        """The step's gradients are final. ``flat``: the parameters in plan layout, when
        the adapter has them at hand (else ``gather`` is used the first time, to
        initialize the centre variable)."""
        start = self._compute_start()
        elapsed = time.perf_counter() - start
        if self.slowdown.active and (self.step > 0 or self._measure_first):
            if self._pushed_step != self.step:  # no bucket was pushed (no gradients): sleep now
                self._pushed_step = self.step
                self._slept_this_step = self.slowdown.stretch(elapsed)
                elapsed += self._slept_this_step
            self._compute_estimate = max(0.0, elapsed - self._slept_this_step)
            self._slept_this_step = 0.0
        if self.balancer is not None and self.global_batch is not None:
            self.balancer.record(self.balancer.samples_for(self.step), elapsed, self._fixed_cost(start))
        if self.averager is not None and not self._centre_ready:
            self.init_centre(flat)

    def _fixed_cost(self, start):
        """Seconds from the end of the last step's reduction to this step's compute
        ``start`` (waking up, the optimizer's update, the counter claim), or None before
        a reduction."""
        completed = None if self.reducer is None else self.reducer.completed_at
        if completed is None or completed > start:
            return None
        return start - completed

    def init_centre(self, flat=None):
        """Collective: rank 0's parameters become the centre variable."""
        if self.rank == 0:
            self.averager.initialize(self.gather() if flat is None else flat)
        self._barrier(f"{self.mode}: centre variable initialization")
        self._centre_ready = True
        if self.members is not None:
            # every live rank is past the collectives of the set-up: from now on a lost rank
            # leaves the others training (eddis.launch.supervisor)
            rundir.note_training_started()

    @property
    def averages(self):
        """easgd/hybrid on several ranks: a centre variable, set up when the parameters attach."""
        return self.mode in ("easgd", "hybrid") and self.size > 1

    @property
    def needs_centre(self):
        return self.averager is not None and not self._centre_ready

    def exchange_due(self):
        """After this step: an exchange (EDDIS_EASGD_OVERLAP: after every step, a stripe's)."""
        return self.averager is not None and (self.overlap or self.averager.due(self.step) or self._move_pending)

    def exchange_flat(self, flat):
        """The elastic exchange on ``flat`` (plan layout, float32, moved in place).
        EDDIS_EASGD_OVERLAP: the move of the stripe begun a step before, if one was, then this
        step's stripe (``ElasticAverager.stripe``) begun in the background."""
        if self.overlap:
            self._apply_pending_move(flat)
            part = self.averager.stripe(self.step)
            if self.exchanging:
                self.averager.start_exchange(flat, part=part)
            self._move_part = part
            self._move_pending = True
        elif self.group_comm is None:
            self.averager.exchange(flat)
        else:
            hybrid.exchange_group(self.averager, flat, self.group_comm)
        return flat

    def settle_exchange(self):
        """Before a checkpoint: the pending move of an overlapped exchange applied to the
        parameters now (collective in a hybrid group), and this worker's last centre update
        waited for, so that what is saved is complete."""
        if self.averager is None:
            return
        if self._move_pending:
            parts = list(self._move_part)
            flat = self.gather(parts)
            self._apply_pending_move(flat)
            self.scatter(flat, parts)
        self.averager.finish()

    def _apply_pending_move(self, flat):
        """Overlapped exchanges: ``flat -= d`` of the exchange begun a step before (a hybrid
        group's leader passes its move to the members), if one was begun."""
        if not self._move_pending:
            return
        self._move_pending = False
        moves = self.averager.take_move() if self.exchanging else None
        for i, (lo, n) in enumerate(self._move_part):
            move = None if moves is None else moves[i]
            if self.group_comm is not None:
                move = hybrid.share_group_move(self.averager, move, self.group_comm, lo, n)
            np.subtract(flat[lo:lo + n], move, out=flat[lo:lo + n])

    def end_step(self):
        if self.balancer is not None:
            self.balancer.end_step(self.step)
        self.step += 1
        if self.global_batch is not None:
            self._set_weight(self.step)
        self._last = time.perf_counter()

    def after_step(self):
        """After the local update: exchange when due, then end the step. A striped exchange
        copies only the stripe it begins and the one whose move it applies."""
        if self.exchange_due():
            if self.overlap:
                applied = list(self._move_part) if self._move_pending else []
                flat = self.exchange_flat(self.gather(applied + self.averager.stripe(self.step)))
                self.scatter(flat, applied)
            else:
                self.scatter(self.exchange_flat(self.gather()))
        self.end_step()

    # ------------------------------------------------------------ batches
    def sizes_for(self, step, global_batch):
        if self.balancer is not None:
            return self.balancer.sizes_for(step, global_batch)
        if self.global_batch is None:
            self.global_batch = int(global_batch)
        return _balance.balanced_sizes(int(global_batch), [1.0] * self.split_size)

    def serve(self, step, global_batch):
        """The slice of batch ``step`` this rank computes; sets its weight. The batch is
        split among every rank, or in mode hybrid among the ranks of this rank's group
        (``global_batch``: the samples of one group step)."""
        sizes = self.sizes_for(step, global_batch)
        self.global_batch = int(global_batch)
        if self.balancer is not None:
            self.balancer.note_served(step)
        if step == self.step:
            self._set_weight(step)
        start = sum(sizes[:self.split_rank])
        return slice(start, start + sizes[self.split_rank])

    def _set_weight(self, step):
        if self.reducer is None:
            return  # attach() sets it
        if self.reducer.in_progress:
            return  # gradients of this step are already on their way; end_step sets the next
        self.reducer.set_weight(self.sizes_for(step, self.global_batch)[self.split_rank])

    # ------------------------------------------------------------ the final model
    def final_model(self):
        """Collective: make every rank's parameters the job's final model
        (easgd/hybrid: the centre variable; otherwise nothing to do)."""
        if self.plan is None and self.averages:
            raise UsageError(
                f"mode {self.mode}: this rank's DistributedOptimizer never saw the parameters (it "
                "took no training step, and nothing built it), so it cannot meet the others' "
                "centre variable set-up; build the optimizer on every rank before training "
                "(Keras: optimizer.build(model.trainable_variables), or eddis.resume(...))")
        if self.averager is None:
            return
        if self._centre_freed:
            raise UsageError(f"mode {self.mode}: the optimizer was closed, which released the centre "
                             "variable; call eddis.final_model() (or save the checkpoint) before "
                             "optimizer.close()")
        if not self._centre_ready:
            raise UsageError(f"mode {self.mode}: no training step was taken, so there is no centre "
                             "variable yet; ask for the final model after training")
        # a hybrid member with no move pending needs no copy of its parameters: the centre follows
        flat = self.gather() if self.exchanging or self._move_pending else None
        self._apply_pending_move(flat)   # collective in a hybrid group
        if self.exchanging:
            self.averager.exchange(flat, measure=False)   # the last local steps count too
        self.averager.finish()
        self._barrier(f"{self.mode}: final model (every worker's last exchange)")
        self.scatter(self.averager.read_center(out=self.flat))
        self._barrier(f"{self.mode}: final model (centre read)")
        self._final_model_step = self.step

    def close(self):
        """The optimizer's close, on every rank: free the centre variable's SMB memory once
        every rank has arrived (an SMB barrier, bounded by CLOSE_TIMEOUT_S, so a missing rank
        costs a wait and a warning, never a hang). Each optimizer has a centre of its own, so
        a job that builds several would otherwise fill the servers. Elastic runs keep it: a
        lost rank never arrives, and the servers free it when the job ends."""
        averager = self.averager
        if averager is None or self._centre_freed or self.members is not None:
            return
        self._centre_freed = True
        what = f"the {self.mode} centre variable {averager.name}"
        try:
            averager.finish()
        except Exception as exc:  # the servers free everything when they stop anyway
            log.warning("could not free %s: %s", what, exc)
            return
        connection.smb_client().free_when_all_arrive(
            averager.name + ".close", self.size, [averager.pool, averager.rates] if self.rank == 0 else [],
            CLOSE_TIMEOUT_S, what)

    def _barrier(self, what):
        """Every rank waits for every other; in elastic runs for the live ones only."""
        if self.members is not None:
            self.members.barrier(what)
        else:
            collectives.barrier(what=what)

    def steps_after_final_model(self):
        """Local steps trained since the last final_model() (all of them if it was never called)."""
        return self.step - (self._final_model_step or 0)


class _FinalModelCheck:
    """At eddis.shutdown(): warn when easgd/hybrid trained but the parameters were left as
    this worker's own. Nothing else tells: the script runs, saves and evaluates as usual,
    only on a worker's copy instead of the job's model (the centre variable).

    Rank 0 only: final_model() is collective, so every rank is in the same case, and one
    line says it; N copies of it would bury the rest of the output."""

    def __init__(self, state):
        self.state = state

    def close(self):
        state = self.state
        if state.rank != 0 or state.averager is None or state.stopped_for_checkpoint is not None:
            return  # a stop to be requeued is not the end of training: the centre lives on
        steps = state.steps_after_final_model()
        if steps <= 0:
            return
        when = ("was never called" if state._final_model_step is None
                else f"was last called {steps} step(s) before the end")
        # where the warning is raised says nothing to the script's author: name the call instead
        warnings.warn_explicit(
            f"mode {state.mode}: this rank trained {state.step} step(s), but eddis.final_model() "
            f"{when}, so the model's parameters are this worker's own, not the centre variable "
            "(the job's model): whatever the script evaluated or saved after training was one "
            "worker's drifted copy. Call eddis.final_model(optimizer) (collective, every rank) "
            "after training and before evaluating or saving, or save with "
            "eddis.save_checkpoint(...) (torch) / eddis.save_model(...) (TensorFlow), which call it.",
            FinalModelWarning, filename="eddis.shutdown()", lineno=0, module="eddis")
