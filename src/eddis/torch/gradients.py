"""The gradient feed of one ``DistributedOptimizer`` (steps 2 and 3 of
:mod:`eddis.torch.optimizer`): the hooks that stage each final gradient into the bucket
plan's flat buffer and mark a bucket ready once all of its gradients are in, and the way
back of the averaged gradients into ``.grad``.
"""
import threading

import torch

from ..core import BucketPlan, LocalReducer
from ..core.comm import observe
from ..core.layout.buckets import gradient_dtype
from ..errors import UsageError
from .samples import ForwardSampleCounter


def plan_of(params, names, bucket_bytes, first_bucket_bytes=0):
    """The bucket plan of ``params`` (named ``names``) and, when one of them is on a GPU,
    the pinned host memory its buffer now is (the feed's asynchronous copies need pinned
    memory; placed before the reducer, which leaves a buffer in place); else None."""
    plan = BucketPlan([(n, tuple(p.shape)) for n, p in zip(names, params)], bucket_bytes,
                      dtype=gradient_dtype(str(p.dtype).replace("torch.", "") for p in params),
                      first_bucket_bytes=first_bucket_bytes)
    if not any(p.is_cuda for p in params):
        return plan, None
    pinned = torch.zeros(plan.total, dtype=getattr(torch, plan.dtype.name), pin_memory=True)
    plan.use_buffer(pinned.numpy())
    return plan, pinned


class _CudaFence:
    """A CUDA event the communication thread waits on before reading host memory."""

    def __init__(self, event):
        self.event = event

    def synchronize(self):
        self.event.synchronize()


