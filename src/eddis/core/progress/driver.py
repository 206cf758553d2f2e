"""The step driver of this process: the newest DistributedOptimizer's.

The adapters' optimizers each own one step driver (:class:`eddis.core.hetero.step.HeteroStep`);
the parts of core that act between steps (``join()``, the parameter check, the checkpoints'
data position) find the current one here, below them, instead of reaching up into the
heterogeneity modes.
"""
_current = [None]


def current():
    """The newest step driver, or None (no DistributedOptimizer yet)."""
    return _current[0]


def make_current(state):
    _current[0] = state
