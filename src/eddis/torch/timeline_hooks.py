"""Optional FORWARD / BACKWARD timeline events from PyTorch module hooks.

    from eddis.torch import trace_module
    handles = trace_module(model)      # one model, explicitly

or ``EDDIS_TIMELINE_MODULE_HOOKS=1``: ``eddis.init()`` installs global module
hooks (:func:`install_global_hooks`) that record the outermost module call of
each forward as FORWARD, and BACKWARD from the moment the gradient reaches that
call's output until the last gradient bucket of the step is ready.

FORWARD spans the module's forward call. BACKWARD starts when the gradient
reaches the module's output (a tensor hook) and ends when the first parameter's gradient is
accumulated (backward runs in reverse order of definition, so that parameter is
among the last). The forward hook also notes the batch size (dim 0 of the first
tensor input) as the step's sample count for the profile, unless the reducer
was given sample counts.

The hooks cost one Python call each per forward/backward, on or off; when the
timeline is off they return after one global lookup.
"""
import torch

from .. import settings
from ..core.comm import observe
from ..timeline import trace
from ..timeline.events import BACKWARD, FORWARD


def _note_batch(args):
    """The batch size (dim 0 of the first tensor argument) as the step's sample count."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is not None and first.dim() > 0:
        observe.note_samples(first.shape[0])


def _forward_done(start, step, output, on_backward_start):
    """Record FORWARD from ``start``; catch the gradient reaching the output to start BACKWARD."""
    tl = trace._timeline
    if tl is not None:
        tl.record("X", FORWARD, None, start, trace.perf_ns() - start, {"step": step})
    out = output[0] if isinstance(output, (tuple, list)) and output else output
    if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled():
        out.register_hook(on_backward_start)


def trace_module(module, note_batch=True):
    """Register the hooks on ``module``; returns the handles (``h.remove()`` to undo)."""
    state = {"forward": 0, "backward": 0, "step": 0}

    def forward_pre(mod, args):
        state["forward"] = trace.perf_ns()
        if note_batch:
            _note_batch(args)

    def forward_post(mod, args, output):
        _forward_done(state["forward"], state["step"], output, backward_pre)

    def backward_pre(grad):
        state["backward"] = trace.perf_ns()

    def backward_end(param):
        tl = trace._timeline
        if tl is not None and state["backward"]:
            start = state["backward"]
            tl.record("X", BACKWARD, None, start, trace.perf_ns() - start, {"step": state["step"]})
        state["backward"] = 0
        state["step"] += 1

    handles = [module.register_forward_pre_hook(forward_pre), module.register_forward_hook(forward_post)]
    first = next((p for p in module.parameters() if p.requires_grad), None)
    if first is not None:
        handles.append(first.register_post_accumulate_grad_hook(backward_end))
    return handles


_global = {"installed": False, "depth": 0, "start": 0, "backward": 0, "step": 0}


def install_global_hooks():
    """Hooks on every module (torch's global module hooks); idempotent. Returns True if installed."""
    from torch.nn.modules import module as module_mod

    if _global["installed"]:
        return True
    state = _global

    def pre(mod, args):
        if state["depth"] == 0:
            state["start"] = trace.perf_ns()
            _note_batch(args)
        state["depth"] += 1

    def post(mod, args, output):
        state["depth"] = max(0, state["depth"] - 1)
        if state["depth"] == 0:
            _forward_done(state["start"], state["step"], output, _backward_started)

    state["handles"] = [module_mod.register_module_forward_pre_hook(pre),
                        module_mod.register_module_forward_hook(post)]
    state["installed"] = True
    return True


def uninstall_global_hooks():
    for handle in _global.pop("handles", []):
        handle.remove()
    _global.update(installed=False, depth=0, backward=0)


def _backward_started(grad):
    _global["backward"] = trace.perf_ns()
    return None


def backward_finished():
    """The last gradient bucket of the step is ready: close BACKWARD (the reducer observer calls it)."""
    start = _global["backward"]
    if start:
        _global["backward"] = 0
        tl = trace._timeline
        if tl is not None:
            tl.record("X", BACKWARD, None, start, trace.perf_ns() - start, {"step": _global["step"]})
    _global["step"] += 1


def _on_timeline_start():
    if settings.get("EDDIS_TIMELINE_MODULE_HOOKS"):
        install_global_hooks()


observe.on_timeline_start(_on_timeline_start)
observe.on_backward_finished(backward_finished)
