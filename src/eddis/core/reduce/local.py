"""The reducers with nothing to send: one rank's (:class:`LocalReducer`, every mode on one
rank) and mode ``easgd``'s (:class:`LocalGradients`: the workers meet only through the centre
variable)."""
from .base import Reducer


class LocalReducer(Reducer):
    """One rank: the average of one contribution is itself; nothing to send."""

    mode = "local"

    def mark_ready(self, k, fence=None):
        super().mark_ready(k, fence)
        if fence is not None:
            fence.synchronize()
        with self._cond:
            self._done[k] = True
            self.total_weight = self._step_weight


class LocalGradients(LocalReducer):
    """The reducer of mode ``easgd``: gradients stay local (workers meet only
    through the centre variable, in ``ElasticAverager.exchange``)."""

    mode = "easgd"
