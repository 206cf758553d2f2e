"""Tensor collectives for metrics and set-up: allreduce, broadcast, allgather,
and ``broadcast_variables``.

They run over MPI on the host on EDDIS's collectives thread (:mod:`eddis.core.comm.engine`:
each announced first, every wait timing out instead of hanging). Eagerly they act at
once; inside ``tf.function`` they become ``tf.numpy_function`` ops. They are meant for losses, accuracies and
start-up synchronization; gradients go through ``DistributedGradientTape`` or
``DistributedOptimizer``.
"""
import numpy as np
import tensorflow as tf

from ..core.basics import basics as _basics
from ..core.comm import collectives
from ..core.comm.ops import Adasum, Average, Max, Min, ReduceOp, Sum, resolve_op  # noqa: F401
from ..errors import ConfigError, UsageError
from . import agreement


def _wire(array):
    """numpy arrays MPI can carry: bfloat16 (ml_dtypes) travels as its uint16 bits."""
    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":
        return array.view(np.uint16), array.dtype
    if array.dtype == np.bool_:
        return array.view(np.uint8), array.dtype
    return array, None


def _as_tensor(value):
    return tf.convert_to_tensor(value.value if hasattr(value, "value") and not tf.is_tensor(value)
                                else value)


def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, compression=None, process_set=None):
    """A new tensor: ``tensor`` reduced over all ranks (default: averaged)."""
    _basics.require("eddis.allreduce()")
    if process_set is not None:
        raise ConfigError("process sets are not supported by EDDIS; reduce over all ranks")
    resolve_op(op, average)  # a bad op fails here, at the call, even inside tf.function
    tensor = _as_tensor(tensor)

    def reduce(array):
        return _basics.allreduce_array(array, op=op, average=average, name=name,
                                       prescale_factor=prescale_factor, postscale_factor=postscale_factor)

    if tf.executing_eagerly():
        return tf.convert_to_tensor(reduce(tensor.numpy()))
    out = tf.numpy_function(reduce, [tensor], tensor.dtype, stateful=True, name="eddis_allreduce")
    out.set_shape(tensor.shape)
    return out


def broadcast(tensor, root_rank=0, name=None):
    """A new tensor holding root_rank's ``tensor``."""
    _basics.require("eddis.broadcast()")
    tensor = _as_tensor(tensor)

    def bcast(array):
        return _basics.broadcast_async(array, root_rank=root_rank, name=name).wait()

    if tf.executing_eagerly():
        return tf.convert_to_tensor(bcast(tensor.numpy()))
    out = tf.numpy_function(bcast, [tensor], tensor.dtype, stateful=True, name="eddis_broadcast")
    out.set_shape(tensor.shape)
    return out


def allgather(tensor, name=None):
    """Concatenation of every rank's ``tensor`` along axis 0 (sizes may differ). Eager only."""
    return tf.convert_to_tensor(_basics.allgather_async(_as_tensor(tensor).numpy(), name=name).wait())


broadcast_object = _basics.broadcast_object
allgather_object = _basics.allgather_object
barrier = _basics.barrier


def _variable_list(variables):
    if callable(variables):  # tf.keras 2 style: optimizer.variables()
        variables = variables()
    return list(variables)


def _broadcast_arrays(arrays, root_rank, what):
    """Root's values of a list of numpy arrays; one message per dtype."""
    groups = {}
    for i, a in enumerate(arrays):
        groups.setdefault(np.asarray(a).dtype.str + np.asarray(a).dtype.name, []).append(i)
    out = [None] * len(arrays)
    for indices in groups.values():
        parts = [np.ascontiguousarray(arrays[i]).reshape(-1) for i in indices]
        flat, original = _wire(np.concatenate(parts) if parts else np.empty(0))
        flat = np.array(flat, copy=True)
        if flat.size:
            collectives.broadcast_array(flat, root=root_rank, what=what)
        if original is not None:
            flat = flat.view(original)
        offset = 0
        for i in indices:
            n = int(np.prod(np.shape(arrays[i]), dtype=np.int64))
            out[i] = flat[offset:offset + n].reshape(np.shape(arrays[i]))
            offset += n
    return out


def broadcast_variables(variables, root_rank=0):
    """Assign root_rank's values to ``variables`` on every rank.

    ``variables``: a list of ``tf.Variable`` / Keras variables, e.g.
    ``model.variables`` or ``optimizer.variables`` (Keras 3: a property, not a
    method). Names are not compared (Keras auto-names depend on what a process
    built before); shapes and dtypes, in order, must agree (checked). Eagerly
    the values are assigned at once; inside ``tf.function`` an op is returned.
    """
    _basics.require("eddis.broadcast_variables()")
    variables = _variable_list(variables)
    agreement.watch(variables)  # what all ranks start from must stay equal in the synchronous modes
    what = "eddis.broadcast_variables"
    signature = "\n".join(f"{i}:{tuple(v.shape)}:{tf.as_dtype(v.dtype).name}" for i, v in enumerate(variables))
    if tf.executing_eagerly():
        _basics.announce("broadcast_variables", root_rank)   # refused on every caller beside a joined rank
        collectives.check_same(signature, "broadcast_variables: the variables (shapes, dtypes, in order)",
                               "Build the same model (and optimizer) on every rank before broadcasting; "
                               "build the optimizer first (optimizer.build(model.trainable_variables)) "
                               "when broadcasting its variables.")
        values = _broadcast_arrays([v.numpy() for v in variables], root_rank, what)
        for v, value in zip(variables, values):
            v.assign(value)
        return None
    values = [_as_tensor(v) for v in variables]
    dtypes = [t.dtype for t in values]

    def bcast(*arrays):
        _basics.announce("broadcast_variables", root_rank)
        return _broadcast_arrays([np.asarray(a) for a in arrays], root_rank, what)

    new = tf.numpy_function(bcast, values, dtypes, stateful=True, name="eddis_broadcast_variables")
    return tf.group(*[v.assign(tf.reshape(n, v.shape)) for v, n in zip(variables, new)])


def broadcast_global_variables(root_rank=0):
    """Horovod's TF1 call: there is no collection of global variables in TF2 / Keras 3, so
    it cannot know what to broadcast; as Horovod does in eager mode, it says what to call."""
    raise UsageError(
        "broadcast_global_variables() needs TF1's collection of global variables, which TF2 and "
        "Keras 3 do not have: broadcast what you built instead, "
        "eddis.broadcast_variables(model.variables, root_rank=0) and "
        "eddis.broadcast_variables(optimizer.variables, root_rank=0), or in model.fit pass "
        "callbacks=[eddis.callbacks.BroadcastGlobalVariablesCallback(0)]")
