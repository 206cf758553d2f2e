"""Checkpoint and resume of a whole run in ``eddis.torch``: the torch tensors of it.

    start = eddis.resume(ckpt_dir, model, optimizer)     # step 0 when ckpt_dir has none
    for epoch in range(start.epoch, epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if start.done(epoch, i):
                continue
            ...
            optimizer.step()                            # periodic/requested checkpoints here
    eddis.checkpoint(ckpt_dir, model, optimizer, note="end")

What is written, where and when is :mod:`eddis.core.checkpoint`'s; this module gives it
``rank-NNNNN.pt`` (``torch.save``): the model's and the optimizer's state dicts (rank 0's in
sync, every rank's in easgd/hybrid) and torch's CPU and CUDA RNG states.
"""
import torch

from ..core.basics import basics as _basics
from ..errors import ConfigError
from . import deferred
from .hetero import _state_of, state_of


class TorchParticipant:
    """The torch side of one rank's checkpoint: a model and its DistributedOptimizer."""

    framework = "torch"
    ext = ".pt"

    def __init__(self, model, optimizer):
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"eddis.checkpoint/resume need the torch.nn.Module that is trained, got "
                              f"{type(model).__name__}")
        if state_of(optimizer) is None:
            raise ConfigError("eddis.checkpoint/resume need the optimizer returned by "
                              "eddis.DistributedOptimizer(...)")
        self.model = model
        self.optimizer = optimizer

    def write(self, path, include_model):
        payload = {"rng": {"torch": torch.get_rng_state(),
                           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}}
        if include_model:
            deferred.finish_all()   # EDDIS_OVERLAP_FORWARD: the last step's updates first
            payload["model"] = self.model.state_dict()
            payload["optimizer"] = self.optimizer.state_dict()
        torch.save(payload, path)

    def read(self, model_file, rng_file):
        if model_file is not None:
            payload = torch.load(model_file, map_location="cpu", weights_only=True)
            self.model.load_state_dict(payload["model"])
            self.optimizer.load_state_dict(payload["optimizer"])
        if rng_file is not None:
            rng = torch.load(rng_file, map_location="cpu", weights_only=True)["rng"]
            torch.set_rng_state(rng["torch"])
            if rng["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"][:torch.cuda.device_count()])


def _bind(model, optimizer):
    """The optimizer's step driver, and the participant that saves ``model`` (eddis.checkpoint and
    eddis.resume bind it to the driver: its periodic and requested checkpoints save it too)."""
    state = _state_of(optimizer)
    return state, TorchParticipant(model, optimizer)


def checkpoint(path, model, optimizer, epoch=None, batch=None, **extra):
    """Collective, at a step boundary (between ``optimizer.step()`` and the next step's
    gradients): write a checkpoint of the whole run into the folder ``path`` (as
    ``path/ckpt-<step>``; None: EDDIS_CHECKPOINT_DIR) and return its path. ``epoch``/``batch``
    (batches of the epoch done) default to what the EDDIS samplers' ``set_epoch`` recorded;
    ``extra``: JSON values returned by :func:`resume`."""
    state, participant = _bind(model, optimizer)
    return _basics.save_training(path, state, participant, extra, epoch=epoch, batch=batch)


def resume(path_or_dir, model, optimizer):
    """Collective, before training: restore the checkpoint ``path_or_dir`` names (one, or the
    newest complete one in a folder; None: EDDIS_CHECKPOINT_DIR) into ``model``, ``optimizer``,
    the RNGs, the samplers' position and this job's SMB servers. Returns a ``Start``
    (``.step``, ``.epoch``, ``.batch``, ``.extra``, ``.done(epoch, batch)``), all zeros when
    there is nothing to resume. Also tells the optimizer which model its periodic
    checkpoints save."""
    state, participant = _bind(model, optimizer)
    return _basics.resume_training(path_or_dir, state, participant)


__all__ = ["checkpoint", "resume"]
