"""Mixed GPU generations in ``eddis.tensorflow``: easgd, hybrid, progress control, final model.

    optimizer = eddis.DistributedOptimizer(keras.optimizers.SGD(0.05), mode="easgd")  # or "hybrid"
    model.compile(optimizer=optimizer, loss=..., jit_compile=False)
    model.fit(dataset.repeat(), epochs=1, callbacks=[
        eddis.callbacks.BroadcastGlobalVariablesCallback(0),
        eddis.callbacks.ProgressControlCallback(total=2000)])  # the global learning counter
    eddis.save_model("model.keras", model)   # collective: the centre (easgd/hybrid), written once

The optimizer does the elastic exchange itself every ``tau`` steps (after its
update); the algorithms are :mod:`eddis.core`'s, driven through
:class:`eddis.core.hetero.HeteroStep`.
"""
import os

from ..core import collectives, hetero, progress, runtime
from ..core.progress import global_step, progress_counts  # noqa: F401  (re-exported)
from ..errors import CheckpointError


def configure_progress(total=None, chunk=None, staleness=None, record=False):
    """Set up the global learning counter (collective; optional: the first
    should_stop() does it from EDDIS_TOTAL_ITERATIONS, EDDIS_CLAIM_CHUNK, EDDIS_STALENESS)."""
    state = hetero.current()
    return progress.configure(total=total, chunk=chunk, staleness=staleness,
                              mode=state.mode if state is not None else None, record=record)


def should_stop():
    """True once the job's iterations are used up; else this rank runs one more step.
    Call it once per step, as the loop condition (ProgressControlCallback does it for fit)."""
    return hetero.should_stop()


def reset_progress():
    """Forget the global learning counter after training, so another run can configure anew."""
    progress.reset()


def _state_of(optimizer):
    if optimizer is None:
        return hetero.current()
    from .optimizer import _DistributedOptimizer

    if not isinstance(optimizer, _DistributedOptimizer):
        # a plain optimizer (e.g. beside a DistributedGradientTape) trains synchronously
        return None
    return optimizer.hetero


def final_model(optimizer=None):
    """Collective: load the job's final model into the variables on every rank
    (easgd/hybrid: the centre variable; sync: nothing to do)."""
    state = _state_of(optimizer)
    if state is not None:
        state.final_model()


def save_model(path, model, optimizer=None):
    """Collective: load the final model (``final_model``) and write ``model`` once
    (rank 0, atomically) with ``model.save(path)``; returns ``path``."""
    runtime._require("eddis.save_model()")
    final_model(optimizer)
    path = os.fspath(path)
    error = None
    if runtime.rank() == 0:
        try:
            base, ext = os.path.splitext(path)
            tmp = f"{base}.tmp-{os.getpid()}{ext}"
            model.save(tmp)
            os.replace(tmp, path)
        except Exception as exc:  # the other ranks must hear about it too
            error = f"{type(exc).__name__}: {exc}"
    error = collectives.broadcast_object(error, root=0, what="save_model")
    if error is not None:
        raise CheckpointError(f"save_model({path!r}) failed on rank 0: {error}")
    return path
