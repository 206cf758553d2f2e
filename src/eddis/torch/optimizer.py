"""``DistributedOptimizer``: any torch optimizer, with gradients averaged over all ranks.

How a step goes:

1. At wrap time the parameters are laid out in a :class:`eddis.core.BucketPlan`
   (reverse order of definition, buckets of EDDIS_BUCKET_BYTES) and every rank
   checks that all ranks have the same layout (an MPI allgather of its digest).
2. During ``loss.backward()`` a post-accumulate-grad hook per parameter copies
   its final gradient into the plan's flat buffer (fp32, or fp64 when any parameter
   is float64: such a model is reduced in float64; CPU: a memcpy, or
   nothing when ``.grad`` already is the buffer's view; CUDA: an asynchronous
   copy into pinned host memory on a side stream). When all parameters of a
   bucket are in, the bucket is marked ready and the reducer's background
   thread puts it on the wire while backward goes on.
3. ``step()`` (or ``synchronize()``) marks any bucket not yet ready (parameters
   that got no gradient contribute zeros), waits only for buckets not done yet,
   hands the averaged gradients to ``.grad`` (CPU parameters of the buffer's dtype:
   ``.grad`` becomes a view of the buffer, no copy) and runs the wrapped optimizer's
   own ``step()``.
   When the wrapped optimizer updates each parameter from its own gradient and
   state alone (EDDIS_OVERLAP_OPTIMIZER), ``step()`` runs that update bucket by
   bucket instead, each as soon as its averaged gradients are in, so the update
   of the first buckets runs while the last ones still cross the network.
   With EDDIS_OVERLAP_FORWARD=on (sync, allreduce), ``step()`` returns before those
   updates, and the next forward applies each just before a module that owns one of
   its parameters runs (:mod:`eddis.torch.deferred`).
"""
import contextlib

import torch
from torch.optim import optimizer as torch_optimizer

from .. import settings, timeline
from ..core import make_reducer
from ..core.basics import basics as _basics
from ..core.comm import collectives, observe, runtime
from ..core.comm.ops import reject_unsupported_horovod_options
from ..core.progress import agreement as _core_agreement
from ..core.progress import join as _core_join
from ..errors import ConfigError, UsageError
from . import agreement, deferred, gradients, hetero
from .closure import AveragedClosure
from .compression import codec_of
from .ops import Average

# torch.optim's optimizers whose update of a parameter reads only its own gradient and state:
# their step() may run on a few parameters at a time (EDDIS_OVERLAP_OPTIMIZER=auto)
PER_PARAMETER_OPTIMIZERS = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD",
    "Rprop") if hasattr(torch.optim, name))


class _State:
    """What EDDIS keeps of one wrapped optimizer: its one attribute, ``_eddis``.

    ``feed``: the gradients' way into the reducer and back (:class:`GradientFeed`);
    ``hetero``: the heterogeneity hooks and step driver (:class:`eddis.torch.hetero.HeteroState`);
    ``synchronized``: this step's gradients are averaged in ``.grad`` (``synchronize()``);
    ``skip_sync``: inside ``skip_synchronize()``; ``whole_groups``: the param_groups' lists
    while ``step()`` updates a bucket at a time (the parameter agreement check reads them);
    ``steps``: ``step()`` calls so far (names a closure's evaluations across the ranks);
    ``closure_used``: a step took a closure (eddis.join() cannot stand in for one);
    ``deferred``: the last step's updates that wait for the next forward
    (:class:`eddis.torch.deferred.DeferredStep`, EDDIS_OVERLAP_FORWARD), else None;
    ``zero_grad``: zero_grad()'s ``set_to_none`` while they wait (applied to each bucket's
    gradients once its update is), else None.
    """

    def __init__(self, feed, hetero):
        self.feed = feed
        self.hetero = hetero
        self.synchronized = False
        self.skip_sync = False
        self.whole_groups = None
        self.steps = 0
        self.closure_used = False
        self.deferred = None
        self.zero_grad = None


