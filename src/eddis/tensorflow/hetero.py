"""Mixed GPU generations in ``eddis.tensorflow``: easgd, hybrid, progress control, final model.

    optimizer = eddis.DistributedOptimizer(keras.optimizers.SGD(0.05), mode="easgd")  # or "hybrid"
    model.compile(optimizer=optimizer, loss=..., jit_compile=False)
    model.fit(dataset.repeat(), epochs=1, callbacks=[
        eddis.callbacks.BroadcastGlobalVariablesCallback(0),
        eddis.callbacks.ProgressControlCallback(total=2000)])  # the global learning counter
    eddis.save_model("model.keras", model)   # collective: the centre (easgd/hybrid), written once

The optimizer does the elastic exchange itself every ``tau`` steps (after its
update); the algorithms are :mod:`eddis.core`'s, driven through
:class:`eddis.core.hetero.step.HeteroStep`.
"""
from ..core.basics import basics as _basics


configure_progress = _basics.configure_progress
should_stop = _basics.should_stop
global_step = _basics.global_step
progress_counts = _basics.progress_counts
reset_progress = _basics.reset_progress


def _state_of(optimizer):
    if optimizer is None:
        return _basics.training_state()
    from .optimizer import _DistributedOptimizer

    if not isinstance(optimizer, _DistributedOptimizer):
        # a plain optimizer beside a DistributedGradientTape trains synchronously: nothing to load,
        # unless no tape exists either (training_state says so)
        return _basics.training_state()
    return optimizer.hetero


def final_model(optimizer=None):
    """Collective: load the job's final model into the variables on every rank
    (easgd/hybrid: the centre variable; sync: nothing to do)."""
    _basics.final_model(_state_of(optimizer))


def save_model(path, model, optimizer=None):
    """Collective: load the final model (``final_model``) and write ``model`` once
    (rank 0, atomically) with ``model.save(path)``; returns ``path``."""
    _basics.require("eddis.save_model()")
    final_model(optimizer)
    return _basics.save_on_rank0(path, model.save, "save_model")
