"""The modes and how a reducer is built: ``make_reducer(mode, plan, compression, op)``.

:data:`REDUCERS` maps a mode to its reducer class (or a function that chooses one, collective):
``allreduce`` (MPI, :mod:`.allreduce`), ``sync`` (the SMB servers, :mod:`.sync`), ``easgd``
(:mod:`.local`: nothing to send) and ``hybrid`` (:mod:`.group`); ``register_mode(name, cls)``
adds one. With one rank every mode is the :class:`~eddis.core.reduce.local.LocalReducer`
(nothing to communicate).
"""
import logging

import numpy as np

from ... import settings
from ...errors import ConfigError
from ..comm import adasum, observe, runtime
from .allreduce import AllreduceReducer
from .base import op_name
from .local import LocalReducer

log = logging.getLogger("eddis.core.reducer")

REDUCERS = {"allreduce": AllreduceReducer}   # the built-in modes join it on first use


def register_mode(name, cls):
    """Make ``make_reducer(name, ...)`` build ``cls`` (a Reducer subclass)."""
    REDUCERS[name] = cls


def available_modes():
    _load_builtin_modes()
    return sorted(REDUCERS)


def _load_builtin_modes():
    """The modes of the SMB servers, on first use: importing eddis.core needs no SMB extension."""
    if "sync" not in REDUCERS:
        try:
            from .sync import make_sync_reducer
        except ImportError as exc:  # SMB extension not built
            log.debug("mode sync unavailable: %s", exc)
        else:
            REDUCERS.setdefault("sync", make_sync_reducer)
    if "easgd" not in REDUCERS or "hybrid" not in REDUCERS:
        from .local import LocalGradients
        from .group import GroupSyncReducer

        REDUCERS.setdefault("easgd", LocalGradients)
        REDUCERS.setdefault("hybrid", GroupSyncReducer)


def _check_dtype(plan, mode, op):
    """Refuse what would reduce a float64 plan in less than float64 (checked on every number of
    ranks alike, so that a script that runs on one rank runs on many)."""
    if plan.dtype != np.float64:
        return
    if mode in ("easgd", "hybrid"):
        raise ConfigError(f"mode {mode!r} averages the model's parameters in float32 (the centre variable), "
                          "which would round this float64 model: use mode 'sync' or 'allreduce' for float64 "
                          "models (they reduce in float64), or train in float32 (model.float())")
    if op_name(op) == "adasum":
        raise ConfigError("op=Adasum combines gradients in float32 and this model's are float64: use "
                          "op=Average (or Sum), which reduces float64 in float64, or train in float32")


def make_reducer(mode, plan, compression="none", op="average", timeout=None, name="grads"):
    """Build the reducer of ``mode`` (None: EDDIS_MODE) over ``plan``."""
    mode = settings.get("EDDIS_MODE") if mode is None else str(mode).lower()
    _load_builtin_modes()
    _check_dtype(plan, mode, op)
    if op_name(op) == "adasum":
        if mode in ("easgd", "hybrid"):
            raise ConfigError(f"op=Adasum combines every rank's gradients at every step, but mode "
                              f"{mode!r} averages models elastically between groups: use mode 'sync' or "
                              "'allreduce' with Adasum, or op=Average with this mode")
        adasum.check_ranks(runtime.size(), f"mode {mode!r}")
    if mode not in REDUCERS and mode not in ("sync", "easgd", "hybrid"):
        raise ConfigError(f"unknown mode {mode!r}; available: {', '.join(available_modes())}")
    if runtime.size() == 1:  # nothing to communicate: no SMB needed either
        reducer = LocalReducer(plan, compression, op, timeout, name)
        observe.reducer_built(reducer, mode)
        return reducer
    if mode not in REDUCERS:
        hint = (" (it needs the SMB extension eddis.smb._core: build it with `python setup.py "
                "build_ext --inplace` where libucx-dev is installed, or use mode='allreduce')"
                if mode == "sync" else "")
        raise ConfigError(f"mode {mode!r} is not available in this build{hint}; available: "
                          f"{', '.join(available_modes())}")
    reducer = REDUCERS[mode](plan, compression, op, timeout, name)
    observe.reducer_built(reducer, mode)
    return reducer