class _DistributedOptimizer:
    """Methods mixed into a subclass of the user's optimizer class."""

    def _eddis_setup(self, named_parameters, compression, backward_passes_per_step, op,
                     mode, bucket_bytes, balance):
        params = []
        seen = set()
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    params.append(p)
        names = _parameter_names(params, named_parameters)
        if backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        op = _basics.gradient_op(op, "DistributedOptimizer", mode=mode)
        bucket_bytes = settings.get("EDDIS_BUCKET_BYTES") if bucket_bytes is None else int(bucket_bytes)
        plan, pinned = gradients.plan_of(params, names, bucket_bytes, settings.get("EDDIS_FIRST_BUCKET_BYTES"))
        layout = plan.signature() + "\n" + f"bpps:{backward_passes_per_step} op:{op.name}"
        collectives.check_same(
            layout, "DistributedOptimizer: the model's parameters (names and shapes, in order)",
            "Build the same model on every rank (same constructor arguments, same parameter "
            "order) and wrap the same optimizer; set EDDIS_BUCKET_BYTES, EDDIS_FIRST_BUCKET_BYTES "
            "and backward_passes_per_step alike everywhere.")
        self.reducer = make_reducer(mode, plan, compression=codec_of(compression), op=op.name,
                                    name=f"torch.{_next_instance_id()}")
        steps = hetero.HeteroState(params, plan, self.reducer, mode, balance)
        # before_push through the optimizer: the hooks on the parameters then keep the
        # optimizer alive as long as the model, and the step driver (which holds the
        # parameters) does; eddis.join() and the drift check at exit hold it only weakly
        feed = gradients.GradientFeed(params, plan, self.reducer, backward_passes_per_step, pinned,
                                      before_push=self._eddis_before_push)
        _core_join.register(self.reducer, self._eddis_join_reduce, self._eddis_join_apply)
        self._eddis = _State(feed, steps)
        if settings.get("EDDIS_OVERLAP_FORWARD") == "on":
            deferred.install()   # modules seen in the first forward already apply pending updates

    def _eddis_before_push(self):
        self._eddis.hetero.before_push()  # simulated slowdown: before gradients leave

    # ------------------------------------------------------------ public API
    def set_sample_count(self, samples):
        """Weight of this rank in the gradient average from the next step on: the
        number of samples it computes its (mean) loss over. Ranks with unequal
        batch shares then still get the gradient of the whole global batch."""
        self.reducer.set_weight(samples)

    def synchronize(self):
        """Finish this step's gradient averaging; afterwards ``.grad`` holds the result."""
        self.finish_step()
        self._eddis_send_rest()
        self._eddis.feed.take_result()
        self._eddis.synchronized = True

    def _eddis_send_rest(self, hooks=True):
        """The end of this step's backward passes: every bucket not sent yet goes now."""
        self._eddis.feed.deferred = None   # the last step's updates were all applied before
        if hooks:
            self._eddis.hetero.before_sync()  # end of this step's compute (balance, slowdown)
        self._eddis.feed.send_rest()

    def finish_step(self):
        """Apply the updates the last ``step()`` left for the next forward
        (EDDIS_OVERLAP_FORWARD=on); a no-op when none wait. Call it before reading the
        parameters other than through the model's forward or ``state_dict()`` (an EMA copy,
        ``p.data``), which otherwise see them as they were before the step."""
        state = self._eddis
        if state.deferred is not None:
            state.deferred.finish()

    def state_dict(self):
        self.finish_step()
        return super(_DistributedOptimizer, self).state_dict()

    def load_state_dict(self, state_dict):
        self.finish_step()
        return super(_DistributedOptimizer, self).load_state_dict(state_dict)

    def _eddis_join_reduce(self):
        """A step of a rank that has no data left (eddis.join(), which set the joined
        weight): zeros into the reduction, the others' result into .grad."""
        state = self._eddis
        self.finish_step()
        if state.closure_used:
            raise UsageError(
                "eddis.join() with an optimizer that steps with a closure (LBFGS): the others evaluate "
                "their closures several times a step, and a rank without data has nothing to evaluate. "
                "Give every rank a share of every step's batch instead (eddis.batch_slice; unequal "
                "shares weighted by set_sample_count) and call step(closure) on every rank.")
        state.feed.send_zeros()
        state.feed.take_result()
        state.synchronized = False

    def _eddis_join_apply(self):
        """The rest of that step, as the others take it: the wrapped optimizer's update (so
        this rank's parameters keep up with theirs), then the step's end (its hooks, the drift
        check, the step boundary)."""
        with timeline.span(timeline.OPTIMIZER_STEP):
            super(_DistributedOptimizer, self).step()
        _basics.end_of_step(self._eddis.hetero)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside, ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._eddis.skip_sync = True
        try:
            yield
        finally:
            self._eddis.skip_sync = False

    def step(self, closure=None):
        state = self._eddis
        self.finish_step()   # a step without a forward since the last one
        if closure is not None:
            result = self._eddis_closure_step(closure)
        elif state.skip_sync:
            if not state.synchronized:
                raise UsageError("step() inside skip_synchronize() without synchronize() first: "
                                 "call optimizer.synchronize() before the with-block")
        elif not state.synchronized and self._eddis_overlaps():
            self._eddis_send_rest()
            result = self._eddis_defer_updates() if self._eddis_defers() else self._eddis_step_by_bucket()
        elif not state.synchronized:
            self.synchronize()
        if state.synchronized:
            state.synchronized = False
            with timeline.span(timeline.OPTIMIZER_STEP):
                result = super(_DistributedOptimizer, self).step()
        state.steps += 1
        # easgd/hybrid exchange, rebalancing, the drift check, a checkpoint when the ranks agreed
        _basics.end_of_step(state.hetero)
        return result

    def _eddis_closure_step(self, closure):
        """The wrapped optimizer's step with a closure that averages every evaluation
        (eddis.torch.closure); at the end, every rank checks that all evaluated as often."""
        state = self._eddis
        mode = state.hetero.mode
        if mode in ("easgd", "hybrid"):
            raise UsageError(
                f"optimizer.step(closure) in mode {mode!r}: the elastic exchange moves the parameters "
                "between steps, which a closure optimizer such as LBFGS does not expect (its history "
                "assumes only its own updates), and the groups would evaluate different numbers of "
                "times. Use mode 'sync' or 'allreduce' for closure optimizers, or call loss.backward() "
                "yourself and optimizer.step() without a closure.")
        if state.skip_sync:
            raise UsageError("optimizer.step(closure) inside skip_synchronize(): the closure's gradients "
                             "are averaged at each evaluation; call step(closure) outside the with-block")
        if self.reducer.in_progress or any(state.feed.counts):
            # a backward before step(closure), on every rank: finish its averaging (the ranks
            # stay paired); the closure computes the gradients again
            self._eddis_synchronize_evaluation(first=False)
        state.synchronized = False
        state.closure_used = True
        evaluate = AveragedClosure(closure, state.steps, state.feed, self._eddis_synchronize_evaluation)
        with timeline.span(timeline.OPTIMIZER_STEP):
            result = super(_DistributedOptimizer, self).step(evaluate)
        evaluate.finish()
        # one step of the global batch's samples, however many evaluations it took
        observe.train_step_done(self.reducer, evaluate.samples)
        return result

    def _eddis_synchronize_evaluation(self, first):
        """One closure evaluation's averaging: like synchronize(), but the step's hooks for the
        end of compute (balancing, simulated slowdown) run at the first evaluation only, and
        its reduction is no step of its own for the progress line."""
        self._eddis_send_rest(hooks=first)
        self._eddis.feed.take_result(counted=False)

    def _eddis_overlaps(self):
        """Whether this step's update may run bucket by bucket (EDDIS_OVERLAP_OPTIMIZER)."""
        wanted = settings.get("EDDIS_OVERLAP_OPTIMIZER")
        feed = self._eddis.feed
        if wanted == "off" or feed.passthrough:
            return False
        if len(feed.plan.buckets) < 2:
            return False
        # a hook would run once per bucket, and may want the whole gradient
        global_hooks = [*torch_optimizer._global_optimizer_pre_hooks.values(),
                        *torch_optimizer._global_optimizer_post_hooks.values()]
        if self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks or not all(
                map(agreement.harmless_hook, global_hooks)):
            return False
        return wanted == "on" or type(self).__mro__[2] in PER_PARAMETER_OPTIMIZERS

    def _eddis_defers(self):
        """Whether this step's updates may wait for the next forward (EDDIS_OVERLAP_FORWARD)."""
        return (settings.get("EDDIS_OVERLAP_FORWARD") == "on"
                and self._eddis.hetero.mode in _core_agreement.SYNCHRONOUS_MODES)

    def _eddis_bucket_shares(self):
        """Per bucket, per param group, the group's parameters in that bucket (parameters
        outside the plan, which expect no gradient, go with the last bucket)."""
        feed = self._eddis.feed
        last = len(feed.plan.buckets) - 1
        shares = [[[] for _ in self.param_groups] for _ in feed.plan.buckets]
        for j, group in enumerate(self.param_groups):
            for p in group["params"]:
                shares[feed.bucket_of.get(id(p), last)][j].append(p)
        return shares

    def _eddis_update_bucket(self, k, shares):
        """The wrapped optimizer's update of bucket k's parameters, whose averaged gradients
        are in: its param_groups hold only those parameters for the call (every option and
        state entry stays the group's and the parameter's)."""
        state = self._eddis
        groups = self.param_groups
        state.feed.unstage(state.feed.plan.buckets[k].params)   # never passthrough (_eddis_overlaps)
        originals = [g["params"] for g in groups]
        state.whole_groups = originals   # what the parameter agreement check reads meanwhile
        try:
            for g, share in zip(groups, shares[k]):
                g["params"] = share
            with timeline.span(timeline.OPTIMIZER_STEP, args={"bucket": k}):
                super(_DistributedOptimizer, self).step()
        finally:
            for g, params in zip(groups, originals):
                g["params"] = params
            state.whole_groups = None

    def _eddis_step_by_bucket(self):
        """The wrapped optimizer's update, one bucket's parameters at a time, each as soon as
        that bucket's averaged gradients are in."""
        shares = self._eddis_bucket_shares()
        left = list(range(len(shares)))
        while left:
            k = self.reducer.wait_next(left)   # in the order the buckets come back
            left.remove(k)
            self._eddis_update_bucket(k, shares)
        self.reducer.wait()   # every bucket is in: this ends the reducer's step
        self._eddis.feed.reset_counts()
        return None

    def _eddis_defer_updates(self):
        """The updates wait for the next forward (eddis.torch.deferred): each bucket's is
        applied when a module that owns one of its parameters starts, or when something reads
        the parameters; the reducer's step ends once all are."""
        state = self._eddis
        shares = self._eddis_bucket_shares()
        feed = state.feed

        def apply_bucket(k):
            self._eddis_update_bucket(k, shares)
            if state.zero_grad is not None:   # zero_grad() came while this update waited
                for i in feed.plan.buckets[k].params:
                    p = feed.params[i]
                    if state.zero_grad:
                        p.grad = None
                    elif p.grad is not None:
                        p.grad.zero_()

        def done():
            self.reducer.wait()
            feed.reset_counts()
            state.deferred = None   # the feed asks it until the next step (a late parameter's gradient)
            state.zero_grad = None

        state.zero_grad = None
        feed.deferred = state.deferred = deferred.DeferredStep(
            feed.plan, feed.params, feed.names(), apply_bucket, self.reducer.wait_bucket, self.reducer.wait_next,
            done)
        return None

    def zero_grad(self, set_to_none=True):
        state = self._eddis
        if state.deferred is not None:
            # the pending updates still need their averaged gradients, which .grad will be
            state.zero_grad = bool(set_to_none)
            for p in state.feed.params:
                if state.deferred.bucket_of.get(id(p)) in state.deferred.left:
                    p.grad = None   # its update sets it again, then applies this call's wish
            super(_DistributedOptimizer, self).zero_grad(set_to_none=set_to_none)
            return None
        if self.reducer.in_progress:
            # Also reached by a loop that updates the parameters itself from the local
            # .grad (p.data.add_(p.grad, alpha=-lr)): its next zero_grad() lands here
            raise UsageError(
                "optimizer.zero_grad() found this step's gradient averaging still open: "
                "optimizer.step() or optimizer.synchronize() was not called after "
                "loss.backward(). Call optimizer.step() after backward(); to update the "
                "parameters by hand, call optimizer.synchronize() first and update from the "
                "averaged .grad (or use a torch.optim optimizer). If zero_grad() sits between "
                "backward() and step(), move it before backward().")
        return super(_DistributedOptimizer, self).zero_grad(set_to_none=set_to_none)

    def close(self):
        """Remove the hooks and stop the communication threads; in easgd and hybrid, also
        release the centre variable (call eddis.final_model() first; every rank)."""
        if not self.reducer.closed:
            self.finish_step()
        self._eddis.feed.close()
        self.reducer.close()
        self._eddis.hetero.close()   # easgd/hybrid: the centre variable's memory


