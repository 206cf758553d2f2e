"""``DistributedOptimizer.step(closure)``: optimizers that evaluate a closure, such as LBFGS.

LBFGS calls the closure several times per step and takes its decisions (accept a line
search point, stop on ``tolerance_change``) from the loss the closure returns and the
gradients it leaves in ``.grad``. For every rank to take the same decisions, as one
process on the global batch would, each evaluation must give every rank the same
numbers: :class:`AveragedClosure` wraps the user's closure so that one evaluation

1. runs the user's closure (its ``zero_grad()`` and ``backward()``: the gradient buckets
   go on the wire as backward produces them, as in a plain step);
2. exchanges a tag and the loss with every rank (one small allgather): the tag says
   which step and which evaluation this rank is at, so that a rank whose optimizer
   stopped while another evaluates again is found at once, on every rank, instead of a
   reduction that waits for a partner which never comes; the loss comes back averaged
   with the ranks' sample weights (summed with op=Sum), computed in rank order, so it
   is bit for bit the same everywhere; and the ranks' samples, for the progress line
   (one step of the global batch's samples, however many evaluations it took);
3. finishes the gradient averaging (``synchronize()``): ``.grad`` holds the average;
4. returns the averaged loss, as a tensor like the closure's (detached) or a number.

With the same parameters, averaged loss and gradients, an optimizer's decisions are the
same on every rank by construction; what could still tell them apart (arithmetic that
differs between two kinds of CPU or GPU) is caught by the tags: at the end of the step
every rank says after how many evaluations it stopped, and a rank that is still
evaluating meets those that stopped in the same exchange. Then every rank raises a
:class:`~eddis.errors.UsageError` that says who did what.
"""
import torch

from ..core.comm import collectives, runtime
from ..errors import UsageError

_EVALUATION, _END = "evaluation", "end"


class AveragedClosure:
    """The closure a DistributedOptimizer hands its wrapped optimizer for one step: the
    user's ``closure``, in the optimizer's ``step``-th step, over the optimizer's gradient
    ``feed`` (eddis.torch.gradients); ``synchronize(first)`` finishes one evaluation's
    averaging (``first``: the step's first evaluation)."""

    def __init__(self, closure, step, feed, synchronize):
        self.closure = closure
        self.step = step
        self.feed = feed
        self.synchronize = synchronize
        self.evaluations = 0
        self.samples = None   # the global batch's samples, from the first evaluation (None: unknown)

    def __call__(self):
        loss = self.closure()
        self.evaluations += 1
        value = _loss_value(loss)
        averaged = self._exchange(_EVALUATION, value)
        self.synchronize(first=self.evaluations == 1)
        if loss is None or averaged is None:
            return loss
        if isinstance(loss, torch.Tensor):
            return torch.full_like(loss.detach(), averaged)
        return averaged

    def finish(self):
        """The step is over on this rank: check that it is over on every rank after as many
        evaluations (collective)."""
        self._exchange(_END, None)

    def _exchange(self, kind, value):
        """Every rank's (kind, evaluation, loss, weight, samples); the averaged loss (None
        without one)."""
        reducer = self.feed.reducer
        weight = reducer.weight
        # what the progress line counts: the script's sample count, else the model's batches
        samples = weight if reducer.weight_given else self.feed.samples.current()
        mine = (self.step, kind, self.evaluations, value, weight, samples)
        everyone = [mine] if reducer.size == 1 else collectives.allgather_object(
            mine, what=f"optimizer.step(closure) step {self.step}, {kind} {self.evaluations}")
        if any(entry[:3] != mine[:3] for entry in everyone):
            runtime.mark_broken("optimizer.step(closure): the ranks' evaluations diverged")
            raise UsageError(_divergence(self.step, everyone))
        if kind == _END:
            return None
        if self.evaluations == 1 and all(entry[5] for entry in everyone):
            self.samples = int(round(sum(entry[5] for entry in everyone)))
        values = [entry[3] for entry in everyone]
        if len(values) == 1:
            return value
        if any(v is None for v in values):
            if all(v is None for v in values):
                return None
            none = [r for r, v in enumerate(values) if v is None]
            raise UsageError(f"optimizer.step(closure) step {self.step}: the closure returned None on "
                             f"rank(s) {none} and a loss on the others; return the loss on every rank")
        if reducer.op == "sum":
            return sum(values)
        weights = [entry[4] for entry in everyone]
        return sum(w * v for w, v in zip(weights, values)) / sum(weights)


def _loss_value(loss):
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise UsageError(f"the closure passed to optimizer.step() returned a tensor of shape "
                             f"{tuple(loss.shape)}; return the scalar loss (e.g. loss.mean())")
        return float(loss.detach())
    try:
        return float(loss)
    except (TypeError, ValueError):
        raise UsageError(f"the closure passed to optimizer.step() returned {type(loss).__name__}; "
                         "return the loss (a scalar tensor or a number) or None") from None


def _divergence(step, everyone):
    said = []
    for rank, (_, kind, evaluations, *_) in enumerate(everyone):
        if kind == _END:
            said.append(f"rank {rank} finished the step after {evaluations} evaluation(s)")
        else:
            said.append(f"rank {rank} is at evaluation {evaluations}")
    return (f"optimizer.step(closure) step {step}: the ranks' optimizers evaluated the closure a different "
            f"number of times ({'; '.join(said)}), although every evaluation gave them the same averaged "
            "loss and gradients: their parameters or their arithmetic differ (kinds of CPU/GPU that round "
            "differently, or parameters changed outside the optimizer on some ranks). Start every rank "
            "from the same parameters (eddis.broadcast_parameters), change them only through the "
            "optimizer, and make the closure's decisions depend only on its averaged results (for "
            "LBFGS: torch.use_deterministic_algorithms(True) on GPUs, or mode 'sync' on ranks of one kind).")
