"""``Compression.none``, ``Compression.fp16``, ``Compression.bf16`` (Horovod's names).

Pass one to ``DistributedOptimizer(..., compression=Compression.fp16)``: gradients
then travel as fp16 (or bf16) and are accumulated in fp32 on the reducing side.
The ``compress``/``decompress`` static methods work on tensors like Horovod's.
"""
import torch

from ..core.layout import compression as _codecs
from ..core.layout.compression import Compressor, NoneCompressor, codec_of  # noqa: F401


class FP16Compressor(Compressor):
    codec = _codecs.FP16
    wire = torch.float16

    @classmethod
    def compress(cls, tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire:
            return tensor.to(cls.wire), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class BF16Compressor(FP16Compressor):
    codec = _codecs.BF16
    wire = torch.bfloat16


class Compression:
    """Gradient wire formats for :class:`DistributedOptimizer`."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