_instances = [0]


def _next_instance_id():
    _instances[0] += 1
    return _instances[0]


def _parameter_names(params, named_parameters):
    if named_parameters is None:
        return [f"param.{i}" for i in range(len(params))]
    pairs = list(named_parameters)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in pairs):
        raise ConfigError("named_parameters must be a sequence of (name, parameter) pairs, "
                          "e.g. model.named_parameters()")
    names = [n for n, _ in pairs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"named_parameters has duplicate names: {', '.join(dupes[:5])}")
    by_id = {id(p): n for n, p in pairs}
    unnamed = [i for i, p in enumerate(params) if id(p) not in by_id]
    if unnamed:
        raise ConfigError(
            f"named_parameters was given, but {len(unnamed)} parameter(s) of the optimizer "
            "are not in it; pass model.named_parameters() of the model the optimizer trains.")
    return [by_id[id(p)] for p in params]


def _unwrapped_step(*args, **kwargs):
    raise UsageError(
        "step() was called on the original optimizer after it was wrapped: gradients would "
        "not be averaged over the ranks. Use the optimizer returned by "
        "eddis.DistributedOptimizer(...) (optimizer = eddis.DistributedOptimizer(optimizer, ...)).")


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=None,
                         mode=None, bucket_bytes=None, balance=None):
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks.

    Horovod's signature; EDDIS adds ``mode`` ("sync" through SMB, "allreduce"
    through MPI, "easgd" and "hybrid" for mixed GPU generations, see
    ``eddis.torch.hetero``; default EDDIS_MODE), ``balance`` (sync: shares of
    the global batch that follow each rank's speed; hybrid: shares of each group's batch
    among the group's ranks; default EDDIS_BALANCE) and
    ``bucket_bytes`` (default EDDIS_BUCKET_BYTES). ``compression`` defaults to EDDIS_COMPRESSION
    (Compression.none unless set). Gradients of ``backward_passes_per_step``
    backward passes are summed locally (autograd's accumulation) before the
    average over ranks. The returned object is an instance of a subclass of the
    optimizer's class sharing its state; use it instead of the original.
    """
    runtime.require("eddis.DistributedOptimizer()")
    if not isinstance(optimizer, torch.optim.Optimizer):
        hint = (" (you passed the model: wrap the optimizer, "
                "e.g. eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)))"
                if isinstance(optimizer, torch.nn.Module) else "")
        raise ConfigError(f"DistributedOptimizer needs a torch.optim.Optimizer, got "
                          f"{type(optimizer).__name__}{hint}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise UsageError("this optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    reject_unsupported_horovod_options(gradient_predivide_factor, groups, num_groups, process_set)
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    # an LR scheduler may have patched step() on the instance: keep only the class's
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    wrapped._eddis_setup(named_parameters, compression, backward_passes_per_step, op, mode, bucket_bytes,
                         balance)
    optimizer.step = _unwrapped_step
    return wrapped
