"""Checkpoint and resume of a whole run in ``eddis.tensorflow``: the Keras tensors of it.

    start = eddis.resume(ckpt_dir, model, optimizer)     # step 0 when ckpt_dir has none
    for step in range(start.step, steps):
        ...tape, optimizer.apply(...)                   # periodic/requested checkpoints (eager)
    eddis.checkpoint(ckpt_dir, model, optimizer)

What is written, where and when is :mod:`eddis.core.checkpoint`'s; this module gives it
``rank-NNNNN.keras.h5`` (h5py): every variable of the model (``model.variables``, in order:
weights, and the seed generators' states where Keras tracks them), the optimizer's variables
(iterations, slots such as momenta) and TensorFlow's global generator state.

The optimizer is an ``eddis.DistributedOptimizer`` (its periodic and requested checkpoints
too), or, in sync and allreduce, a plain Keras optimizer that applies a
``DistributedGradientTape``'s gradients: no EDDIS code runs in its step, so it gets the
explicit ``eddis.checkpoint`` calls and ``state.commit()`` only, and its ``iterations`` count the
steps.
"""
import h5py
import keras
import numpy as np
import tensorflow as tf

from .. import settings
from ..core.basics import basics as _basics
from ..core.checkpoint.state import PLAIN_OPTIMIZER_MODES, PlainOptimizerRun
from ..errors import CheckpointError, ConfigError


class KerasParticipant:
    """The TensorFlow side of one rank's checkpoint: a Keras model and its optimizer, an
    eddis.DistributedOptimizer or a plain one beside a DistributedGradientTape."""

    framework = "tensorflow"
    ext = ".keras.h5"

    def __init__(self, model, optimizer):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ConfigError(f"eddis.checkpoint/resume need the Keras optimizer that trains the model (an "
                              f"eddis.DistributedOptimizer, or a plain one beside a DistributedGradientTape), "
                              f"got {type(optimizer).__name__}")
        if not hasattr(model, "variables"):
            raise ConfigError(f"eddis.checkpoint/resume need the Keras model that is trained, got "
                              f"{type(model).__name__}")
        self.model = model
        self.optimizer = optimizer

    def build_optimizer(self):
        """Build the optimizer for the model's trainable variables, unless it is built."""
        if not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)

    def _optimizer_variables(self):
        self.build_optimizer()
        return list(self.optimizer.variables)

    def write(self, path, include_model):
        with h5py.File(path, "w") as h5:
            h5.create_dataset("rng/tf", data=tf.random.get_global_generator().state.numpy())
            if include_model:
                for group, variables in (("model", self.model.variables),
                                         ("optimizer", self._optimizer_variables())):
                    g = h5.create_group(group)
                    for i, v in enumerate(variables):
                        g.create_dataset(f"{i:05d}", data=np.asarray(v.numpy()))

    def read(self, model_file, rng_file):
        if model_file is not None:
            with h5py.File(model_file, "r") as h5:
                for group, variables in (("model", self.model.variables),
                                         ("optimizer", self._optimizer_variables())):
                    saved = h5[group]
                    if len(saved) != len(variables):
                        raise CheckpointError(f"{model_file} holds {len(saved)} {group} variables, this "
                                              f"{group} has {len(variables)}: resume with the model and "
                                              "optimizer that were trained")
                    for i, v in enumerate(variables):
                        v.assign(saved[f"{i:05d}"][()])
        if rng_file is not None:
            with h5py.File(rng_file, "r") as h5:
                tf.random.get_global_generator().reset(h5["rng/tf"][()])


def plain_optimizer_mode():
    """The mode a plain optimizer trains in beside a DistributedGradientTape (EDDIS_MODE), or
    None where a tape cannot train (easgd, hybrid): there only EDDIS's optimizer holds the state."""
    mode = settings.get("EDDIS_MODE")
    return mode if mode in PLAIN_OPTIMIZER_MODES else None


def _bind(model, optimizer):
    from .optimizer import _DistributedOptimizer

    participant = KerasParticipant(model, optimizer)
    if isinstance(optimizer, _DistributedOptimizer):
        # collective, as resume and checkpoint are: the reduction and the centre variable are
        # set up (and a resumed centre restored) now, not at a first step that a rank may never
        # take when the others claim the iterations left
        participant.build_optimizer()
        return optimizer.hetero, participant
    # a plain optimizer steps with no EDDIS code in its step: explicit checkpoints and commits only
    run = PlainOptimizerRun(settings.get("EDDIS_MODE"), lambda: optimizer.iterations.numpy(),
                            optimizer.iterations.assign)
    return run, participant


def checkpoint(path, model, optimizer, epoch=None, batch=None, **extra):
    """Collective, between two optimizer steps: write a checkpoint of the whole run into the
    folder ``path`` (as ``path/ckpt-<step>``; None: EDDIS_CHECKPOINT_DIR); returns its path.
    ``extra``: JSON values returned by :func:`resume`."""
    state, participant = _bind(model, optimizer)
    return _basics.save_training(path, state, participant, extra, epoch=epoch, batch=batch)


def resume(path_or_dir, model, optimizer):
    """Collective, before training (the model built): restore the checkpoint ``path_or_dir``
    names (or the newest in a folder of them; None: EDDIS_CHECKPOINT_DIR) into ``model``,
    ``optimizer``, the RNGs and this job's SMB servers; returns a ``Start``, all zeros when
    there is nothing to resume. Also binds the model to the optimizer's periodic checkpoints."""
    state, participant = _bind(model, optimizer)
    return _basics.resume_training(path_or_dir, state, participant)


__all__ = ["checkpoint", "resume"]
