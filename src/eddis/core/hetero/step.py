"""Framework-agnostic step driver for the heterogeneity features.

What a framework adapter's optimizer wrapper needs for ``easgd``, ``hybrid``,
balanced ``sync``, the simulated slowdown and progress control, without
knowing the framework: the adapter gives the bucket plan, the reducer and two
functions that copy its parameters to and from a flat float32 vector in plan
layout (``gather(flat)``, ``scatter(flat)``), and calls the driver:

    state = HeteroStep(plan, reducer, mode, balance, gather, scatter)
    state.before_push()     # before the step's first gradient bucket is marked ready
    state.before_sync()     # the step's gradients are final, before reducer.wait()
    ...                     # the wrapped optimizer's own update
    state.after_step()      # easgd/hybrid exchange when due, rebalancing, next step

Adapters that cannot call Python between the update and the next step as one
unit (TensorFlow graphs) split ``after_step`` into ``exchange_due()``,
``exchange_flat(flat)`` and ``end_step()``.

The driver knows no mode. The modes register hooks on it (:mod:`.hooks`), built once from
the mode: the simulated slowdown where it is active (:mod:`.slowdown_hook`), the cut of each
global batch, balanced with ``balance`` (:mod:`.shares`), the elastic averaging through the
centre variable in easgd and hybrid on several ranks (:mod:`.averaging`) and, where there is
a centre, the final model (:mod:`.final`); the driver calls each at each point of the step, in
that order. ``should_stop()`` here wraps ``progress.should_stop()`` and notes when the loop's
waiting ended, so that waiting is not measured as compute.
"""
import itertools
import time

import numpy as np

from ... import settings
from ...errors import UsageError
from ..comm import elastic, groups, runtime
from ..progress import counter as progress, driver
from . import averaging, final, shares, simulate
from .slowdown_hook import SlowdownHook

_loop_mark = [0.0]  # when should_stop() last returned
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


