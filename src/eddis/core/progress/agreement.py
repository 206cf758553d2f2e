"""Do the ranks' parameters still agree? A cheap check for the synchronous modes.

In sync and allreduce every rank applies the same averaged gradients to the same
initial parameters, so the parameters stay equal on every rank. When they do not,
something trains outside the averaging: no DistributedOptimizer was created (each
rank trains alone and the run ends with N different models, exit status 0), or
an update bypasses it (by hand, or through an optimizer that was not wrapped).
Neither shows in the loss, so the ranks compare a checksum of their parameters
(per tensor: the float64 sum and 2-norm, gathered over the ranks) every
EDDIS_CHECK_PARAMETERS steps of a DistributedOptimizer and at shutdown, and fail
with the cause and the fix.

The adapters enumerate the parameters: ``register_source(fn)`` with ``fn()``
returning ``[(name, shape, sum, norm), ...]``, each tensor once, for the trainable
parameters this process knows of (parameters of optimizers that stepped, variables that were
broadcast); ``tick()`` once per synchronous training step. easgd and hybrid
workers differ by design and are not checked.
"""
import logging

import numpy as np

from ... import settings
from ...errors import ParameterDriftError
from ..comm import collectives, runtime
from ..reduce.base import any_built
from . import driver

log = logging.getLogger("eddis.core.agreement")

SYNCHRONOUS_MODES = ("sync", "allreduce")
RELATIVE_TOLERANCE = 1e-5  # far below a step's update, above summation-order noise between devices

_sources = []
_steps = [0]


def register_source(fn):
    """``fn()`` -> ``[(name, shape, sum, norm), ...]`` of parameters that must agree across ranks."""
    if fn not in _sources:
        _sources.append(fn)


def _mode():
    state = driver.current()
    return state.mode if state is not None else settings.get("EDDIS_MODE")


def _enabled():
    return (runtime.is_initialized() and runtime.size() > 1 and settings.get("EDDIS_CHECK_PARAMETERS") > 0
            and _mode() in SYNCHRONOUS_MODES)


def tick(abstain=False):
    """One synchronous training step ended on this rank (every rank ticks alike); every
    EDDIS_CHECK_PARAMETERS ticks the ranks compare their parameters (collective).
    ``abstain``: this rank's parameters did not take the step (a joined rank under a
    gradient tape, see eddis.core.progress.join): it takes part without checksums, which the
    comparison then skips."""
    if not _enabled():
        return
    _steps[0] += 1
    if _steps[0] % settings.get("EDDIS_CHECK_PARAMETERS") == 0:
        check(f"step {_steps[0]}", abstain=abstain)


def local_checksums():
    """This rank's ``[(name, shape, sum, norm), ...]``; each source lists a tensor once (names
    are for the message only: Keras's differ between ranks that built other models first)."""
    return [(name, tuple(shape), float(total), float(norm))
            for source in _sources for name, shape, total, norm in source()]


def disagreement(gathered):
    """``(rank, [names])`` of the first rank whose checksums differ from rank 0's, else None;
    None too when the ranks know different parameters (nothing comparable to check)."""
    reference = gathered[0]
    shapes = [e[1] for e in reference]
    for rank, entries in enumerate(gathered[1:], start=1):
        if [e[1] for e in entries] != shapes:
            return None
    ref = np.array([e[2:] for e in reference], dtype=np.float64).reshape(-1, 2)
    for rank, entries in enumerate(gathered[1:], start=1):
        mine = np.array([e[2:] for e in entries], dtype=np.float64).reshape(-1, 2)
        # the sum may cancel to ~0: scale both columns by the tensor's norm
        scale = np.abs(ref[:, 1:2]) + np.abs(mine[:, 1:2]) + 1e-30
        differ = np.any(np.abs(mine - ref) > RELATIVE_TOLERANCE * scale, axis=1)
        if differ.any():
            return rank, [reference[i][0] for i in np.flatnonzero(differ)]
    return None


def message(rank, names, total, when, wrapped):
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    head = (f"the ranks' parameters no longer agree at {when} (mode {_mode()}): rank {rank} differs "
            f"from rank 0 in {len(names)} of {total} parameter tensors ({shown}), so the job would "
            "end with a different model on every rank. ")
    if not wrapped:
        return head + ("No eddis.DistributedOptimizer (or DistributedGradientTape) was created, so "
                       "each rank trained alone on its own data. Wrap the optimizer: optimizer = "
                       "eddis.DistributedOptimizer(optimizer, ...), and broadcast rank 0's "
                       "parameters at the start (eddis.broadcast_parameters / "
                       "eddis.broadcast_variables). EDDIS_CHECK_PARAMETERS=0 turns this check off.")
    return head + ("Something updates parameters outside the gradient averaging: an update by hand "
                   "from the local gradients (call optimizer.synchronize() first and use the averaged "
                   ".grad), an optimizer that was not wrapped (wrap every optimizer that trains), or "
                   "initial parameters that were never made equal (broadcast rank 0's at the start). "
                   "EDDIS_CHECK_PARAMETERS=0 turns this check off.")


def check(when, abstain=False):
    """Collective: raise ParameterDriftError when the ranks' parameters differ."""
    entries = [] if abstain else local_checksums()
    gathered = collectives.allgather_object(entries, what="eddis parameter check (EDDIS_CHECK_PARAMETERS)")
    if not gathered[0]:
        return
    found = disagreement(gathered)
    if found is None:
        log.debug("parameter check at %s: %d tensors agree (or are not comparable)", when, len(entries))
        return
    rank, names = found
    raise ParameterDriftError(message(rank, names, len(gathered[0]), when, any_built()))


def check_at_shutdown():
    """The last check, from eddis.shutdown(): a run that drifted does not end as a success."""
    if _enabled():
        check("shutdown")


def reset():
    """Forget the step count (a new runtime starts counting anew)."""
    _steps[0] = 0
