"""``DistributedOptimizer``: a Keras 3 optimizer whose updates use gradients
averaged over all ranks, for ``model.fit`` and custom loops alike.

Keras 3's ``model.fit`` computes the gradients in ``train_step`` and calls
``optimizer.apply_gradients()``, which calls ``optimizer.apply(grads,
variables)``. The wrapped optimizer overrides ``apply``: it reduces the
gradients through an :mod:`eddis.core` reducer (see
:mod:`eddis.tensorflow.reduction`) and then runs the original update, so
every Keras optimizer works unchanged and the update stays local. The object
is the user's optimizer itself, its class swapped for a subclass that adds the
override (state, variables and serialization stay those of the original class).

Mixed precision: under the ``mixed_float16`` policy, Keras wraps the optimizer
in a ``LossScaleOptimizer`` at ``compile()``, which skips a step when a
gradient is not finite. That check must see the *reduced* gradients, or ranks
would disagree on skipping and the next reduction would wait forever. So the
wrapper puts the ``LossScaleOptimizer`` inside: ``DistributedOptimizer`` wraps
the optimizer in one first (when the policy is ``mixed_float16``) and reduces
the still-scaled gradients before the loss-scale logic sees them.
``mixed_bfloat16`` needs no loss scaling.
"""
import keras
import numpy as np
import tensorflow as tf

from .. import settings
from ..core.basics import basics as _basics
from ..core.comm import runtime
from ..core.comm.ops import reject_unsupported_horovod_options
from ..core.hetero import step as hetero
from ..core.progress import join as _core_join
from ..errors import ConfigError, UsageError
from . import agreement
from .compression import codec_of
from .ops import Average
from .reduction import GradientReducer


class _Config:
    """Settings of one wrapped optimizer (kept off Keras's attribute tracking)."""

    def __init__(self, mode, codec, op, bucket_bytes, balance):
        self.mode = mode
        self.balance = balance
        self.hetero = None
        self.codec = codec
        self.op = op
        self.bucket_bytes = bucket_bytes
        self.reducer = None
        self.variables = None
        self.joined_result = None
        self.variables_key = None
        self.sample_count = None


class _VariableList(list):
    """A list that is also callable: Horovod's TF2 examples call ``opt.variables()``
    (tf.keras 2), Keras 3 made ``variables`` a property; both forms then work."""

    def __call__(self):
        return list(self)


