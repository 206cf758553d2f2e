"""``eddis.tensorflow.elastic``: Horovod's elastic API for TensorFlow / Keras scripts.

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()
    train(hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0))

The calls mean what they mean in ``eddis.torch.elastic`` (``eddis.core.checkpoint.elastic_state``):
``run`` syncs once and calls the function once, ``commit()`` keeps an in-memory copy
of the model's and the optimizer's variables that ``restore()`` returns to, and in sync
also writes it as a checkpoint (``eddis.checkpoint``) when the optimizer is an
``eddis.DistributedOptimizer``, from which ``run`` starts a restarted run; ``sync()``
broadcasts them from rank 0. The callbacks of ``register_reset_callbacks`` run, as under
Horovod, only after a reset: when ``run`` goes on from a commit, never at the first start.
"""
import numpy as np

from ..core.checkpoint.elastic_state import ModelState, ObjectState, State, run
from . import checkpointing
from .ops import _variable_list, broadcast_variables
from .optimizer import _DistributedOptimizer


class TensorFlowKerasState(ModelState):
    """A Keras model, its optimizer (default: the compiled one) and plain values as one state.
    ``backward_passes_per_step`` is accepted for Horovod's signature; EDDIS's optimizer holds it."""

    checkpointing = checkpointing

    def __init__(self, model, optimizer=None, backward_passes_per_step=1, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._saved_model = self._saved_optimizer = None
        super().__init__(**kwargs)

    def _optimizer_variables(self):
        # created at the first update: before it, there is nothing to keep
        return [] if self.optimizer is None else _variable_list(self.optimizer.variables)

    def save(self):
        self._saved_model = [np.array(w, copy=True) for w in self.model.get_weights()]
        self._saved_optimizer = [np.array(v.numpy(), copy=True) for v in self._optimizer_variables()]
        super().save()

    def restore(self):
        self.model.set_weights(self._saved_model)
        for variable, value in zip(self._optimizer_variables(), self._saved_optimizer):
            variable.assign(value)
        super().restore()

    def training_mode(self):
        if isinstance(self.optimizer, _DistributedOptimizer):
            return self.optimizer.hetero.mode
        # a plain optimizer beside a DistributedGradientTape (Horovod's TF2 elastic pattern)
        return None if self.optimizer is None else checkpointing.plain_optimizer_mode()

    def sync(self):
        root = self.sync_root("state.sync()")
        broadcast_variables(self.model.variables, root_rank=root)
        if self._optimizer_variables():
            broadcast_variables(self._optimizer_variables(), root_rank=root)
        super().sync()


__all__ = ["run", "State", "ObjectState", "TensorFlowKerasState"]
