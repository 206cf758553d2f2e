"""Optional FORWARD / BACKWARD timeline events from PyTorch module hooks.

    from eddis.timeline.torch_hooks import trace_module
    handles = trace_module(model)      # or EDDIS_TIMELINE_MODULE_HOOKS=1 with eddis.torch

FORWARD spans the module's forward call. BACKWARD starts when the gradient of
the module's output arrives and ends when the first parameter's gradient is
accumulated (backward runs in reverse order of definition, so that parameter is
among the last). The forward hook also notes the batch size (dim 0 of the first
tensor input) as the step's sample count for the profile, unless the reducer
was given sample counts.

The hooks cost one Python call each per forward/backward, on or off; when the
timeline is off they return after one global lookup.
"""
from . import instrument, trace
from .events import BACKWARD, FORWARD


def trace_module(module, note_batch=True):
    """Register the hooks on ``module``; returns the handles (``h.remove()`` to undo)."""
    import torch

    state = {"forward": 0, "backward": 0, "step": 0}

    def forward_pre(mod, args):
        state["forward"] = trace.perf_ns()
        if note_batch:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is not None and first.dim() > 0:
                instrument.note_samples(first.shape[0])

    def forward_post(mod, args, output):
        tl = trace._timeline
        if tl is not None:
            start = state["forward"]
            tl.record("X", FORWARD, None, start, trace.perf_ns() - start, {"step": state["step"]})

    def backward_pre(mod, grad_output):
        state["backward"] = trace.perf_ns()

    def backward_end(param):
        tl = trace._timeline
        if tl is not None and state["backward"]:
            start = state["backward"]
            tl.record("X", BACKWARD, None, start, trace.perf_ns() - start, {"step": state["step"]})
        state["backward"] = 0
        state["step"] += 1

    handles = [module.register_forward_pre_hook(forward_pre), module.register_forward_hook(forward_post),
               module.register_full_backward_pre_hook(backward_pre)]
    first = next((p for p in module.parameters() if p.requires_grad), None)
    if first is not None:
        handles.append(first.register_post_accumulate_grad_hook(backward_end))
    return handles
