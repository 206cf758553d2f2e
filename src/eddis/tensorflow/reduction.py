"""TensorFlow glue between gradient tensors and a core reducer.

A :class:`GradientReducer` serves one list of variables (names and shapes fixed
at construction). ``reduce(grads)`` hands the gradients to an
:mod:`eddis.core` reducer bucket by bucket and returns the reduced gradients as
tensors. It works eagerly and inside ``tf.function`` (Keras ``model.fit``):
there each bucket becomes one ``tf.numpy_function`` that copies its gradients
into the plan's flat buffer and marks the bucket ready, so the core's
background threads put bucket 0 on the wire while TensorFlow still computes
the gradients of later buckets; one last ``numpy_function`` waits for the
result. Buckets are chained by control dependencies, so they are marked in
plan order on every rank. XLA cannot compile ``numpy_function``: functions
that reduce gradients must run with ``jit_compile=False``.

Gradients that are ``None`` locally travel as zeros (every rank must send every
bucket) and come back as ``None``. ``IndexedSlices`` are made dense. The flat
buffer is float32, or float64 when any variable is float64 (reduced in float64:
no gradient is rounded below its own precision).
"""
import itertools

import numpy as np
import tensorflow as tf

from .. import settings
from ..core import BucketPlan, make_reducer
from ..core.comm import collectives
from ..core.layout.buckets import gradient_dtype
from ..core.progress import join as _core_join
from ..errors import ConfigError
from . import agreement

_ids = itertools.count(1)


def variable_name(variable, index):
    return str(getattr(variable, "path", None) or getattr(variable, "name", None) or f"variable[{index}]")


def _dense(grad):
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad


