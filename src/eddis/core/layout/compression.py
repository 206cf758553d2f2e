"""Wire formats of gradients: ``NONE`` (exact), ``FP16`` and ``BF16``.

A :class:`Codec` turns a float32 numpy array into its wire array and back.
``NONE`` is exact for every buffer dtype: over a float64 plan it is ``NONE64``
(float64 on the wire, see :meth:`Codec.for_dtype`); the 16-bit codecs refuse a
float64 plan rather than round its gradients.
bfloat16 has no numpy dtype: its wire arrays are ``uint16`` holding the bf16
bit patterns (the upper half of the float32, rounded to nearest even), which
is also how SMB pools of dtype ``"bfloat16"`` take and give them.

The fast GIL-free converters of ``eddis.smb._vecops`` are used when that
extension is built; the numpy fallback gives bit-identical results.
"""
import numpy as np

from ...errors import ConfigError

try:  # C converters from the SMB kernels (optional)
    from ...smb import _vecops
except ImportError:  # pragma: no cover - depends on the build
    _vecops = None

# dtype names of eddis.smb._vecops (bfloat16 travels as uint16 bit patterns)
_VEC_F32, _VEC_F16, _VEC_BF16 = "float32", "float16", "bfloat16"


def _vecops_convert(src, dst, src_dtype, dst_dtype):
    """Convert with the C kernels (GIL released); False when they are not built."""
    if _vecops is None:
        return False
    _vecops.convert(dst, src, dst_dtype=dst_dtype, src_dtype=src_dtype)
    return True


def float32_to_bfloat16_bits(src, out=None):
    """Round float32 values to bfloat16 (nearest even); return their uint16 bit patterns."""
    src = np.ascontiguousarray(src, dtype=np.float32)
    if out is None:
        out = np.empty(src.shape, dtype=np.uint16)
    if _vecops_convert(src, out, _VEC_F32, _VEC_BF16):
        return out
    bits = src.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    np.right_shift(rounded, np.uint32(16), out=rounded)
    out[...] = rounded
    nan = np.isnan(src)
    if nan.any():  # rounding must not turn a NaN into an infinity
        out[nan] = 0x7FC0
    return out


def bfloat16_bits_to_float32(bits, out=None):
    """Widen bfloat16 bit patterns (uint16) to float32 (exact)."""
    bits = np.ascontiguousarray(bits, dtype=np.uint16)
    if out is None:
        out = np.empty(bits.shape, dtype=np.float32)
    if _vecops_convert(bits, out, _VEC_BF16, _VEC_F32):
        return out
    wide = out.view(np.uint32)
    wide[...] = bits
    np.left_shift(wide, np.uint32(16), out=wide)
    return out


class Codec:
    """One wire format. ``name``: none/fp16/bf16; ``wire_dtype``: numpy dtype on the
    wire; ``smb_dtype``: the SMB pool dtype name; ``itemsize``: bytes per element."""

    def __init__(self, name, wire_dtype, smb_dtype):
        self.name = name
        self.wire_dtype = np.dtype(wire_dtype)
        self.smb_dtype = smb_dtype
        self.itemsize = self.wire_dtype.itemsize

    @property
    def is_identity(self):
        return self.name == "none"

    def empty(self, count):
        """A wire buffer for ``count`` elements."""
        return np.empty(count, dtype=self.wire_dtype)

    def compress(self, src, out=None):
        """float32 ``src`` -> wire array (``src`` itself for the identity codec)."""
        if self.name == "none":
            if out is None:
                return src
            out[...] = src
            return out
        if self.name == "fp16":
            if out is None:
                out = np.empty(src.shape, dtype=np.float16)
            if not _vecops_convert(src, out, _VEC_F32, _VEC_F16):
                np.copyto(out, src, casting="same_kind")
            return out
        return float32_to_bfloat16_bits(src, out)

    def decompress(self, wire, out):
        """wire array -> float32 ``out`` (in place); returns ``out``."""
        if self.name == "none":
            if wire is not out:
                out[...] = wire
            return out
        if self.name == "fp16":
            if not _vecops_convert(wire, out, _VEC_F16, _VEC_F32):
                np.copyto(out, wire)
            return out
        return bfloat16_bits_to_float32(wire, out)

    def for_dtype(self, dtype):
        """This codec over a buffer of ``dtype`` (a plan's): ``none`` keeps float64 in
        float64; fp16/bf16 take float32 buffers only (ConfigError otherwise)."""
        if np.dtype(dtype) == np.float32:
            return self
        if self.is_identity:
            return NONE64
        raise ConfigError(
            f"compression {self.name} would round this model's {np.dtype(dtype).name} gradients to 16 "
            f"bits on the wire: use Compression.none for a {np.dtype(dtype).name} model (it reduces in "
            f"{np.dtype(dtype).name}), or train in float32 (model.float()) to compress")

    def __repr__(self):
        return f"Codec({self.name!r})"


NONE = Codec("none", np.float32, "float32")
NONE64 = Codec("none", np.float64, "float64")   # NONE over a float64 plan
FP16 = Codec("fp16", np.float16, "float16")
BF16 = Codec("bf16", np.uint16, "bfloat16")
CODECS = {"none": NONE, "fp16": FP16, "bf16": BF16}


def get_codec(name):
    """The codec for ``none``/``fp16``/``bf16`` (a Codec passes through)."""
    if isinstance(name, Codec):
        return name
    key = str(name).lower()
    aliases = {"fp32": "none", "float32": "none", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}
    key = aliases.get(key, key)
    try:
        return CODECS[key]
    except KeyError:
        raise ConfigError(f"unknown compression {name!r}; use one of none, fp16, bf16") from None


class Compressor:
    """Base of the adapters' ``Compression.*`` members (Horovod's compressor shape).

    ``codec`` names the core codec the reducer uses on the wire; the adapters'
    subclasses add ``compress``/``decompress`` on their framework's tensors.
    """
    codec = NONE

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class NoneCompressor(Compressor):
    codec = NONE


def codec_of(compression):
    """The core codec for a Compression member, a codec name, or None (EDDIS_COMPRESSION)."""
    from ... import settings

    if compression is None:
        return get_codec(settings.get("EDDIS_COMPRESSION"))
    if isinstance(compression, Compressor) or (isinstance(compression, type)
                                                and issubclass(compression, Compressor)):
        return compression.codec
    return get_codec(compression)
