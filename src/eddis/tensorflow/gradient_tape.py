"""``DistributedGradientTape``: ``tape.gradient()`` returns gradients averaged over all ranks.

    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = eddis.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)   # reduced over the ranks
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

The reduction goes through an :mod:`eddis.core` reducer (mode ``sync`` through
SMB, or ``allreduce`` through MPI), one per list of sources, shared by every
tape of the process, so a new tape per step costs nothing.
"""
import tensorflow as tf

from .. import settings
from ..core.basics import basics as _basics
from ..core.comm import runtime
from ..core.comm.ops import reject_unsupported_horovod_options
from ..errors import ConfigError
from . import agreement
from .compression import codec_of
from .ops import Average
from .reduction import ReducerCache

_reducers = ReducerCache()


class _TapeConfig:
    """Settings of one wrapped tape (its one attribute, ``_eddis``): ``mode``, ``codec``,
    ``op``, ``bucket_bytes`` and ``sample_count`` as ``DistributedGradientTape`` took them;
    ``reducer``: the shared reducer of the last ``gradient()`` call (None before one)."""

    def __init__(self, mode, codec, op, bucket_bytes, sample_count):
        self.mode = mode
        self.codec = codec
        self.op = op
        self.bucket_bytes = bucket_bytes
        self.sample_count = sample_count
        self.reducer = None


class _DistributedGradientTape:
    """Methods mixed into a subclass of the user's tape class."""

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super(_DistributedGradientTape, self).gradient(
            target, sources, output_gradients=output_gradients,
            unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        cfg = self._eddis
        reducer = _reducers.get(flat_sources, cfg.mode, cfg.codec, cfg.op, cfg.bucket_bytes,
                                "DistributedGradientTape")
        cfg.reducer = reducer
        agreement.watch(s for s in flat_sources if hasattr(s, "assign"))
        reduced = reducer.reduce(flat_grads, sample_count=cfg.sample_count)
        if tf.executing_eagerly():  # a traced step has no Python left to count it in
            agreement.tick()
        return tf.nest.pack_sequence_as(grads, reduced)

    @property
    def reducer(self):
        """The core reducer of the last ``gradient()`` call (statistics, events)."""
        r = self._eddis.reducer
        return None if r is None else r.reducer


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=None,
                            sparse_as_dense=True, op=Average, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=None, mode=None,
                            bucket_bytes=None, sample_count=None):
    """Wrap ``gradtape`` so that ``gradient()`` averages gradients over all ranks.

    Horovod's signature; EDDIS adds ``mode`` ("sync" through SMB, "allreduce"
    through MPI; default EDDIS_MODE), ``bucket_bytes`` (default
    EDDIS_BUCKET_BYTES) and ``sample_count``: this rank's weight in the average
    (a number or a scalar tensor such as ``tf.shape(x)[0]``), so ranks with
    unequal shares of the global batch still get the gradient of the whole
    batch. ``compression`` defaults to EDDIS_COMPRESSION. Sparse gradients are
    always made dense. ``device_dense``/``device_sparse`` are ignored (the
    reduction runs on the host).
    """
    runtime.require("eddis.DistributedGradientTape()")
    if not isinstance(gradtape, tf.GradientTape):
        raise ConfigError(f"DistributedGradientTape needs a tf.GradientTape, got {type(gradtape).__name__}")
    if isinstance(gradtape, _DistributedGradientTape):
        raise ConfigError("this tape is already a DistributedGradientTape; wrap the plain tape once")
    op = _basics.gradient_op(op, "DistributedGradientTape", mode=mode, sample_count=sample_count)
    reject_unsupported_horovod_options(gradient_predivide_factor, groups, num_groups, process_set)
    mode = settings.get("EDDIS_MODE") if mode is None else str(mode).lower()
    if mode in ("easgd", "hybrid"):
        raise ConfigError(f"mode {mode!r} moves the parameters after the optimizer's update, which a "
                          "tape cannot do: in a custom loop wrap the optimizer instead, "
                          "optimizer = eddis.DistributedOptimizer(opt, mode=...), and apply the plain "
                          "tape's gradients with optimizer.apply_gradients(...)")
    cls = type(gradtape.__class__.__name__, (_DistributedGradientTape, gradtape.__class__),
               {"__module__": gradtape.__class__.__module__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(gradtape.__dict__)
    wrapped._eddis = _TapeConfig(
        mode, codec_of(compression), op.name,
        settings.get("EDDIS_BUCKET_BYTES") if bucket_bytes is None else int(bucket_bytes), sample_count)
    return wrapped