class GradientReducer:
    """Reduce the gradients of a fixed list of variables through ``eddis.core``."""

    def __init__(self, variables, mode, codec, op, bucket_bytes, first_bucket_bytes, what):
        shapes = []
        for i, v in enumerate(variables):
            shape = tuple(v.shape)
            if any(d is None for d in shape):
                raise ConfigError(f"{what}: variable {variable_name(v, i)} has an undefined "
                                  f"shape {shape}; build the model (call it once) first")
            shapes.append(tuple(int(d) for d in shape))
        self.names = [variable_name(v, i) for i, v in enumerate(variables)]
        self.shapes = shapes
        # Positions, not Keras names, make the layout: auto-generated layer names
        # ("dense_3") depend on what else a process built before.
        self.plan = BucketPlan([(f"variable[{i}]", s) for i, s in enumerate(shapes)], bucket_bytes,
                               dtype=gradient_dtype(tf.as_dtype(v.dtype).name for v in variables),
                               first_bucket_bytes=first_bucket_bytes)
        self.tf_dtype = tf.as_dtype(self.plan.dtype)
        collectives.check_same(
            self.plan.signature() + f"\nop:{op} codec:{codec.name}",
            f"{what}: the trainable variables (shapes, in order)",
            "Build the same model on every rank (same layers, same order) and use the same "
            "compression, op, EDDIS_BUCKET_BYTES and EDDIS_FIRST_BUCKET_BYTES everywhere.")
        self.reducer = make_reducer(mode, self.plan, compression=codec, op=op,
                                    name=f"tensorflow.{next(_ids)}")
        self.mode = self.reducer.mode
        self.hooks = None  # an eddis.core.hetero.step.HeteroStep (before_push, before_sync)
        _core_join.register(self.reducer, self.join_reduce, self.join_apply)  # a DistributedOptimizer replaces it

    @property
    def closed(self):
        return self.reducer.closed

    def close(self):
        self.reducer.close()

    def set_sample_count(self, samples):
        self.reducer.set_weight(samples)

    # ------------------------------------------------------------ numpy side
    def _stage(self, k, weight, arrays):
        if k == 0 and self.hooks is not None:
            self.hooks.before_push()
        if weight is not None:
            self.reducer.set_weight(float(weight))
        plan = self.plan
        for i, array in zip(plan.buckets[k].params, arrays):
            plan.view(i)[...] = np.asarray(array, dtype=plan.dtype).reshape(-1)
        self.reducer.mark_ready(k)

    def _finish(self):
        if self.hooks is not None:
            self.hooks.before_sync()
        self.reducer.wait()
        return self.plan.buffer.copy()

    def run_step(self):
        """One reduction of the plan's buffer as it is (every bucket at once), without the
        hooks of a training step: eddis.join()'s steps. Returns the reduced buffer (a copy)."""
        self.reducer.mark_all_ready()
        self.reducer.wait()
        return self.plan.buffer.copy()

    def join_reduce(self):
        """A joined rank's step for a gradient tape (eddis.join()): zeros in."""
        self.plan.buffer[...] = 0.0
        self.run_step()

    @staticmethod
    def join_apply():
        """Nothing to apply the result to (the tape's optimizer is not EDDIS's), so this
        rank's variables stay behind and it sits out the drift check."""
        agreement.tick(abstain=True)

    # ------------------------------------------------------------ tensor side
    def reduce(self, grads, sample_count=None, depends_on=None):
        """Reduced gradients (a list, ``None`` where ``grads`` has ``None``).

        ``sample_count``: this rank's weight in the average for this step (a number
        or a scalar tensor, e.g. the local batch size); None keeps the last one.
        ``depends_on``: a tensor that must be computed before the first bucket goes
        (graph mode).
        """
        grads = [None if g is None else _dense(g) for g in grads]
        if len(grads) != len(self.shapes):
            raise ConfigError(f"got {len(grads)} gradients for {len(self.shapes)} variables")
        staged = [tf.zeros(s, self.tf_dtype) if g is None else tf.cast(g, self.tf_dtype)
                  for g, s in zip(grads, self.shapes)]
        if tf.executing_eagerly():
            flat = self._reduce_eagerly(staged, sample_count)
        else:
            flat = self._reduce_in_graph(staged, sample_count, depends_on)
        out = []
        for g, slot in zip(grads, self.plan.slots):
            if g is None:
                out.append(None)
                continue
            piece = tf.reshape(flat[slot.start:slot.start + slot.count], slot.shape)
            out.append(piece if g.dtype == self.tf_dtype else tf.cast(piece, g.dtype))
        return out

    def _reduce_eagerly(self, staged, sample_count):
        weight = None if sample_count is None else float(tf.convert_to_tensor(sample_count).numpy())
        for k, bucket in enumerate(self.plan.buckets):
            self._stage(k, weight if k == 0 else None, [staged[i].numpy() for i in bucket.params])
        return tf.convert_to_tensor(self._finish())

    def _reduce_in_graph(self, staged, sample_count, depends_on=None):
        token = depends_on
        for k, bucket in enumerate(self.plan.buckets):
            inputs = [staged[i] for i in bucket.params]
            with_weight = k == 0 and sample_count is not None
            if with_weight:
                inputs.append(tf.cast(sample_count, tf.float64))
            if token is not None:
                inputs.append(token)

            def stage(*arrays, k=k, with_weight=with_weight, n=len(bucket.params)):
                self._stage(k, arrays[n] if with_weight else None, arrays[:n])
                return np.int64(k)

            token = tf.numpy_function(stage, inputs, tf.int64, stateful=True,
                                      name=f"eddis_push_bucket_{k}")
        flat = tf.numpy_function(lambda _token: self._finish(), [token], self.tf_dtype,
                                 stateful=True, name="eddis_wait_gradients")
        flat.set_shape([self.plan.total])
        return flat


class ReducerCache:
    """One GradientReducer per (variable layout, mode, compression, op, bucket sizes)."""

    def __init__(self):
        self._reducers = {}

    def get(self, variables, mode, codec, op, bucket_bytes, what):
        first_bucket_bytes = settings.get("EDDIS_FIRST_BUCKET_BYTES")
        key = (tuple((variable_name(v, i), tuple(v.shape)) for i, v in enumerate(variables)),
               mode, codec.name, op, bucket_bytes, first_bucket_bytes)
        reducer = self._reducers.get(key)
        if reducer is None or reducer.closed:  # closed by eddis.shutdown()
            reducer = GradientReducer(variables, mode, codec, op, bucket_bytes, first_bucket_bytes, what)
            self._reducers[key] = reducer
        return reducer

    def close(self):
        for reducer in self._reducers.values():
            reducer.close()
        self._reducers.clear()
