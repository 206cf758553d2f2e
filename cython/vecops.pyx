# cython: language_level=3
"""eddis.smb._vecops: Python wrappers of the SMB vector kernels (smb_vecops.h).

The SMB server calls the C kernels directly; these wrappers exist for tests,
benchmarks and the runtime's fp16/bf16 compression codecs. Every call checks
its arguments, then runs the kernel with the GIL released.

Buffers are numpy arrays or anything ``numpy.asarray`` views without a copy
(CPU torch tensors, bfloat16 ones included), C-contiguous and aligned. The dtype comes from the array:
float32, float16, float64, and bfloat16 either as an ``ml_dtypes``-style
``bfloat16`` dtype or as raw bits in a uint16 array. A ``dtype=`` argument
names it explicitly (``"bfloat16"`` on an int16/uint16 array, for instance).

Accumulation is float32, float64 when any operand is float64; conversions
round to nearest even. Operands must either be the very same buffer (same
start, same dtype) or not overlap; ``convert`` also allows converting in place
(same start, any dtypes).
"""
from cpython.mem cimport PyMem_Malloc, PyMem_Free
from libc.stdint cimport uintptr_t

cimport numpy as cnp
import errno as _errno
import numpy as np

from smb_vecops cimport *

from eddis.errors import SMBMemoryError, SMBNotImplementedError, SMBValueError

cnp.import_array()

DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3}
DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
ISA_NAMES = {SMB_ISA_GENERIC: "generic", SMB_ISA_AVX2: "avx2"}
ISA_CODES = {"auto": SMB_ISA_AUTO, "generic": SMB_ISA_GENERIC, "avx2": SMB_ISA_AVX2}
CODECS = ("float16", "bfloat16")
CHUNK = SMB_VECOPS_CHUNK


cdef int CHKERR(int rc, const char *op) except -1 nogil:
    """Raise SMBValueError for a negative kernel status (code kept)."""
    if rc < 0:
        with gil:
            raise SMBValueError(
                f"{op.decode()}: {smb_vecops_strerror(rc).decode()}", rc)
    return rc


def dtype_code(dtype):
    """The kernel dtype code of a name (``"bfloat16"``), numpy dtype or code."""
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool):
        if int(dtype) in DTYPE_NAMES:
            return int(dtype)
    else:
        name = dtype if isinstance(dtype, str) else getattr(np.dtype(dtype), "name", None)
        if name in DTYPE_CODES:
            return DTYPE_CODES[name]
    raise SMBValueError(
        f"unsupported dtype {dtype!r}: use one of {', '.join(DTYPE_CODES)} "
        "(bfloat16 as raw uint16 bits or an ml_dtypes bfloat16 array)")


cdef class _Operand:
    """One validated buffer: the array that keeps it alive, its address and dtype."""
    cdef object array
    cdef void *ptr
    cdef int dtype
    cdef size_t count
    cdef size_t nbytes
    cdef str role


cdef _Operand _operand(obj, str role, dtype=None, bint writable=False):
    cdef _Operand op = _Operand()
    if type(obj).__module__.startswith("torch") and str(getattr(obj, "dtype", "")) == "torch.bfloat16":
        import torch  # numpy has no bfloat16: view the tensor's bits instead
        obj = obj.view(torch.int16)
        dtype = "bfloat16" if dtype is None else dtype
    try:
        arr = np.asarray(obj)
    except Exception as exc:
        raise SMBValueError(f"{role}: cannot view {type(obj).__name__} as an array ({exc})")
    if dtype is not None:
        code = dtype_code(dtype)
        if arr.dtype.itemsize != smb_dtype_size(code) or arr.dtype.kind not in "fiuV":
            raise SMBValueError(
                f"{role}: array dtype {arr.dtype} does not hold {DTYPE_NAMES[code]} "
                f"({smb_dtype_size(code)}-byte elements)")
    elif arr.dtype == np.uint16:
        code = SMB_DTYPE_BFLOAT16
    else:
        try:
            code = dtype_code(arr.dtype)
        except SMBValueError:
            raise SMBValueError(
                f"{role}: unsupported dtype {arr.dtype}; use float32, float16, float64 "
                "or bfloat16 (uint16 bits), e.g. x.astype(np.float32)") from None
    if not arr.flags.c_contiguous:
        raise SMBValueError(
            f"{role}: the array is not contiguous; pass np.ascontiguousarray(...)")
    if not arr.flags.aligned:
        raise SMBValueError(
            f"{role}: the array's address is not a multiple of its element size; "
            "pass an aligned copy (np.array(x)) instead")
    if writable and not arr.flags.writeable:
        raise SMBValueError(f"{role}: the array is read-only; pass a writable array")
    op.array = arr
    op.ptr = cnp.PyArray_DATA(arr)
    op.dtype = code
    op.count = arr.size
    op.nbytes = arr.nbytes
    op.role = role
    return op