class _DistributedOptimizer:
    """Methods mixed into a subclass of the user's optimizer class."""

    @property
    def variables(self):
        return _VariableList(super(_DistributedOptimizer, self).variables)

    def build(self, variables):
        """Keras's build, and the reduction of ``variables`` set up with it (collective): a
        rank that ends up taking no step has then still met the others' set-up collectives."""
        super(_DistributedOptimizer, self).build(variables)
        self._eddis_reducer_for(list(variables))

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise UsageError("DistributedOptimizer.apply(grads) without variables needs a built "
                                 "optimizer: call optimizer.build(model.trainable_variables) first")
            variables = list(self._trainable_variables)
        else:
            trainable_variables = list(trainable_variables)
            variables = trainable_variables
        if not grads:
            return super(_DistributedOptimizer, self).apply(grads, trainable_variables)
        reducer = self._eddis_reducer_for(variables)
        state = self._eddis.hetero
        count = self._eddis.sample_count
        # a number is set on the reducer from Python (it may change between steps
        # of a traced train function); a tensor or variable is read in the graph
        count = count if _is_tensor(count) else None
        if tf.executing_eagerly():
            if state.needs_centre:
                state.init_centre()
            grads = reducer.reduce(grads, count)
            result = super(_DistributedOptimizer, self).apply(grads, trainable_variables)
            # a traced step (model.fit) is counted by the callbacks instead, and takes no
            # checkpoints (it cannot stop to write files; see docs/user-guide.md)
            _basics.end_of_step(state)
            return result
        token = _graph_init_centre(state, reducer, variables) if state.averager is not None else None
        grads = reducer.reduce(grads, count, depends_on=token)
        super(_DistributedOptimizer, self).apply(grads, trainable_variables)
        _graph_after_step(state, reducer, variables)

    def _eddis_reducer_for(self, variables):
        cfg = self._eddis
        key = tuple((id(v), tuple(v.shape)) for v in variables)
        if cfg.reducer is None or cfg.reducer.closed or key != cfg.variables_key:
            if cfg.reducer is not None and not cfg.reducer.closed:
                cfg.reducer.close()
            cfg.reducer = GradientReducer(variables, cfg.mode, cfg.codec, cfg.op, cfg.bucket_bytes,
                                          settings.get("EDDIS_FIRST_BUCKET_BYTES"), "DistributedOptimizer")
            cfg.variables_key = key
            agreement.watch(variables)
            cfg.hetero.attach(cfg.reducer.plan, cfg.reducer.reducer,
                              gather=_gatherer(cfg.reducer.plan, variables),
                              scatter=_scatterer(cfg.reducer.plan, variables))
            cfg.reducer.hooks = cfg.hetero
            cfg.variables = list(variables)
            _core_join.register(cfg.reducer.reducer, self._eddis_join_reduce, self._eddis_join_apply)
            if cfg.sample_count is not None and not _is_tensor(cfg.sample_count):
                cfg.reducer.set_sample_count(cfg.sample_count)
        return cfg.reducer

    def _eddis_join_reduce(self):
        """A step of a rank that has no data left (eddis.join(), eagerly; it set the joined
        weight): zeros into the reduction; the others' result is kept for the update."""
        cfg = self._eddis
        cfg.reducer.plan.buffer[...] = 0.0
        cfg.joined_result = cfg.reducer.run_step()

    def _eddis_join_apply(self):
        """The rest of that step: the wrapped update with the others' gradients (so this
        rank's variables and slots keep up with theirs), then the step's end (its hooks, the
        drift check, the step boundary)."""
        cfg = self._eddis
        flat, slots = cfg.joined_result, cfg.reducer.plan.slots
        grads = [tf.convert_to_tensor(flat[s.start:s.start + s.count].reshape(s.shape).astype(_np_dtype(v)))
                 for s, v in zip(slots, cfg.variables)]
        super(_DistributedOptimizer, self).apply(grads, cfg.variables)
        _basics.end_of_step(cfg.hetero)

    def set_sample_count(self, samples):
        """This rank's weight in the gradient average from the next step on: the
        number of samples its (mean) loss is computed over, e.g. its local batch
        size. Ranks with unequal shares of the global batch then still get the
        gradient of the whole global batch. A number or a scalar tf.Variable."""
        self._eddis.sample_count = samples
        reducer = self._eddis.reducer
        if reducer is not None and not reducer.closed and not _is_tensor(samples):
            reducer.set_sample_count(samples)

    @property
    def hetero(self):
        """The optimizer's :class:`eddis.core.hetero.step.HeteroStep` (variables attached at step 1)."""
        return self._eddis.hetero

    def final_model(self):
        """Collective: load the job's final model into the variables on every rank
        (easgd/hybrid: the centre variable; sync/allreduce: nothing to do)."""
        if self._eddis.hetero is not None:
            self._eddis.hetero.final_model()

    @property
    def reducer(self):
        """The core reducer (statistics, events); None before the first step."""
        r = self._eddis.reducer
        return None if r is None else r.reducer

    def close(self):
        """Stop the communication threads (eddis.shutdown() does it too) and, in easgd and
        hybrid, release the centre variable (call final_model() first; every rank)."""
        if self._eddis.reducer is not None:
            self._eddis.reducer.close()
        if self._eddis.hetero is not None:
            self._eddis.hetero.close()


def _gatherer(plan, variables):
    def gather(flat):
        for slot, v in zip(plan.slots, variables):
            flat[slot.start:slot.start + slot.count] = np.asarray(v.numpy(), dtype=flat.dtype).reshape(-1)
    return gather


def _scatterer(plan, variables):
    def scatter(flat):
        for slot, v in zip(plan.slots, variables):
            v.assign(flat[slot.start:slot.start + slot.count].reshape(slot.shape).astype(_np_dtype(v)))
    return scatter


def _np_dtype(variable):
    return tf.as_dtype(variable.dtype).as_numpy_dtype


def _values(variables):
    """The variables' current values (ordered after earlier updates by TF's
    automatic control dependencies on the same resources)."""
    return [tf.convert_to_tensor(v.value if isinstance(v, keras.Variable) else v) for v in variables]


def _to_flat(plan, flat, arrays):
    for slot, a in zip(plan.slots, arrays):
        flat[slot.start:slot.start + slot.count] = np.asarray(a, dtype=flat.dtype).reshape(-1)
    return flat


def _graph_init_centre(state, reducer, variables):
    """Graph ops: on the first step, rank 0's variables become the centre (collective)."""
    def needs():
        return np.bool_(state.needs_centre)

    def init(*arrays):
        state.init_centre(_to_flat(reducer.plan, np.empty(reducer.plan.total, reducer.plan.dtype), arrays))
        return np.int64(1)

    need = tf.numpy_function(needs, [], tf.bool, stateful=True, name="eddis_needs_centre")
    need.set_shape([])
    return tf.cond(need,
                   lambda: tf.numpy_function(init, _values(variables), tf.int64, stateful=True,
                                             name="eddis_init_centre"),
                   lambda: tf.constant(0, tf.int64))