class GradientFeed:
    """The gradients of one optimizer's parameters, on their way into ``reducer`` and back.

    ``params``: the parameters in the plan's order; ``plan``: their :class:`BucketPlan`;
    ``reducer``: the core reducer of ``plan``; ``backward_passes``: the backward passes a
    step sums (a parameter's gradient is final at that many); ``before_push``: called
    before each bucket is marked ready (the heterogeneity hooks' simulated slowdown).

    Attributes: ``flat`` (a tensor over the plan's buffer) and ``views`` (one view of it per
    parameter), which follow the buffer when the reducer moves it; ``stream``: the CUDA
    side stream of the copies (None without CUDA parameters); ``passthrough``: nothing
    leaves the process (one rank, or easgd's local steps), so the gradients stay where
    autograd put them, with no copy into the buffer; ``counts``: the gradients each
    parameter got this step, and ``left``: the parameters each bucket still waits for, both
    under ``lock`` (autograd may call the hooks from its own threads); ``bucket_of``: a
    parameter's bucket by ``id``; ``samples``: the model's forward passes' samples
    (:class:`ForwardSampleCounter`); ``hooks``: the parameters' hook handles; ``deferred``:
    the last step's updates while they wait for the forward (EDDIS_OVERLAP_FORWARD).
    """

    def __init__(self, params, plan, reducer, backward_passes, pinned, before_push):
        self.params = params
        self.plan = plan
        self.reducer = reducer
        self.backward_passes = int(backward_passes)
        self.before_push = before_push
        self.bucket_of = {id(params[i]): k for k, b in enumerate(plan.buckets) for i in b.params}
        self.lock = threading.Lock()
        self.counts = [0] * len(params)
        self.left = [len(b.params) for b in plan.buckets]
        devices = [p.device for p in params if p.is_cuda]
        self.stream = torch.cuda.Stream(device=devices[0]) if devices else None
        self.flat = None
        self.views = []
        # after the reducer, which may have placed a CPU buffer (in mapped SMB memory)
        self._bind(pinned if pinned is not None else torch.from_numpy(plan.buffer))
        plan.watch_buffer(self.follow_buffer)
        self.passthrough = isinstance(reducer, LocalReducer)
        self.deferred = None   # the optimizer's DeferredStep while the last step's updates wait
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]
        self.samples = ForwardSampleCounter(params)

    def names(self):
        """The parameters' names by ``id``."""
        return {id(p): slot.name for p, slot in zip(self.params, self.plan.slots)}

    def _bind(self, flat):
        """Use ``flat`` (a tensor over the plan's buffer) and one view of it per parameter."""
        self.flat = flat
        self.views = [flat[s.start:s.start + s.count].view(s.shape) for s in self.plan.slots]

    def follow_buffer(self, old, new):
        """The reducer moved the flat buffer (back to private memory at close; a pinned one
        is never moved): gradients that are views of the old one become the same views
        of the new one."""
        old_views = self.views
        self._bind(torch.from_numpy(new))
        for p, was, now in zip(self.params, old_views, self.views):
            if p.grad is not None and p.grad.data_ptr() == was.data_ptr():
                p.grad = now

    # ------------------------------------------------------------ into the reducer
    def _hook(self, index):
        def hook(param):
            self._on_grad(index, param)
        return hook

    def _on_grad(self, index, param):
        if self.deferred is not None:   # the last step's updates: used ones applied, the rest now
            self.deferred.before_gradient(param)
        with self.lock:
            count = self.counts[index] + 1
            if count > self.backward_passes:
                raise UsageError(
                    f"parameter {self.plan.slots[index].name} got a gradient "
                    f"{count} times before optimizer.step(), but backward_passes_per_step="
                    f"{self.backward_passes}. Call optimizer.step() (or synchronize()) after each "
                    "backward, or wrap with backward_passes_per_step=N for N accumulation passes.")
            self.counts[index] = count
            if count < self.backward_passes:
                return
            if not self.passthrough:
                self._stage(index, param.grad)
            bucket = self.plan.slots[index].bucket
            self.left[bucket] -= 1
            ready = self.left[bucket] == 0
        if ready:
            self._mark(bucket)

    def _stage(self, index, grad):
        """Copy one final gradient into the flat buffer (no-op when it already is there)."""
        view = self.views[index]
        if grad is None:
            view.zero_()
            return
        if grad.is_cuda:
            stream = self.stream
            stream.wait_stream(torch.cuda.current_stream(grad.device))
            with torch.cuda.stream(stream):
                view.copy_(grad, non_blocking=True)
            grad.record_stream(stream)
            return
        if grad.layout != torch.strided:
            grad = grad.to_dense()
        if grad.data_ptr() != view.data_ptr() or grad.dtype != view.dtype:
            view.copy_(grad)

    def _mark(self, bucket):
        self.before_push()
        fence = None
        # passthrough stages nothing on the side stream: an event there would guard nothing
        if self.stream is not None and not self.passthrough:
            event = torch.cuda.Event()
            event.record(self.stream)
            fence = _CudaFence(event)
        self.reducer.mark_ready(bucket, fence)

    def send_rest(self):
        """The end of this step's backward passes: every bucket not sent yet goes now
        (a parameter that no backward, or not every one, reached sends what it has), and
        the step's samples go to the progress line and the profile."""
        with self.lock:
            missing = []
            for k, bucket in enumerate(self.plan.buckets):
                if self.left[k] == 0:
                    continue
                for i in bucket.params:
                    if self.counts[i] < self.backward_passes and not self.passthrough:
                        self._stage(i, self.params[i].grad)
                missing.append(k)
        for k in missing:
            self._mark(k)
        samples = self.samples.take()
        if samples:
            observe.note_samples(samples)

    def send_zeros(self):
        """This step's contribution is zeros (a rank without data, eddis.join())."""
        if not self.passthrough:
            self.flat.zero_()
        self.reducer.mark_all_ready()

    # ------------------------------------------------------------ back into .grad
    def take_result(self, counted=True):
        """Wait for the whole step's reduction, hand its result to ``.grad`` and start counting
        the next step's gradients. ``counted``: the reduction ends a training step (not one
        evaluation of a closure)."""
        self.reducer.wait(counted=counted)
        if not self.passthrough:
            self.unstage()
        self.reset_counts()

    def reset_counts(self):
        with self.lock:
            self.counts = [0] * len(self.params)
            self.left = [len(b.params) for b in self.plan.buckets]

    def unstage(self, indices=None):
        """The averaged gradients into ``.grad``: of every parameter, or of ``indices``."""
        params, views = self.params, self.views
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

    def close(self):
        """Remove the parameters' hooks and the sample counter's (the reducer is its owner's
        to close)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.samples.close()
