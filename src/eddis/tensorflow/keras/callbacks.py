"""Horovod's ``horovod.tensorflow.keras.callbacks``: the callbacks of :mod:`eddis.tensorflow.callbacks`."""
from ..callbacks import (BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,  # noqa: F401
                         LearningRateWarmupCallback, MetricAverageCallback, ProgressControlCallback)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "ProgressControlCallback"]