cdef int _same_length(_Operand a, _Operand b, str op) except -1:
    if a.count != b.count:
        raise SMBValueError(
            f"{op}: {b.role} has {b.count} elements but {a.role} has {a.count}; "
            "pass arrays of equal length")
    return 0


cdef int _no_partial_overlap(_Operand a, _Operand b, str op, bint any_dtype=False) except -1:
    """Identical buffers are fine (same start, same dtype; any dtype if any_dtype)."""
    cdef uintptr_t a0 = <uintptr_t>a.ptr
    cdef uintptr_t b0 = <uintptr_t>b.ptr
    if a.nbytes == 0 or b.nbytes == 0:
        return 0
    if a0 + a.nbytes <= b0 or b0 + b.nbytes <= a0:
        return 0
    if a0 == b0 and (any_dtype or a.dtype == b.dtype):
        return 0
    raise SMBValueError(
        f"{op}: {a.role} and {b.role} overlap without being the same buffer; "
        "use separate arrays (or the identical array, same start and dtype)")


def weighted_sum(dst, srcs, weights, *, dtype=None, src_dtypes=None):
    """dst[i] = sum_k weights[k] * srcs[k][i]; returns dst.

    dst may be one of srcs (same array). src_dtypes, when given, is one dtype
    per source (None entries are taken from the arrays).
    """
    cdef _Operand d = _operand(dst, "dst", dtype, writable=True)
    srcs = list(srcs)
    weights = [float(weight) for weight in weights]
    cdef size_t nsrc = len(srcs)
    if nsrc == 0:
        raise SMBValueError("weighted_sum: no source arrays; pass at least one")
    if <size_t>len(weights) != nsrc:
        raise SMBValueError(
            f"weighted_sum: {len(weights)} weights for {nsrc} sources; pass one weight per source")
    if src_dtypes is None:
        src_dtypes = [None] * len(srcs)
    elif <size_t>len(src_dtypes) != nsrc:
        raise SMBValueError(
            f"weighted_sum: {len(src_dtypes)} src_dtypes for {nsrc} sources")
    ops = [_operand(src, f"source {i}", src_dtypes[i]) for i, src in enumerate(srcs)]
    cdef _Operand s
    for s in ops:
        _same_length(d, s, "weighted_sum")
        _no_partial_overlap(d, s, "weighted_sum")

    cdef const void **ptrs = <const void **>PyMem_Malloc(nsrc * sizeof(void *))
    cdef int *codes = <int *>PyMem_Malloc(nsrc * sizeof(int))
    cdef double *wts = <double *>PyMem_Malloc(nsrc * sizeof(double))
    cdef size_t k
    cdef size_t count = d.count
    if ptrs == NULL or codes == NULL or wts == NULL:
        PyMem_Free(ptrs); PyMem_Free(codes); PyMem_Free(wts)
        raise SMBMemoryError(f"weighted_sum: out of memory for the tables of {nsrc} sources; "
                             "free memory on this node", _errno.ENOMEM)
    try:
        for k in range(nsrc):
            s = ops[k]
            ptrs[k] = s.ptr
            codes[k] = s.dtype
            wts[k] = weights[k]
        with nogil:
            CHKERR(smb_weighted_sum(d.ptr, d.dtype, ptrs, codes, wts, nsrc, count),
                   "weighted_sum")
    finally:
        PyMem_Free(ptrs); PyMem_Free(codes); PyMem_Free(wts)
    return dst


def axpy(y, x, alpha, *, y_dtype=None, x_dtype=None):
    """y[i] += alpha * x[i] (x may be y itself); returns y."""
    cdef _Operand yo = _operand(y, "y", y_dtype, writable=True)
    cdef _Operand xo = _operand(x, "x", x_dtype)
    cdef double a = float(alpha)
    _same_length(yo, xo, "axpy")
    _no_partial_overlap(yo, xo, "axpy")
    with nogil:
        CHKERR(smb_axpy(yo.ptr, yo.dtype, xo.ptr, xo.dtype, a, yo.count), "axpy")
    return y


def scale(x, alpha, *, dtype=None):
    """x[i] *= alpha; returns x."""
    cdef _Operand xo = _operand(x, "x", dtype, writable=True)
    cdef double a = float(alpha)
    with nogil:
        CHKERR(smb_scale(xo.ptr, xo.dtype, a, xo.count), "scale")
    return x


