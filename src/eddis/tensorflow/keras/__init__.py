"""Horovod's ``horovod.tensorflow.keras`` surface: ``import eddis.tensorflow.keras as hvd``.

The same objects as :mod:`eddis.tensorflow` (one adapter, bound twice), plus
Horovod's Keras-only ``load_model``::

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss=..., jit_compile=False)
    model.fit(..., callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                              hvd.callbacks.MetricAverageCallback(),
                              hvd.callbacks.LearningRateWarmupCallback(0.01 * hvd.size())])
"""
import keras as _keras

from ... import tensorflow as _tensorflow
from . import callbacks as _callbacks
from . import elastic as _elastic

# eddis.tensorflow's own objects, bound again under its names (one adapter, two addresses)
globals().update({name: getattr(_tensorflow, name) for name in _tensorflow.__all__})
callbacks = _callbacks  # Horovod's hvd.callbacks.*, also importable as eddis.tensorflow.keras.callbacks
elastic = _elastic  # Horovod's hvd.elastic.* for model.fit: KerasState and its callbacks


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=None):
    """``keras.models.load_model(filepath)`` with the loaded model's optimizer wrapped in a
    ``DistributedOptimizer`` (Horovod's call): training the loaded model goes on across
    the ranks, from the optimizer state in the file. ``custom_optimizers``: optimizer
    classes the file names that Keras does not know."""
    objects = {cls.__name__: cls for cls in (custom_optimizers or ())}
    objects.update(custom_objects or {})
    model = _keras.models.load_model(filepath, custom_objects=objects or None)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return model
    wrapped = _tensorflow.DistributedOptimizer(optimizer, compression=compression)
    if wrapped is not optimizer:  # a LossScaleOptimizer put around it (mixed_float16)
        model.optimizer = wrapped
    if getattr(model, "jit_compile", False):
        # compile() of the file may have chosen XLA ("auto" on a GPU); the reduction cannot run in it
        model.jit_compile = False
    return model


__all__ = [*_tensorflow.__all__, "elastic", "load_model"]
