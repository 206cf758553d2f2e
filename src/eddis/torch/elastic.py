"""``eddis.torch.elastic``: Horovod's elastic API for PyTorch scripts (``hvd.elastic``).

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()
    train(hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0))

What the calls mean in EDDIS (``eddis.core.checkpoint.elastic_state``): ``run`` syncs once
and calls the function once, since easgd/hybrid survivors of a lost rank train
on (EDDIS_ELASTIC=1) and sync runs restart their trainers (EDDIS_MAX_RESTARTS);
``commit()`` keeps an in-memory copy that ``restore()`` returns to, and in sync also
writes it as a checkpoint (``eddis.checkpoint``), from which ``run`` starts a restarted
run; ``sync()`` broadcasts from rank 0. The callbacks of ``register_reset_callbacks``
run, as under Horovod, only after a reset: when ``run`` goes on from a commit, never at
the first start.
"""
import copy

from ..core.checkpoint.elastic_state import ModelState, ObjectState, State, run
from . import checkpointing
from .functions import broadcast_optimizer_state, broadcast_parameters
from .hetero import state_of


class TorchState(ModelState):
    """A model, an optimizer and plain values (``epoch=0, batch=0``) as one elastic state."""

    checkpointing = checkpointing

    def __init__(self, model=None, optimizer=None, **kwargs):
        self.model = model
        self.optimizer = optimizer
        self._saved_model = self._saved_optimizer = None
        super().__init__(**kwargs)

    def save(self):
        if self.model is not None:
            self._saved_model = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._saved_optimizer = copy.deepcopy(self.optimizer.state_dict())
        super().save()

    def restore(self):
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
        super().restore()

    def training_mode(self):
        hetero = state_of(self.optimizer)   # an eddis.DistributedOptimizer's
        return None if hetero is None or self.model is None else hetero.mode

    def sync(self):
        root = self.sync_root("state.sync()")
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=root)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=root)
        super().sync()


__all__ = ["run", "State", "ObjectState", "TorchState"]
