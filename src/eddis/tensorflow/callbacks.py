"""Keras callbacks: ``eddis.callbacks.BroadcastGlobalVariablesCallback(0)``,
``MetricAverageCallback()``, ``LearningRateScheduleCallback(initial_lr, multiplier, ...)``,
``LearningRateWarmupCallback(initial_lr, ...)`` and ``ProgressControlCallback()``.

Callbacks that communicate make collective calls: give every rank the same
list of them (the same epochs and steps on every rank, too).
"""
import math
import sys
import warnings

import keras
import numpy as np

from ..core.comm import collectives, runtime
from ..errors import ConfigError
from . import agreement
from .ops import broadcast_variables


def ensure_no_xla(model):
    """EDDIS reduces gradients in ``tf.numpy_function`` ops, which XLA cannot compile.
    Keras' ``jit_compile="auto"`` means XLA on GPU machines: switch it off and rebuild
    the train function (called from on_train_begin, before the first step)."""
    if getattr(model, "jit_compile", False) and not getattr(model, "run_eagerly", False):
        warnings.warn("EDDIS: the model was compiled with XLA (jit_compile); the gradient reduction "
                      "cannot run inside XLA, so training continues with jit_compile=False. Pass "
                      "jit_compile=False to model.compile() to silence this.", stacklevel=3)
        model.jit_compile = False
        model.make_train_function(force=True)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, give every rank root_rank's model and optimizer
    variables (weights, optimizer slots, iteration count), so all ranks start alike."""

    def __init__(self, root_rank=0, device=""):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            ensure_no_xla(self.model)
            return
        runtime.require("BroadcastGlobalVariablesCallback")
        ensure_no_xla(self.model)
        broadcast_variables(self.model.variables, root_rank=self.root_rank)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            broadcast_variables(optimizer.variables, root_rank=self.root_rank)
        self.broadcast_done = True

    def on_train_batch_end(self, batch, logs=None):
        # model.fit traces the step: this is where Python sees one end (every rank alike)
        agreement.tick()


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of every epoch, replace each metric in ``logs`` (loss, accuracy,
    val_*) by its average over all ranks, so that callbacks after it (History,
    checkpoints, early stopping) and rank 0's output see the global value.
    Put it before the callbacks that read the metrics."""

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            logs = {}
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        collectives.check_same(
            "\n".join(names), "MetricAverageCallback: the metric names",
            "Compile the same model with the same metrics on every rank, and give every rank "
            "the same validation data settings.")
        if not names:
            return
        values = np.array([float(logs[k]) for k in names], dtype=np.float64)
        collectives.allreduce_array(values, op="average", out=values, what="MetricAverageCallback")
        for k, v in zip(names, values):
            logs[k] = float(v)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` up to
    (not including) ``end_epoch`` (Horovod's callback and signature). ``multiplier`` is a
    number or a function of the epoch; with ``staircase=True`` (forced for a number) the
    rate changes at the first batch of each epoch, else batch by batch with a fractional
    epoch (``steps_per_epoch`` defaults to what ``model.fit`` knows). ``initial_lr=None``
    takes the optimizer's rate when training starts.

    Keras 3 compiles the momentum into the train function, so Horovod's
    ``momentum_correction`` is not available (its default here is False); the optimizer's
    learning rate must be a number (a variable), not a ``LearningRateSchedule``.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=False, steps_per_epoch=None):
        super().__init__()
        if momentum_correction:
            raise ConfigError("momentum_correction is not supported with Keras 3 (the momentum is "
                              "compiled into the train function); pass momentum_correction=False")
        self.initial_lr = None if initial_lr is None else float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor
            self.staircase = True  # a constant factor: nothing to interpolate within an epoch

    def _optimizer(self):
        optimizer = self.model.optimizer
        if isinstance(optimizer.learning_rate, keras.optimizers.schedules.LearningRateSchedule) or \
                callable(getattr(optimizer, "_learning_rate", None)):
            raise ConfigError(f"{type(self).__name__} needs an optimizer with a fixed learning "
                              "rate, not a LearningRateSchedule; fold this callback's schedule into "
                              "the optimizer's LearningRateSchedule instead")
        return optimizer

    def _current_lr(self):
        return float(np.asarray(self.model.optimizer.learning_rate))

    def on_train_begin(self, logs=None):
        runtime.require(type(self).__name__)
        if self.initial_lr is None:
            self.initial_lr = self._current_lr()
        if self.staircase:
            return
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.steps_per_epoch:
            raise ConfigError(f"{type(self).__name__} could not find the steps per epoch "
                              "(the dataset has no known length): pass steps_per_epoch=")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def _in_scope(self):
        return self.current_epoch >= self.start_epoch and (
            self.end_epoch is None or self.current_epoch < self.end_epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if not self._in_scope():
            return
        if self.staircase:
            if batch == 0:
                self._optimizer().learning_rate = self.initial_lr * self.multiplier(self.current_epoch)
            return
        epoch = self.current_epoch + float(batch) / self.steps_per_epoch
        self._optimizer().learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = self._current_lr()


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over the
    first ``warmup_epochs`` epochs, batch by batch (Horovod's schedule, reaching
    ``initial_lr`` at the last batch of the warm-up; "Accurate, Large Minibatch SGD",
    Goyal et al.). ``initial_lr`` is the rate scaled for the world size
    (``base_lr * eddis.size()``); a single rank runs at it throughout.

    ``steps_per_epoch`` defaults to what ``model.fit`` knows; ``momentum_correction``
    as in :class:`LearningRateScheduleCallback`.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=False, steps_per_epoch=None,
                 verbose=0):
        if warmup_epochs <= 0:
            raise ConfigError(f"warmup_epochs must be > 0, got {warmup_epochs}")
        self.warmup_epochs = float(warmup_epochs)

        def multiplier(epoch):
            # Horovod counts the batch being started as done, so the last batch of the
            # warm-up runs at initial_lr itself
            return self.ramp(epoch + 1.0 / self.steps_per_epoch)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def ramp(self, epoch, size=None):
        """Factor of ``initial_lr`` at fractional ``epoch`` (1 from warmup_epochs on)."""
        size = runtime.size() if size is None else int(size)
        if epoch >= self.warmup_epochs or size == 1:
            return 1.0
        return 1.0 / size * (epoch * (size - 1) / self.warmup_epochs + 1.0)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch + 1 == math.ceil(self.warmup_epochs) and self.verbose and runtime.rank() == 0:
            sys.stdout.write(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                             f"{self._current_lr():g}.\n")


class ProgressControlCallback(keras.callbacks.Callback):
    """Drive the global learning counter and the step timeline from ``model.fit``.

    Before every step it calls ``eddis.should_stop()`` (the first time in
    ``on_train_begin``, then at the end of each step for the next one) and ends
    ``fit`` when the job's iterations are used up, so faster ranks do more steps
    (easgd), or all ranks of a lockstep unit stop together (sync, hybrid). Give
    ``fit`` enough data (``dataset.repeat()``); ``total``, ``chunk`` and
    ``staleness`` default to EDDIS_TOTAL_ITERATIONS, EDDIS_CLAIM_CHUNK and
    EDDIS_STALENESS. Each step is recorded as a ``step`` span on the timeline
    (EDDIS_TIMELINE) and, with ``samples_per_step``, counted in the profile
    (EDDIS_PROFILE). ``steps`` holds the steps this rank ran.

    One ``fit`` call per configured counter: it is reset at the end of training,
    so another ``fit`` with this callback starts a new count.
    """

    def __init__(self, total=None, chunk=None, staleness=None, samples_per_step=None, record=False):
        super().__init__()
        self.total = total
        self.chunk = chunk
        self.staleness = staleness
        self.samples_per_step = samples_per_step
        self.record = record
        self.steps = 0
        self._t0 = None

    def _stop_if_done(self):
        from .hetero import should_stop

        if should_stop():
            self.model.stop_training = True
            return True
        return False

    def on_train_begin(self, logs=None):
        from .hetero import configure_progress

        from ..core.progress import counter as progress

        runtime.require("ProgressControlCallback")
        ensure_no_xla(self.model)
        self.steps = 0
        previous = progress.controller()
        if previous is not None and previous.finished:  # an earlier fit used it up
            progress.reset()
        configure_progress(total=self.total, chunk=self.chunk, staleness=self.staleness,
                           record=self.record)
        self._stop_if_done()

    def on_train_batch_begin(self, batch, logs=None):
        from .. import timeline

        if self.samples_per_step:
            from ..core.comm import observe

            observe.note_samples(self.samples_per_step)
        self._t0 = timeline.now_ns() if timeline.enabled() else None

    def on_train_batch_end(self, batch, logs=None):
        from .. import timeline

        if self._t0 is not None:
            timeline.complete(timeline.STEP, self._t0, args={"step": self.steps})
        self.steps += 1
        self._stop_if_done()

    def on_train_end(self, logs=None):
        from ..core.progress import counter as progress

        ctl = progress.controller()
        self.steps_done = None if ctl is None else ctl.steps_done
