"""The variables the ranks compare (eddis.core.progress.agreement): the trainable variables that were
broadcast (broadcast_variables, BroadcastGlobalVariablesCallback) or trained by a
DistributedOptimizer or DistributedGradientTape, so that a run that wrapped nothing but
broadcast its model at the start is checked too.

They are held until exit: a model built inside ``main()`` is gone by the check at exit
otherwise (a Keras variable cannot be read once freed)."""
import numpy as np

from ..core.progress import agreement

_watched = []  # in the order first seen (the same on every rank)
_ids = set()


def watch(variables):
    """Note the trainable ones of ``variables`` (no communication)."""
    for v in variables:
        if not getattr(v, "trainable", True) or id(v) in _ids:
            continue
        _ids.add(id(v))
        _watched.append(v)


def checksums():
    entries = []
    for v in _watched:
        value = np.asarray(v.numpy(), dtype=np.float64)
        entries.append((str(getattr(v, "path", None) or v.name), value.shape, float(value.sum()),
                        float(np.linalg.norm(value.reshape(-1)))))
    return entries


agreement.register_source(checksums)
tick = agreement.tick
