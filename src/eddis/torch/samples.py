"""How many samples a step of a DistributedOptimizer computed, for the progress line's
samples/s and the profile, when the script does not say (``set_sample_count``).

The optimizer knows its parameters, not the model, so the first step finds the model:
global module hooks note every outermost module call made with gradients on and the
batch dimension of its first tensor argument; at the step's synchronisation the first
of those modules that holds one of the optimizer's parameters is the model. From then
on one forward pre-hook on that module counts its batches, and the global hooks are
gone (they would cost a call per module call of every model). The step's count is the
sum over the model's forward calls since the last step, so gradient accumulation
(``backward_passes_per_step``) counts every pass. Forward calls without gradients
(evaluation under ``torch.no_grad()``) do not count. When no call passed a tensor with
a batch dimension, the count is unknown and the progress line shows steps/s.
"""
import torch
from torch.nn.modules import module as _module


def batch_size(args, kwargs=None):
    """Dim 0 of the first tensor argument (positional first, then keyword), or 0."""
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, torch.Tensor):
            return int(value.shape[0]) if value.dim() > 0 else 0
    return 0


class ForwardSampleCounter:
    """Samples the model's forward passes took between two optimizer steps."""

    def __init__(self, params):
        self._param_ids = {id(p) for p in params}
        self._samples = 0
        self._depth = 0
        self._outermost = []   # (module, batch) of the first step's outermost calls
        self._model_hook = None
        self._global_hooks = [_module.register_module_forward_pre_hook(self._global_pre),
                              _module.register_module_forward_hook(self._global_post)]

    def _global_pre(self, module, args):
        if self._depth == 0 and torch.is_grad_enabled():
            self._outermost.append((module, batch_size(args)))
        self._depth += 1

    def _global_post(self, module, args, output):
        self._depth = max(0, self._depth - 1)

    def _model_pre(self, module, args, kwargs):
        if torch.is_grad_enabled():
            self._samples += batch_size(args, kwargs)

    def _find_model(self):
        self._remove_global_hooks()
        seen = set()
        for module, _ in self._outermost:
            if id(module) in seen:
                continue
            seen.add(id(module))
            if any(id(p) in self._param_ids for p in module.parameters()):
                self._samples = sum(batch for m, batch in self._outermost if m is module)
                self._model_hook = module.register_forward_pre_hook(self._model_pre, with_kwargs=True)
                break
        self._outermost = []

    def current(self):
        """The samples counted since the last step (0: unknown), still counting on."""
        if self._global_hooks:
            self._find_model()
        return self._samples

    def take(self):
        """This step's samples (0: unknown); the next step counts from zero."""
        samples, self._samples = self.current(), 0
        return samples

    def _remove_global_hooks(self):
        for handle in self._global_hooks:
            handle.remove()
        self._global_hooks = []
        self._depth = 0

    def close(self):
        self._remove_global_hooks()
        if self._model_hook is not None:
            self._model_hook.remove()
            self._model_hook = None