class HeteroStep:
    """The step driver of one distributed optimizer (see the module docstring)."""

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
        self._last = time.perf_counter()
        self.stopped_for_checkpoint = None   # the checkpoint a requested stop wrote: not the end
        self.flat = None
        self._when_attached = []   # e.g. a resumed centre variable, once its pool exists
        self._hooks = self._register_hooks(balance, initial, measure_first_step)
        progress.set_mode_hint(self.mode)
        driver.make_current(self)
        if plan is not None:
            self.attach(plan, reducer)

    def _register_hooks(self, balance, initial, measure_first_step):
        """The modes' hooks, in the order the driver calls them at each point of a step; sets
        ``shares`` (the batch cut), ``centre`` (the centre variable, or ``NoCentre``) and
        ``final`` (the final model)."""
        hooks = []
        if self.slowdown.active:
            hooks.append(SlowdownHook(self, self.slowdown, measure_first_step))
        group_members, group = None, None
        if self.mode == "hybrid" and self.size > 1:
            group_members = groups.group_members()   # collective: once, for the cut and the centre
            group = (group_members[self.group], groups.group_comm())
        self.shares = shares.for_mode(self, self.mode, balance, initial, group)
        hooks.append(self.shares)
        self.elastic = self.size > 1 and elastic.requested(self.mode)   # refused in sync modes
        if self.averages:
            self.centre = averaging.ElasticAveraging(self, self.elastic, group_members)
            self.final = final.CentreFinalModel(self, self.centre)
            hooks += [self.centre, self.final]
        else:
            self.centre, self.final = averaging.NoCentre(self.mode), final.FinalModel()
        return hooks

    def attach(self, plan, reducer, gather=None, scatter=None):
        """The parameters' plan and the gradient reducer (collective for easgd/hybrid:
        the centre variable's pool is set up here). Attached again (other parameters), the
        old centre variable is freed first, as at close, and a new one set up."""
        self.plan = plan
        self.reducer = reducer
        if gather is not None:
            self.gather_fn = gather
        if scatter is not None:
            self.scatter_fn = scatter
        self.flat = np.empty(plan.total, dtype=np.float32)
        for hook in self._hooks:
            hook.on_attach(plan, reducer)
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

    # ------------------------------------------------------------ the step
    def compute_start(self):
        """When this step's compute began: the end of the last step, or of the loop's wait
        in should_stop() when that came later."""
        return max(self._last, _loop_mark[0])

    def before_push(self):
        """Before this step's first gradient bucket is marked ready: the simulated
        slowdown sleeps here, so a slowed rank's gradients really leave late."""
        for hook in self._hooks:
            hook.before_push()

    def before_sync(self, flat=None):
        """The step's gradients are final. ``flat``: the parameters in plan layout, when
        the adapter has them at hand (else ``gather`` is used the first time, to
        initialize the centre variable)."""
        start = self.compute_start()
        elapsed = time.perf_counter() - start
        for hook in self._hooks:
            elapsed = hook.before_sync(elapsed, start, flat)

    def after_step(self):
        """After the local update: the modes' work on it (the exchange when due), then end the step."""
        for hook in self._hooks:
            hook.after_update()
        self.end_step()

    def end_step(self):
        for hook in self._hooks:
            hook.end_step(self.step)
        self.step += 1
        for hook in self._hooks:
            hook.start_step(self.step)
        self._last = time.perf_counter()

    def close(self):
        """The optimizer's close, on every rank (easgd/hybrid: the centre variable's SMB
        memory given back once every rank arrived, :meth:`.averaging.ElasticAveraging.close`)."""
        for hook in self._hooks:
            hook.close()

    # ------------------------------------------------------------ the centre variable
    @property
    def averages(self):
        """easgd/hybrid on several ranks: a centre variable, set up when the parameters attach."""
        return self.mode in ("easgd", "hybrid") and self.size > 1

    averager = property(lambda self: self.centre.averager)
    members = property(lambda self: self.centre.members, doc="elastic runs: who is alive")
    group_comm = property(lambda self: self.centre.group_comm, doc="hybrid: the group's, between groups")
    join_barrier = property(lambda self: self.centre.join_barrier, doc="easgd's counted barrier of join()")
    exchanging = property(lambda self: self.centre.exchanging)
    overlap = property(lambda self: self.centre.overlap, doc="EDDIS_EASGD_OVERLAP as decided")
    centre_ready = property(lambda self: self.centre.centre_ready)
    needs_centre = property(lambda self: self.centre.needs_centre)

    def init_centre(self, flat=None):
        """Collective: rank 0's parameters become the centre variable."""
        self.centre.init_centre(flat)

    def centre_restored(self):
        """A resume wrote the centre variable: no rank initializes it from its parameters."""
        self.centre.centre_ready = True

    def exchange_due(self):
        """After this step: an exchange (EDDIS_EASGD_OVERLAP: after every step, a stripe's)."""
        return self.centre.exchange_due(self.step)

    def exchange_flat(self, flat):
        """The elastic exchange on ``flat`` (plan layout, float32, moved in place)."""
        return self.centre.exchange_flat(flat, self.step)

    def settle_exchange(self):
        """Before a checkpoint: the exchange under way applied and waited for, so that what
        is saved is complete."""
        self.centre.settle()

    # ------------------------------------------------------------ batches
    balancer = property(lambda self: self.shares.balancer)
    global_batch = property(lambda self: self.shares.global_batch)
    # the ranks that split one batch between them: every rank in sync, a group's in hybrid
    split_rank = property(lambda self: self.shares.split_rank)
    split_size = property(lambda self: self.shares.split_size)

    def sizes_for(self, step, global_batch):
        return self.shares.sizes_for(step, global_batch)

    def serve(self, step, global_batch):
        """The slice of batch ``step`` this rank computes; sets its weight. The batch is
        split among every rank, or in mode hybrid among the ranks of this rank's group
        (``global_batch``: the samples of one group step)."""
        return self.shares.serve(step, global_batch)

    # ------------------------------------------------------------ the final model
    def final_model(self):
        """Collective: make every rank's parameters the job's final model
        (easgd/hybrid: the centre variable; otherwise nothing to do)."""
        self.final.final_model()

    def steps_after_final_model(self):
        """Local steps trained since the last final_model() (all of them if it was never called)."""
        return self.final.steps_after(self.step)