def convert(dst, src, *, dst_dtype=None, src_dtype=None):
    """dst[i] = src[i], converted to dst's dtype; returns dst.

    dst and src may start at the same address (an in-place conversion of a
    buffer big enough for the wider of the two dtypes).
    """
    cdef _Operand d = _operand(dst, "dst", dst_dtype, writable=True)
    cdef _Operand s = _operand(src, "src", src_dtype)
    _same_length(d, s, "convert")
    _no_partial_overlap(d, s, "convert", any_dtype=True)
    with nogil:
        CHKERR(smb_convert(d.ptr, d.dtype, s.ptr, s.dtype, d.count), "convert")
    return dst


copy = convert


cdef int _codec_code(codec) except -1:
    if codec not in CODECS:
        raise SMBValueError(f"unknown codec {codec!r}: use 'float16' or 'bfloat16'")
    return DTYPE_CODES[codec]


def compress(src, codec, out=None):
    """float32 array -> a new (or the given) uint16 array of float16/bfloat16 bits."""
    cdef int code = _codec_code(codec)
    cdef _Operand s = _operand(src, "src", "float32")
    if out is None:
        out = np.empty(s.array.shape, dtype=np.uint16)
    cdef _Operand d = _operand(out, "out", codec, writable=True)
    _same_length(s, d, "compress")
    _no_partial_overlap(d, s, "compress", any_dtype=True)
    with nogil:
        CHKERR(smb_compress_f32(d.ptr, code, <const float *>s.ptr, s.count), "compress")
    return out


def decompress(src, codec, out=None):
    """uint16 array of float16/bfloat16 bits -> a new (or the given) float32 array."""
    cdef int code = _codec_code(codec)
    cdef _Operand s = _operand(src, "src", codec)
    if out is None:
        out = np.empty(s.array.shape, dtype=np.float32)
    cdef _Operand d = _operand(out, "out", "float32", writable=True)
    _same_length(s, d, "decompress")
    _no_partial_overlap(d, s, "decompress", any_dtype=True)
    with nogil:
        CHKERR(smb_decompress_f32(<float *>d.ptr, s.ptr, code, s.count), "decompress")
    return out


def compress_inplace(buf, codec):
    """Compress a float32 array into its own front half; returns that half (uint16)."""
    cdef int code = _codec_code(codec)
    cdef _Operand b = _operand(buf, "buf", "float32", writable=True)
    with nogil:
        CHKERR(smb_compress_f32(b.ptr, code, <const float *>b.ptr, b.count), "compress_inplace")
    return b.array.reshape(-1).view(np.uint16)[: b.count]


def decompress_inplace(buf, codec, count=None):
    """Expand the first ``count`` (default: all) 16-bit values held at the front
    of float32 array ``buf`` into float32 in place; returns buf[:count]."""
    cdef int code = _codec_code(codec)
    cdef _Operand b = _operand(buf, "buf", "float32", writable=True)
    cdef size_t n = b.count if count is None else int(count)
    if n > b.count:
        raise SMBValueError(
            f"decompress_inplace: count {n} exceeds the buffer's {b.count} float32 elements")
    with nogil:
        CHKERR(smb_decompress_f32(<float *>b.ptr, b.ptr, code, n), "decompress_inplace")
    return b.array.reshape(-1)[:n]


def dot_norms(a, b, *, a_dtype=None, b_dtype=None):
    """(a.b, a.a, b.b) as Python floats: the dot products of Adasum's pairwise combination,
    float32 products summed in float32 per 1024-element chunk and in float64 across
    chunks (bit-identical on every kernel path). float32, float16 and bfloat16 operands;
    a may be b."""
    cdef _Operand ao = _operand(a, "a", a_dtype)
    cdef _Operand bo = _operand(b, "b", b_dtype)
    cdef double out[3]
    _same_length(ao, bo, "dot_norms")
    with nogil:
        CHKERR(smb_dot_norms(ao.ptr, ao.dtype, bo.ptr, bo.dtype, ao.count, out), "dot_norms")
    return out[0], out[1], out[2]


def available_isas():
    """The kernel paths this CPU can run, best last: ['generic'] or ['generic', 'avx2']."""
    return ["generic", "avx2"] if smb_vecops_cpu_has_avx2() else ["generic"]


def isa():
    """The path in use: 'avx2' (AVX2 loops, F16C float16) or 'generic'."""
    return ISA_NAMES[smb_vecops_isa()]


def set_isa(name):
    """Force the kernel path of this module ('generic', 'avx2' or 'auto').

    Only this extension's kernels are affected (the server has its own copy);
    tests use it to check both paths give identical bits.
    """
    if name not in ISA_CODES:
        raise SMBValueError(f"unknown isa {name!r}: use 'auto', 'generic' or 'avx2'")
    if smb_vecops_set_isa(ISA_CODES[name]) < 0:
        raise SMBNotImplementedError(
            f"this CPU cannot run the {name!r} path (needs AVX2 and F16C); use 'generic'")
    return isa()
