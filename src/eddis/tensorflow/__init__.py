"""EDDIS for TensorFlow / Keras 3: ``import eddis.tensorflow as eddis`` (or ``as hvd``).

model.fit::

    eddis.init()
    model = make_model()
    optimizer = eddis.DistributedOptimizer(keras.optimizers.SGD(0.01 * eddis.size()))
    model.compile(optimizer=optimizer, loss=..., metrics=[...], jit_compile=False)
    model.fit(eddis.data.shard_batches(dataset, global_batch_size), epochs=...,
              callbacks=[eddis.callbacks.BroadcastGlobalVariablesCallback(0),
                         eddis.callbacks.MetricAverageCallback()],
              verbose=1 if eddis.rank() == 0 else 0)

GradientTape loop::

    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = eddis.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:
        eddis.broadcast_variables(model.variables, root_rank=0)
        eddis.broadcast_variables(optimizer.variables, root_rank=0)

Names and signatures follow Horovod's ``horovod.tensorflow`` /
``horovod.tensorflow.keras`` (see docs/tensorflow-conversion.md for the
differences). This package is a thin adapter: buckets, reductions, modes,
compression codecs and collectives are those of :mod:`eddis.core`, shared with
``eddis.torch``.
"""
import os as _os

_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as _tf  # noqa: E402

from ..core.basics import basics as _basics  # noqa: E402
from . import callbacks, data, elastic  # noqa: E402,F401  (hvd.elastic: run, TensorFlowKerasState)
from .checkpointing import checkpoint, resume  # noqa: E402
from .compression import Compression  # noqa: E402
from .data import balanced_batches, local_batch_size, shard, shard_batches  # noqa: E402
from .gradient_tape import DistributedGradientTape  # noqa: E402
from .hetero import (configure_progress, final_model, global_step, progress_counts,  # noqa: E402
                     reset_progress, save_model, should_stop)
from .ops import (Adasum, Average, Max, Min, ReduceOp, Sum, allgather, allgather_object,  # noqa: E402
                  allreduce, barrier, broadcast, broadcast_global_variables, broadcast_object,
                  broadcast_variables)
from .optimizer import DistributedOptimizer  # noqa: E402
from ..timeline import start_timeline, stop_timeline  # noqa: E402  (collective after init())


# init, rank, ..., the *_built() queries: the same objects as eddis.torch's
globals().update(_basics.bindings(_tf.test.is_built_with_cuda))


__all__ = [
    *_basics.SHARED,
    "DistributedGradientTape", "DistributedOptimizer", "Compression", "Average", "Sum", "Min",
    "Max", "Adasum", "ReduceOp", "broadcast_variables", "broadcast_global_variables", "allreduce", "broadcast", "allgather",
    "allgather_object", "broadcast_object", "barrier", "callbacks", "data", "shard",
    "shard_batches", "local_batch_size", "balanced_batches", "configure_progress", "should_stop", "global_step",
    "progress_counts", "reset_progress", "final_model", "save_model", "checkpoint", "resume", "start_timeline", "stop_timeline",
]
