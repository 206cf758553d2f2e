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
"""
import contextlib
import threading

import torch
from torch.optim import optimizer as torch_optimizer

from .. import settings, timeline
from ..core import BucketPlan, LocalReducer, make_reducer
from ..core.basics import basics as _basics
from ..core.comm import collectives, observe, runtime
from ..core.comm.ops import reject_unsupported_horovod_options
from ..core.layout.buckets import gradient_dtype
from ..core.progress import join as _core_join
from ..errors import ConfigError, UsageError
from . import agreement, hetero
from .closure import AveragedClosure
from .compression import codec_of
from .ops import Average
from .samples import ForwardSampleCounter

# torch.optim's optimizers whose update of a parameter reads only its own gradient and state:
# their step() may run on a few parameters at a time (EDDIS_OVERLAP_OPTIMIZER=auto)
PER_PARAMETER_OPTIMIZERS = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD",
    "Rprop") if hasattr(torch.optim, name))


class _CudaFence:
    """A CUDA event the communication thread waits on before reading host memory."""

    def __init__(self, event):
        self.event = event

    def synchronize(self):
        self.event.synchronize()


class _DistributedOptimizer:
    """Methods mixed into a subclass of the user's optimizer class."""

    def _eddis_setup(self, named_parameters, compression, backward_passes_per_step, op,
                     mode, bucket_bytes):
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
        plan = BucketPlan([(n, tuple(p.shape)) for n, p in zip(names, params)], bucket_bytes,
                          dtype=gradient_dtype(str(p.dtype).replace("torch.", "") for p in params))
        devices = {p.device.type for p in params}
        if "cuda" in devices:
            pinned = torch.zeros(plan.total, dtype=getattr(torch, plan.dtype.name), pin_memory=True)
            plan.use_buffer(pinned.numpy())
            self._eddis_stream = torch.cuda.Stream(device=next(p.device for p in params if p.is_cuda))
        else:
            pinned = None
            self._eddis_stream = None
        layout = plan.signature() + "\n" + f"bpps:{backward_passes_per_step} op:{op.name}"
        collectives.check_same(
            layout, "DistributedOptimizer: the model's parameters (names and shapes, in order)",
            "Build the same model on every rank (same constructor arguments, same parameter "
            "order) and wrap the same optimizer; set EDDIS_BUCKET_BYTES and "
            "backward_passes_per_step alike everywhere.")
        self._eddis_params = params
        self._eddis_plan = plan
        self._eddis_bucket_of = {id(params[i]): k for k, b in enumerate(plan.buckets) for i in b.params}
        self._eddis_bpps = int(backward_passes_per_step)
        self._eddis_counts = [0] * len(params)
        self._eddis_left = [len(b.params) for b in plan.buckets]
        self._eddis_events = [None] * len(plan.buckets)
        self._eddis_lock = threading.Lock()
        self._eddis_synchronized = False
        self._eddis_skip_sync = False
        self._eddis_whole_groups = None   # the param_groups' lists while step() updates a bucket at a time
        self._eddis_steps = 0   # step() calls so far: names a closure's evaluations across the ranks
        self._eddis_closure_used = False
        self.reducer = make_reducer(mode, plan, compression=codec_of(compression), op=op.name,
                                    name=f"torch.{_next_instance_id()}")
        # after the reducer, which may place a CPU buffer (in mapped SMB memory)
        self._eddis_bind(pinned if pinned is not None else torch.from_numpy(plan.buffer))
        plan.watch_buffer(self._eddis_follow_buffer)
        # Nothing leaves the process (one rank, or easgd's local steps): the gradients
        # can stay where autograd put them, with no copy into the flat buffer.
        self._eddis_passthrough = isinstance(self.reducer, LocalReducer)
        self._eddis_hooks = [p.register_post_accumulate_grad_hook(self._eddis_make_hook(i))
                             for i, p in enumerate(params)]
        self._eddis_samples = ForwardSampleCounter(params)
        _core_join.register(self.reducer, self._eddis_join_reduce, self._eddis_join_apply)

    def _eddis_bind(self, flat):
        """Use ``flat`` (a tensor over the plan's buffer) and one view of it per parameter."""
        self._eddis_flat = flat
        self._eddis_views = [flat[s.start:s.start + s.count].view(s.shape) for s in self._eddis_plan.slots]

    def _eddis_follow_buffer(self, old, new):
        """The reducer moved the flat buffer (back to private memory at close; a pinned one
        is never moved): gradients that are views of the old one become the same views
        of the new one."""
        old_views = self._eddis_views
        self._eddis_bind(torch.from_numpy(new))
        for p, was, now in zip(self._eddis_params, old_views, self._eddis_views):
            if p.grad is not None and p.grad.data_ptr() == was.data_ptr():
                p.grad = now

    # ------------------------------------------------------------ hooks
    def _eddis_make_hook(self, index):
        def hook(param):
            self._eddis_on_grad(index, param)
        return hook

    def _eddis_on_grad(self, index, param):
        with self._eddis_lock:
            count = self._eddis_counts[index] + 1
            if count > self._eddis_bpps:
                raise UsageError(
                    f"parameter {self._eddis_plan.slots[index].name} got a gradient "
                    f"{count} times before optimizer.step(), but backward_passes_per_step="
                    f"{self._eddis_bpps}. Call optimizer.step() (or synchronize()) after each "
                    "backward, or wrap with backward_passes_per_step=N for N accumulation passes.")
            self._eddis_counts[index] = count
            if count < self._eddis_bpps:
                return
            if not self._eddis_passthrough:
                self._eddis_stage(index, param.grad)
            bucket = self._eddis_plan.slots[index].bucket
            self._eddis_left[bucket] -= 1
            ready = self._eddis_left[bucket] == 0
        if ready:
            self._eddis_mark(bucket)

    def _eddis_stage(self, index, grad):
        """Copy one final gradient into the flat buffer (no-op when it already is there)."""
        view = self._eddis_views[index]
        if grad is None:
            view.zero_()
            return
        if grad.is_cuda:
            stream = self._eddis_stream
            stream.wait_stream(torch.cuda.current_stream(grad.device))
            with torch.cuda.stream(stream):
                view.copy_(grad, non_blocking=True)
            grad.record_stream(stream)
            return
        if grad.layout != torch.strided:
            grad = grad.to_dense()
        if grad.data_ptr() != view.data_ptr() or grad.dtype != view.dtype:
            view.copy_(grad)

    def _eddis_mark(self, bucket):
        self._eddis_hetero.before_push()  # simulated slowdown: before gradients leave
        fence = None
        # passthrough stages nothing on the side stream: an event there would guard nothing
        if self._eddis_stream is not None and not self._eddis_passthrough:
            event = torch.cuda.Event()
            event.record(self._eddis_stream)
            fence = _CudaFence(event)
        self.reducer.mark_ready(bucket, fence)

    # ------------------------------------------------------------ public API
    def set_sample_count(self, samples):
        """Weight of this rank in the gradient average from the next step on: the
        number of samples it computes its (mean) loss over. Ranks with unequal
        batch shares then still get the gradient of the whole global batch."""
        self.reducer.set_weight(samples)

    def synchronize(self):
        """Finish this step's gradient averaging; afterwards ``.grad`` holds the result."""
        self._eddis_send_rest()
        self._eddis_take_result()
        self._eddis_synchronized = True

    def _eddis_send_rest(self, hooks=True):
        """The end of this step's backward passes: every bucket not sent yet goes now."""
        if hooks:
            self._eddis_hetero.before_sync()  # end of this step's compute (balance, slowdown)
        plan = self._eddis_plan
        with self._eddis_lock:
            missing = []
            for k, bucket in enumerate(plan.buckets):
                if self._eddis_left[k] == 0:
                    continue
                for i in bucket.params:
                    if self._eddis_counts[i] < self._eddis_bpps and not self._eddis_passthrough:
                        # no (or not every) backward reached it: send what it has
                        self._eddis_stage(i, self._eddis_params[i].grad)
                missing.append(k)
        for k in missing:
            self._eddis_mark(k)
        samples = self._eddis_samples.take()
        if samples:
            observe.note_samples(samples)   # for the progress line and the profile

    def _eddis_take_result(self, counted=True):
        """Wait for the whole step's reduction, hand its result to ``.grad`` and start counting
        the next step's gradients. ``counted``: the reduction ends a training step (not one
        evaluation of a closure)."""
        self.reducer.wait(counted=counted)
        if not self._eddis_passthrough:
            self._eddis_unstage()
        self._eddis_reset_counts()

    def _eddis_reset_counts(self):
        with self._eddis_lock:
            self._eddis_counts = [0] * len(self._eddis_params)
            self._eddis_left = [len(b.params) for b in self._eddis_plan.buckets]

    def _eddis_unstage(self, indices=None):
        """The averaged gradients into ``.grad``: of every parameter, or of ``indices``."""
        params, views = self._eddis_params, self._eddis_views
        pairs = zip(params, views) if indices is None else ((params[i], views[i]) for i in indices)
        with torch.no_grad():
            for p, view in pairs:
                if p.device.type == "cpu" and p.dtype == view.dtype:
                    if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view  # the averaged gradient, without a copy
                elif p.grad is None:
                    p.grad = view.to(device=p.device, dtype=p.dtype, non_blocking=True)
                else:
                    p.grad.copy_(view, non_blocking=True)

    def _eddis_join_reduce(self):
        """A step of a rank that has no data left (eddis.join(), which set the joined
        weight): zeros into the reduction, the others' result into .grad."""
        if self._eddis_closure_used:
            raise UsageError(
                "eddis.join() with an optimizer that steps with a closure (LBFGS): the others evaluate "
                "their closures several times a step, and a rank without data has nothing to evaluate. "
                "Give every rank a share of every step's batch instead (eddis.batch_slice; unequal "
                "shares weighted by set_sample_count) and call step(closure) on every rank.")
        if not self._eddis_passthrough:
            self._eddis_flat.zero_()
        self.reducer.mark_all_ready()
        self._eddis_take_result()
        self._eddis_synchronized = False

    def _eddis_join_apply(self):
        """The rest of that step, as the others take it: the wrapped optimizer's update (so
        this rank's parameters keep up with theirs), then the step's end (its hooks, the drift
        check, the step boundary)."""
        with timeline.span(timeline.OPTIMIZER_STEP):
            super(_DistributedOptimizer, self).step()
        _basics.end_of_step(self._eddis_hetero)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside, ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._eddis_skip_sync = True
        try:
            yield
        finally:
            self._eddis_skip_sync = False

    def step(self, closure=None):
        if closure is not None:
            result = self._eddis_closure_step(closure)
        elif self._eddis_skip_sync:
            if not self._eddis_synchronized:
                raise UsageError("step() inside skip_synchronize() without synchronize() first: "
                                 "call optimizer.synchronize() before the with-block")
        elif not self._eddis_synchronized and self._eddis_overlaps():
            self._eddis_send_rest()
            result = self._eddis_step_by_bucket()
        elif not self._eddis_synchronized:
            self.synchronize()
        if self._eddis_synchronized:
            self._eddis_synchronized = False
            with timeline.span(timeline.OPTIMIZER_STEP):
                result = super(_DistributedOptimizer, self).step()
        self._eddis_steps += 1
        # easgd/hybrid exchange, rebalancing, the drift check, a checkpoint when the ranks agreed
        _basics.end_of_step(self._eddis_hetero)
        return result

    def _eddis_closure_step(self, closure):
        """The wrapped optimizer's step with a closure that averages every evaluation
        (eddis.torch.closure); at the end, every rank checks that all evaluated as often."""
        mode = self._eddis_hetero.mode
        if mode in ("easgd", "hybrid"):
            raise UsageError(
                f"optimizer.step(closure) in mode {mode!r}: the elastic exchange moves the parameters "
                "between steps, which a closure optimizer such as LBFGS does not expect (its history "
                "assumes only its own updates), and the groups would evaluate different numbers of "
                "times. Use mode 'sync' or 'allreduce' for closure optimizers, or call loss.backward() "
                "yourself and optimizer.step() without a closure.")
        if self._eddis_skip_sync:
            raise UsageError("optimizer.step(closure) inside skip_synchronize(): the closure's gradients "
                             "are averaged at each evaluation; call step(closure) outside the with-block")
        if self.reducer.in_progress or any(self._eddis_counts):
            # a backward before step(closure), on every rank: finish its averaging (the ranks
            # stay paired); the closure computes the gradients again
            self._eddis_synchronize_evaluation(first=False)
        self._eddis_synchronized = False
        self._eddis_closure_used = True
        evaluate = AveragedClosure(self, closure, self._eddis_steps)
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
        self._eddis_take_result(counted=False)

    def _eddis_overlaps(self):
        """Whether this step's update may run bucket by bucket (EDDIS_OVERLAP_OPTIMIZER)."""
        wanted = settings.get("EDDIS_OVERLAP_OPTIMIZER")
        if wanted == "off" or self._eddis_passthrough:
            return False
        if len(self._eddis_plan.buckets) < 2:
            return False
        # a hook would run once per bucket, and may want the whole gradient
        global_hooks = [*torch_optimizer._global_optimizer_pre_hooks.values(),
                        *torch_optimizer._global_optimizer_post_hooks.values()]
        if self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks or not all(
                map(agreement.harmless_hook, global_hooks)):
            return False
        return wanted == "on" or type(self).__mro__[2] in PER_PARAMETER_OPTIMIZERS

    def _eddis_step_by_bucket(self):
        """The wrapped optimizer's update, one bucket's parameters at a time, each as soon as
        that bucket's averaged gradients are in: its param_groups hold only those parameters
        for the call (every option and state entry stays the group's and the parameter's)."""
        plan, groups, bucket_of = self._eddis_plan, self.param_groups, self._eddis_bucket_of
        last = len(plan.buckets) - 1
        originals = [g["params"] for g in groups]
        # parameters outside the plan (no gradient expected) go with the last bucket
        shares = [[[] for _ in groups] for _ in plan.buckets]
        for j, params in enumerate(originals):
            for p in params:
                shares[bucket_of.get(id(p), last)][j].append(p)
        self._eddis_whole_groups = originals   # what the parameter agreement check reads meanwhile
        try:
            for k, bucket in enumerate(plan.buckets):
                self.reducer.wait_bucket(k)
                self._eddis_unstage(bucket.params)   # never passthrough here (_eddis_overlaps)
                for g, share in zip(groups, shares[k]):
                    g["params"] = share
                with timeline.span(timeline.OPTIMIZER_STEP, args={"bucket": k}):
                    super(_DistributedOptimizer, self).step()
        finally:
            for g, params in zip(groups, originals):
                g["params"] = params
            self._eddis_whole_groups = None
        self.reducer.wait()   # every bucket is in: this ends the reducer's step
        self._eddis_reset_counts()
        return None

    def zero_grad(self, set_to_none=True):
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
        for h in self._eddis_hooks:
            h.remove()
        self._eddis_hooks = []
        self._eddis_samples.close()
        self.reducer.close()
        self._eddis_hetero.close()   # easgd/hybrid: the centre variable's memory


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
    wrapped._eddis_setup(named_parameters, compression, backward_passes_per_step, op, mode, bucket_bytes)
    hetero.attach(wrapped, mode, balance)
    optimizer.step = _unwrapped_step
    return wrapped
