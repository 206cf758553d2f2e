"""``Compression.none``, ``Compression.fp16``, ``Compression.bf16`` (Horovod's names).

Pass one to ``DistributedGradientTape(tape, compression=Compression.fp16)`` or
``DistributedOptimizer(optimizer, compression=...)``: gradients then travel as
fp16 (or bf16) and are accumulated in fp32 on the reducing side (the codecs of
:mod:`eddis.core.layout.compression`). The ``compress``/``decompress`` static methods
work on tensors like Horovod's.
"""
import tensorflow as tf

from ..core.layout import compression as _codecs
from ..core.layout.compression import Compressor, NoneCompressor, codec_of  # noqa: F401


class FP16Compressor(Compressor):
    codec = _codecs.FP16
    wire = tf.float16

    @classmethod
    def compress(cls, tensor):
        if tensor.dtype.is_floating and tensor.dtype != cls.wire:
            return tf.cast(tensor, cls.wire), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class BF16Compressor(FP16Compressor):
    codec = _codecs.BF16
    wire = tf.bfloat16


class Compression:
    """Gradient wire formats."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