def _graph_after_step(state, reducer, variables):
    """Graph ops after the update: the elastic exchange when due, then end the step."""
    plan = reducer.plan
    dtypes = [tf.as_dtype(v.dtype) for v in variables]
    if state.averager is not None:
        def due():
            return np.bool_(state.exchange_due())

        def exchange(*arrays):
            flat = state.exchange_flat(_to_flat(plan, state.flat, arrays))
            return [flat[s.start:s.start + s.count].reshape(s.shape).astype(d.as_numpy_dtype)
                    for s, d in zip(plan.slots, dtypes)]

        def exchange_and_assign():
            moved = tf.numpy_function(exchange, _values(variables), dtypes, stateful=True,
                                      name="eddis_elastic_exchange")
            assigns = [v.assign(tf.reshape(m, v.shape)) for v, m in zip(variables, moved)]
            with tf.control_dependencies(assigns):
                return tf.constant(1, tf.int64)

        is_due = tf.numpy_function(due, [], tf.bool, stateful=True, name="eddis_exchange_due")
        is_due.set_shape([])
        done = tf.cond(is_due, exchange_and_assign, lambda: tf.constant(0, tf.int64))
        after = [done]
    else:
        after = _values(variables)  # read after the update: end_step follows it

    def end_step(*_):
        state.end_step()
        return np.int64(state.step)

    return tf.numpy_function(end_step, after, tf.int64, stateful=True, name="eddis_end_step")


def _is_tensor(value):
    return value is not None and (tf.is_tensor(value) or isinstance(value, (tf.Variable, keras.Variable)))


def _is_loss_scale_optimizer(optimizer):
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=None,
                         sparse_as_dense=True, backward_passes_per_step=1, op=Average,
                         gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=None, mode=None, bucket_bytes=None,
                         sample_count=None, balance=None):
    """Make ``optimizer`` (a Keras 3 optimizer) reduce gradients over all ranks.

    Horovod's signature; EDDIS adds ``mode`` ("sync" through SMB, "allreduce"
    through MPI, "easgd" and "hybrid" for mixed GPU generations; default
    EDDIS_MODE), ``balance`` (sync: each rank's share of the global batch follows
    its measured speed, with ``eddis.balanced_batches``; hybrid: the same inside each group,
    with the group's batch; default EDDIS_BALANCE),
    ``bucket_bytes`` (default EDDIS_BUCKET_BYTES) and ``sample_count`` (see
    ``set_sample_count``).
    ``compression`` defaults to EDDIS_COMPRESSION. Returns the optimizer (the
    same object, or a ``LossScaleOptimizer`` around it under ``mixed_float16``);
    compile the model with it and ``jit_compile=False``.
    """
    runtime.require("eddis.DistributedOptimizer()")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        hint = ""
        if isinstance(optimizer, str):
            hint = (" (a name: create the optimizer, e.g. "
                    "eddis.DistributedOptimizer(keras.optimizers.SGD(0.01 * eddis.size())))")
        elif isinstance(optimizer, keras.Model):
            hint = " (you passed the model: wrap its optimizer)"
        raise ConfigError(f"DistributedOptimizer needs a keras.optimizers.Optimizer (Keras 3), got "
                          f"{type(optimizer).__name__}{hint}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise UsageError("this optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    op = _basics.gradient_op(op, "DistributedOptimizer", mode=mode, sample_count=sample_count)
    if backward_passes_per_step != 1:
        raise ConfigError("backward_passes_per_step is not supported with Keras 3: create the optimizer "
                          "with gradient_accumulation_steps=N instead (Keras accumulates the reduced "
                          "gradients, which gives the same update)")
    reject_unsupported_horovod_options(gradient_predivide_factor, groups, num_groups, process_set)
    if (keras.mixed_precision.global_policy().name == "mixed_float16"
            and not _is_loss_scale_optimizer(optimizer)):
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    base = optimizer.__class__
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    # object.__setattr__: Keras optimizers track attribute assignments
    object.__setattr__(optimizer, "__class__", cls)
    config = _Config(settings.get("EDDIS_MODE") if mode is None else str(mode).lower(),
                     codec_of(compression), op.name,
                     settings.get("EDDIS_BUCKET_BYTES") if bucket_bytes is None else int(bucket_bytes),
                     balance)
    config.sample_count = sample_count
    # Built now (the data pipeline of balanced sync asks it for shares before the
    # first step); it learns the variables at the first step (attach). It also tells
    # the global learning counter the mode, which decides its lockstep units.
    config.hetero = hetero.HeteroStep(mode=config.mode, balance=balance,
                                      measure_first_step=False)  # the first step traces the graph
    if config.hetero.balancer is not None and sample_count is not None:
        raise ConfigError("balance=True sets each rank's sample count from its measured share; "
                          "drop sample_count (and set_sample_count)")
    object.__setattr__(optimizer, "_eddis", config)
    return optimizer
