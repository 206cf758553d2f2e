"""SMB vector kernels (eddis.smb._vecops, cython/smb_vecops.h) against numpy.

Every kernel in every dtype combination is checked bit for bit: float16 against
numpy's own float16, bfloat16 against an independent round-to-nearest-even
reference written here (frexp + np.round, which rounds half to even), and the
arithmetic against numpy doing the same operations in the same accumulation
type. Each check runs on the generic path (software float16) and, where the CPU
has them, on the AVX2 + F16C path.
"""
import itertools
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from eddis.errors import EddisError, SMBValueError

from eddis.smb import _vecops as vecops  # required: not built is a failure, never a skip

# the inputs hold inf and NaN on purpose; numpy's references warn about them
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

DTYPES = ["float32", "float16", "bfloat16", "float64"]
ISAS = vecops.available_isas()
HEADER_DIR = Path(__file__).resolve().parent.parent / "cython"

# (significand bits, smallest frexp exponent of a normal number, largest finite)
FORMATS = {
    "float16": (11, -13, 65504.0),
    "bfloat16": (8, -125, float.fromhex("0x1.fep127")),
    "float32": (24, -125, float.fromhex("0x1.fffffep127")),
}


@pytest.fixture(params=ISAS)
def isa(request):
    vecops.set_isa(request.param)
    yield request.param
    vecops.set_isa("auto")


# --------------------------------------------------------------------------
# numpy references
# --------------------------------------------------------------------------

def round_to_format(x, fmt):
    """float64 values rounded to nearest even in fmt, as float64 (inf on overflow)."""
    bits, emin, largest = FORMATS[fmt]
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    xf = np.where(finite, x, 0.0)
    _, exp = np.frexp(xf)
    quantum = np.ldexp(1.0, np.maximum(exp, emin) - bits)
    rounded = np.round(xf / quantum) * quantum  # exact: scaling by powers of two
    rounded = np.where(np.abs(rounded) > largest, np.copysign(np.inf, xf), rounded)
    return np.where(finite, rounded, x)


def bf16_bits_of_values(values):
    """bfloat16 bits of float64 values already representable in bfloat16."""
    bits = (np.asarray(values, np.float64).astype(np.float32).view(np.uint32) >> 16)
    return bits.astype(np.uint16)


def bf16_values(bits):
    """float64 values of bfloat16 bits."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def to_storage(values, dtype):
    """float64 values -> an array of dtype (bfloat16 as uint16 bits), rounding to nearest even."""
    values = np.asarray(values, np.float64)
    if dtype == "bfloat16":
        rounded = round_to_format(values, "bfloat16")
        bits = bf16_bits_of_values(np.where(np.isnan(rounded), 0.0, rounded))
        return np.where(np.isnan(rounded), np.uint16(0x7fc0), bits).astype(np.uint16)
    return values.astype(dtype)


def as_values(arr, dtype):
    """The float64 values stored in arr (bfloat16 given as uint16 bits)."""
    return bf16_values(arr) if dtype == "bfloat16" else np.asarray(arr).astype(np.float64)


def expected_storage(values, dtype):
    """What a kernel writing float64-exact values into dtype must store, as float64 values."""
    if dtype == "float64":
        return np.asarray(values, np.float64)
    return round_to_format(values, dtype)


def assert_stored(got, values, dtype):
    """got (dtype) holds exactly the correctly rounded values; NaN where values are NaN."""
    want = expected_storage(values, dtype)
    have = as_values(got, dtype)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(have), nan, err_msg=f"NaN positions differ ({dtype})")
    bad = np.flatnonzero((have != want) & ~nan)
    assert bad.size == 0, (
        f"{bad.size} of {have.size} {dtype} values differ, first at {bad[:5]}: "
        f"got {have[bad[:5]]}, want {want[bad[:5]]}")
    zeros = (want == 0) & ~nan
    np.testing.assert_array_equal(np.signbit(have[zeros]), np.signbit(want[zeros]),
                                  err_msg="sign of zero lost")


def accumulation_type(*dtypes):
    return np.float64 if "float64" in dtypes else np.float32


def sample_values(n, rng, special=True):
    """Normal values over a wide range, float16-subnormal-sized ones, and specials."""
    values = rng.standard_normal(n) * np.exp2(rng.integers(-30, 20, n))
    values[::7] = rng.standard_normal(len(values[::7])) * 2.0 ** -20  # float16 subnormals
    values[::11] = rng.standard_normal(len(values[::11]))
    if special and n >= 16:
        values[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, -1e-8]
    return values


# --------------------------------------------------------------------------
# the reference itself
# --------------------------------------------------------------------------

def test_reference_rounding_matches_numpy_float16_and_float32():
    rng = np.random.default_rng(0)
    x = np.concatenate([sample_values(20000, rng), rng.standard_normal(2000) * 1e5])
    np.testing.assert_array_equal(round_to_format(x, "float16"),
                                  x.astype(np.float16).astype(np.float64))
    np.testing.assert_array_equal(round_to_format(x, "float32"),
                                  x.astype(np.float32).astype(np.float64))


# --------------------------------------------------------------------------
# conversions (copy/convert and the compression codecs)
# --------------------------------------------------------------------------

def float16_tie_inputs():
    """float32 values exactly halfway between float16 neighbours, and one float32 ulp either side."""
    h = np.arange(0, 0x7c00, dtype=np.uint32)  # every finite non-negative float16
    lo = h.astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (h + 1).astype(np.uint16).view(np.float16).astype(np.float64)
    mid = ((lo + hi) / 2).astype(np.float32)
    ties = np.concatenate([mid, np.nextafter(mid, np.float32(np.inf)),
                           np.nextafter(mid, np.float32(0))])
    return np.concatenate([ties, -ties])


def quiet_nan32(rng, n):
    bits = rng.integers(0, 1 << 22, n, dtype=np.uint32) | np.uint32(0x7fc00000)
    bits[::2] |= np.uint32(0x80000000)
    return bits.view(np.float32)


@pytest.mark.timeout(60)
def test_float32_to_float16_bit_exact_with_numpy(isa):
    rng = np.random.default_rng(1)
    random_bits = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    not_snan = ~(((random_bits & 0x7fc00000) == 0x7f800000) & ((random_bits & 0x003fffff) != 0))
    x = np.concatenate([random_bits[not_snan].view(np.float32), float16_tie_inputs(),
                        quiet_nan32(rng, 64), np.float32([0, -0.0, np.inf, -np.inf, 65504,
                                                          65519.996, 65520, 2.0 ** -25,
                                                          2.0 ** -25 + 2.0 ** -40, 2.0 ** -26])])
    got = vecops.compress(x, "float16")
    np.testing.assert_array_equal(got, x.astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(vecops.convert(np.empty(x.size, np.float16), x).view(np.uint16),
                                  got)


@pytest.mark.timeout(60)
def test_float16_to_float32_all_65536_patterns(isa):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    signalling = ((bits & 0x7e00) == 0x7c00) & ((bits & 0x3ff) != 0)
    got = vecops.decompress(bits, "float16")
    want = bits.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32)[~signalling], want.view(np.uint32)[~signalling])
    # a signalling NaN comes back as the quiet NaN with the same sign and payload (as F16C does)
    np.testing.assert_array_equal(got.view(np.uint32)[signalling],
                                  want.view(np.uint32)[signalling] | np.uint32(0x00400000))


@pytest.mark.timeout(60)
def test_float32_to_bfloat16_round_to_nearest_even(isa):
    rng = np.random.default_rng(2)
    random_bits = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    upper = rng.integers(0, 1 << 16, 4096, dtype=np.uint32) << np.uint32(16)
    ties = np.concatenate([upper | 0x8000, upper | 0x7fff, upper | 0x8001, upper])
    bits = np.concatenate([random_bits, ties,
                           np.float32([0, -0.0, np.inf, -np.inf, 3.3961776e38, 3.4e38,
                                       1e-40, -1e-45]).view(np.uint32)])
    x = bits.view(np.float32)
    got = vecops.compress(x, "bfloat16")
    nan = np.isnan(x)
    want = bf16_bits_of_values(np.where(nan, 0, round_to_format(x, "bfloat16")))
    np.testing.assert_array_equal(got[~nan], want[~nan])
    # NaN: sign and top payload kept, quiet bit set
    np.testing.assert_array_equal(got[nan], ((bits[nan] >> 16) | 0x40).astype(np.uint16))


@pytest.mark.timeout(60)
def test_bfloat16_to_float32_all_65536_patterns(isa):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = vecops.decompress(bits, "bfloat16").view(np.uint32)
    want = bits.astype(np.uint32) << 16
    nan = ((want & 0x7fffffff) > 0x7f800000)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    np.testing.assert_array_equal(got[nan], want[nan] | np.uint32(0x00400000))


def float64_hard_cases(fmt):
    """float64 values at and a few float64 ulps around midpoints of fmt: where a
    float64 -> float32 -> fmt double rounding would go wrong."""
    if fmt == "float16":
        grid = np.arange(0, 0x7c00, 17, dtype=np.uint32).astype(np.uint16).view(np.float16)
        lo = grid.astype(np.float64)
        hi = (grid.view(np.uint16) + 1).view(np.float16).astype(np.float64)
    else:
        upper = np.arange(0, 0x7f80, 17, dtype=np.uint32)
        lo = bf16_values(upper.astype(np.uint16))
        hi = bf16_values((upper + 1).astype(np.uint16))
    mid = (lo + hi) / 2
    up = mid * (1 + 2.0 ** -40)
    down = mid * (1 - 2.0 ** -40)
    x = np.concatenate([mid, up, down, np.nextafter(mid, np.inf), np.nextafter(mid, 0)])
    return np.concatenate([x, -x])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dst", ["float16", "bfloat16", "float32"])
def test_float64_narrowing_is_a_single_rounding(isa, dst):
    rng = np.random.default_rng(3)
    x = np.concatenate([sample_values(50000, rng), rng.standard_normal(1000) * 1e300,
                        rng.standard_normal(1000) * 1e-300, [np.nan, -np.nan, 1e39, -1e39],
                        float64_hard_cases(dst if dst != "float32" else "bfloat16")])
    out = vecops.convert(np.empty(x.size, np.uint16 if dst == "bfloat16" else dst), x)
    assert_stored(out, x, dst)
    if dst == "float16":
        finite = ~np.isnan(x)
        np.testing.assert_array_equal(out.view(np.uint16)[finite],
                                      x[finite].astype(np.float16).view(np.uint16))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("src,dst", list(itertools.product(DTYPES, DTYPES)))
def test_convert_every_pair(isa, src, dst):
    rng = np.random.default_rng(4)
    values = as_values(to_storage(sample_values(3001, rng), src), src)
    x = to_storage(values, src)
    out = np.full(x.size, 7, dtype=np.uint16 if dst == "bfloat16" else dst)
    assert vecops.convert(out, x) is out
    assert_stored(out, values, dst)
    assert vecops.copy is vecops.convert


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [0, 1, 7, 1024, 1025, 5000, 3 * 1024])
def test_codecs_in_place_round_trip(isa, codec, n):
    rng = np.random.default_rng(5)
    x = sample_values(n, rng).astype(np.float32)
    buf = x.copy()
    halves = vecops.compress_inplace(buf, codec)
    assert halves.dtype == np.uint16 and halves.size == n
    assert halves.size == 0 or np.shares_memory(halves, buf)
    np.testing.assert_array_equal(halves, vecops.compress(x, codec))
    back = vecops.decompress_inplace(buf, codec)
    assert np.shares_memory(back, buf) or n == 0
    out_of_place = vecops.decompress(vecops.compress(x, codec), codec)
    np.testing.assert_array_equal(back.view(np.uint32), out_of_place.view(np.uint32))
    # the round trip is the rounding to the codec's format
    assert_stored(np.asarray(back, np.float64), round_to_format(x, codec), "float64")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("src,dst", [("float16", "float64"), ("bfloat16", "float64"),
                                     ("float32", "float64"), ("float64", "float16"),
                                     ("float64", "bfloat16"), ("float64", "float32"),
                                     ("float16", "bfloat16"), ("bfloat16", "float16")])
def test_convert_in_place_any_width(isa, src, dst):
    rng = np.random.default_rng(6)
    n = 4100
    values = as_values(to_storage(sample_values(n, rng), src), src)
    raw = np.zeros(n * 8, dtype=np.uint8)
    src_view = raw.view(np.uint16 if src == "bfloat16" else src)[:n]
    src_view[:] = to_storage(values, src)
    dst_view = raw.view(np.uint16 if dst == "bfloat16" else dst)[:n]
    vecops.convert(dst_view, src_view)
    assert_stored(dst_view, values, dst)


@pytest.mark.timeout(60)
def test_decompress_inplace_partial_count():
    x = np.arange(10, dtype=np.float32)
    buf = np.zeros(10, np.float32)
    buf.view(np.uint16)[:4] = vecops.compress(x[:4], "bfloat16")
    out = vecops.decompress_inplace(buf, "bfloat16", count=4)
    np.testing.assert_array_equal(out, x[:4])
    with pytest.raises(SMBValueError, match="exceeds"):
        vecops.decompress_inplace(buf, "bfloat16", count=11)


# --------------------------------------------------------------------------
# arithmetic
# --------------------------------------------------------------------------

def weighted_sum_ref(srcs, dtypes, weights, dst_dtype):
    acc_t = accumulation_type(dst_dtype, *dtypes)
    acc = acc_t(weights[0]) * as_values(srcs[0], dtypes[0]).astype(acc_t)
    for s, dt, w in zip(srcs[1:], dtypes[1:], weights[1:]):
        acc += acc_t(w) * as_values(s, dt).astype(acc_t)
    return acc.astype(np.float64)


def arith_values(n, rng, specials=True):
    """Values whose products and sums stay finite in float16, plus a few inf/NaN."""
    values = rng.standard_normal(n) * np.exp2(rng.integers(-12, 6, n))
    values[::13] = rng.standard_normal(len(values[::13])) * 2.0 ** -20
    if specials and n >= 8:
        values[:6] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-7]
    return values


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dst", DTYPES)
@pytest.mark.parametrize("s0,s1", list(itertools.product(DTYPES, DTYPES)))
def test_weighted_sum_every_combination(isa, dst, s0, s1):
    rng = np.random.default_rng(7)
    n = 2 * 1024 + 37
    srcs = [to_storage(arith_values(n, rng), s0), to_storage(arith_values(n, rng), s1)]
    weights = [0.3, -1.7]
    out = np.zeros(n, dtype=np.uint16 if dst == "bfloat16" else dst)
    assert vecops.weighted_sum(out, srcs, weights) is out
    assert_stored(out, weighted_sum_ref(srcs, [s0, s1], weights, dst), dst)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dst", DTYPES)
def test_weighted_sum_many_mixed_slots(isa, dst):
    rng = np.random.default_rng(8)
    n = 5000
    dtypes = ["float16", "bfloat16", "float32", "float16", "bfloat16", "float32", "float32"]
    srcs = [to_storage(arith_values(n, rng, specials=False), dt) for dt in dtypes]
    weights = list(rng.standard_normal(len(dtypes)))
    out = np.zeros(n, dtype=np.uint16 if dst == "bfloat16" else dst)
    vecops.weighted_sum(out, srcs, weights)
    assert_stored(out, weighted_sum_ref(srcs, dtypes, weights, dst), dst)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES)
def test_weighted_sum_into_one_of_its_sources(isa, dtype):
    """the elastic-averaging shape: center = 0.5*center + 0.5*worker, in place"""
    rng = np.random.default_rng(9)
    n = 3000
    center = to_storage(arith_values(n, rng), dtype)
    worker = to_storage(arith_values(n, rng), dtype)
    want = weighted_sum_ref([center, worker], [dtype, dtype], [0.5, 0.5], dtype)
    vecops.weighted_sum(center, [center, worker], [0.5, 0.5])
    assert_stored(center, want, dtype)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("y_dtype,x_dtype", list(itertools.product(DTYPES, DTYPES)))
def test_axpy_every_combination(isa, y_dtype, x_dtype):
    rng = np.random.default_rng(10)
    n = 3 * 1024 + 5
    y = to_storage(arith_values(n, rng), y_dtype)
    x = to_storage(arith_values(n, rng), x_dtype)
    alpha = -0.37
    acc_t = accumulation_type(y_dtype, x_dtype)
    want = (as_values(y, y_dtype).astype(acc_t)
            + acc_t(alpha) * as_values(x, x_dtype).astype(acc_t)).astype(np.float64)
    assert vecops.axpy(y, x, alpha) is y
    assert_stored(y, want, y_dtype)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES)
def test_axpy_with_itself(isa, dtype):
    rng = np.random.default_rng(11)
    y = to_storage(arith_values(2500, rng), dtype)
    acc_t = accumulation_type(dtype)
    v = as_values(y, dtype).astype(acc_t)
    want = (v + acc_t(2.0) * v).astype(np.float64)
    vecops.axpy(y, y, 2.0)
    assert_stored(y, want, dtype)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alpha", [0.125, -3.3, 0.0, 70000.0])
def test_scale(isa, dtype, alpha):
    rng = np.random.default_rng(12)
    x = to_storage(arith_values(4097, rng), dtype)
    acc_t = accumulation_type(dtype)
    want = (acc_t(alpha) * as_values(x, dtype).astype(acc_t)).astype(np.float64)
    assert vecops.scale(x, alpha) is x
    assert_stored(x, want, dtype)


# --------------------------------------------------------------------------
# shapes: empty, unaligned starts, large counts, threads
# --------------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", DTYPES)
def test_count_zero_touches_nothing(dtype):
    empty = np.empty(0, np.uint16 if dtype == "bfloat16" else dtype)
    assert vecops.weighted_sum(empty, [empty, empty], [1.0, 2.0]) is empty
    assert vecops.axpy(empty, empty, 2.0) is empty
    assert vecops.scale(empty, 2.0) is empty
    assert vecops.convert(empty, np.empty(0, np.float32)) is empty
    assert vecops.compress(np.empty(0, np.float32), "float16").size == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shift", [1, 3])
def test_unaligned_starts(isa, dtype, shift):
    """Views that start a few elements into a buffer (not vector-aligned), with
    different shifts for destination and sources."""
    rng = np.random.default_rng(13)
    n = 2 * 1024 + 3
    storage = np.uint16 if dtype == "bfloat16" else dtype
    a = np.zeros(n + 8, storage)[shift:shift + n]
    b = np.zeros(n + 8, storage)[shift + 1:shift + 1 + n]
    a[:] = to_storage(arith_values(n, rng), dtype)
    b[:] = to_storage(arith_values(n, rng), dtype)
    h = np.zeros(n + 8, np.float16)[2:2 + n]
    h[:] = arith_values(n, rng).astype(np.float16)
    out = np.zeros(n + 8, storage)[shift + 2:shift + 2 + n]
    vecops.weighted_sum(out, [a, b, h], [1.5, -0.25, 2.0])
    assert_stored(out, weighted_sum_ref([a, b, h], [dtype, dtype, "float16"],
                                        [1.5, -0.25, 2.0], dtype), dtype)
    want = (as_values(a, dtype).astype(accumulation_type(dtype))
            + accumulation_type(dtype)(0.5) * as_values(h, "float16").astype(accumulation_type(dtype)))
    vecops.axpy(a, h, 0.5)
    assert_stored(a, want.astype(np.float64), dtype)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dst,srcs", [("float32", ["float32"] * 4),
                                      ("bfloat16", ["bfloat16", "float16", "float32", "bfloat16"]),
                                      ("float16", ["float16"] * 2)])
def test_large_counts(dst, srcs):
    rng = np.random.default_rng(14)
    n = (1 << 22) + 7  # 4 Mi elements: thousands of chunks and a ragged tail
    arrays = [to_storage(rng.standard_normal(n), dt) for dt in srcs]
    weights = [0.25] * len(srcs)
    out = np.empty(n, np.uint16 if dst == "bfloat16" else dst)
    vecops.weighted_sum(out, arrays, weights)
    assert_stored(out, weighted_sum_ref(arrays, srcs, weights, dst), dst)


@pytest.mark.timeout(60)
def test_kernels_from_many_threads_at_once():
    """the GIL is released; concurrent calls on separate buffers stay correct"""
    rng = np.random.default_rng(15)
    n = 1 << 18
    jobs = [(to_storage(rng.standard_normal(n), "bfloat16"), to_storage(rng.standard_normal(n), "float16"))
            for _ in range(4)]
    wants = [weighted_sum_ref([b, h], ["bfloat16", "float16"], [0.5, 0.5], "float32")
             for b, h in jobs]
    outs = [np.empty(n, np.float32) for _ in jobs]
    errors = []

    def work(i):
        try:
            for _ in range(5):
                vecops.weighted_sum(outs[i], list(jobs[i]), [0.5, 0.5])
        except Exception as exc:  # reported below, in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert not errors and not any(t.is_alive() for t in threads)
    for out, want in zip(outs, wants):
        assert_stored(out, want, "float32")


@pytest.mark.timeout(60)
def test_both_paths_agree_bit_for_bit():
    if len(ISAS) < 2:
        pytest.skip("this CPU has no AVX2/F16C, only the generic path runs")
    rng = np.random.default_rng(16)
    x = rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32).view(np.float32)
    h = rng.integers(0, 1 << 16, 1 << 18, dtype=np.uint32).astype(np.uint16)
    results = []
    for name in ISAS:
        vecops.set_isa(name)
        assert vecops.isa() == name
        results.append((vecops.compress(x, "float16"), vecops.decompress(h, "float16").view(np.uint32)))
    vecops.set_isa("auto")
    for a, b in zip(results[0], results[1]):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_bad_arguments_raise_clear_errors():
    f32 = np.zeros(10, np.float32)
    with pytest.raises(SMBValueError, match="unsupported dtype int32"):
        vecops.scale(np.zeros(4, np.int32), 2.0)
    with pytest.raises(SMBValueError, match="has 9 elements but dst has 10"):
        vecops.weighted_sum(f32, [np.zeros(9, np.float32)], [1.0])
    with pytest.raises(SMBValueError, match="2 weights for 1 sources"):
        vecops.weighted_sum(f32, [f32], [1.0, 2.0])
    with pytest.raises(SMBValueError, match="at least one"):
        vecops.weighted_sum(f32, [], [])
    with pytest.raises(SMBValueError, match="not contiguous"):
        vecops.scale(np.zeros(20, np.float32)[::2], 2.0)
    readonly = np.zeros(10, np.float32)
    readonly.flags.writeable = False
    with pytest.raises(SMBValueError, match="read-only"):
        vecops.axpy(readonly, f32, 1.0)
    with pytest.raises(SMBValueError, match="overlap"):
        buf = np.zeros(20, np.float32)
        vecops.axpy(buf[:10], buf[5:15], 1.0)
    with pytest.raises(SMBValueError, match="overlap"):
        raw = np.zeros(40, np.float32)
        vecops.axpy(raw[:10], raw.view(np.float16)[:10], 1.0)
    with pytest.raises(SMBValueError, match="not a multiple of its element size"):
        odd = np.frombuffer(bytearray(41), dtype=np.float32, count=10, offset=1)
        vecops.convert(np.zeros(10, np.float64), odd)
    with pytest.raises(SMBValueError, match="does not hold bfloat16"):
        vecops.scale(f32, 2.0, dtype="bfloat16")
    with pytest.raises(SMBValueError, match="unknown codec"):
        vecops.compress(f32, "int8")
    with pytest.raises(SMBValueError, match="unsupported dtype"):
        vecops.dtype_code(7)
    with pytest.raises(SMBValueError, match="unknown isa"):
        vecops.set_isa("avx9000")
    assert vecops.dtype_code("bfloat16") == 2 and vecops.dtype_code(np.float16) == 1
    # the family: an EddisError that is also a ValueError
    with pytest.raises(ValueError):
        vecops.scale(np.zeros(4, np.int8), 1.0)
    with pytest.raises(EddisError):
        vecops.scale(np.zeros(4, np.int8), 1.0)


@pytest.mark.timeout(30)
def test_explicit_bfloat16_dtype_on_int16_bits():
    x = np.array([1.0, -2.5, 3.0], np.float32)
    bits = vecops.compress(x, "bfloat16").view(np.int16)
    out = np.zeros(3, np.float32)
    vecops.convert(out, bits, src_dtype="bfloat16")
    np.testing.assert_array_equal(out, x)


# --------------------------------------------------------------------------
# the header on its own: strict C, C++, and an FMA-capable build
# --------------------------------------------------------------------------

DRIVER = r"""
#include "smb_vecops.h"
int run(float *dst, const float *a, const uint16_t *b, size_t n)
{
    const void *srcs[2] = {a, b};
    int dtypes[2] = {SMB_DTYPE_FLOAT32, SMB_DTYPE_FLOAT16};
    double weights[2] = {0.3, -1.7};
    return smb_weighted_sum(dst, SMB_DTYPE_FLOAT32, srcs, dtypes, weights, 2, n);
}
"""


@pytest.mark.timeout(120)
def test_header_compiles_standalone_and_never_contracts_to_fma(tmp_path):
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("gcc is not installed")
    src = tmp_path / "driver.c"
    src.write_text(DRIVER)
    strict = [cc, "-std=c99", "-O3", "-Wall", "-Wextra", "-Werror", "-I", str(HEADER_DIR),
              "-c", str(src), "-o", str(tmp_path / "strict.o")]
    proc = subprocess.run(strict, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    cxx = shutil.which("g++")
    if cxx:
        proc = subprocess.run([cxx, "-x", "c++", "-O2", "-Wall", "-Werror", "-I", str(HEADER_DIR),
                               "-c", str(src), "-o", str(tmp_path / "cxx.o")],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    if not (sys.platform.startswith("linux") and "avx2" in ISAS):
        return
    # built for a CPU with FMA: results must still equal numpy's separate mul and add
    lib = tmp_path / "libdriver.so"
    proc = subprocess.run([cc, "-O3", "-mavx2", "-mfma", "-mf16c", "-shared", "-fPIC", "-I",
                           str(HEADER_DIR), str(src), "-o", str(lib)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    import ctypes
    driver = ctypes.CDLL(str(lib))
    rng = np.random.default_rng(17)
    n = 4099
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float16)
    out = np.empty(n, np.float32)
    ptr = lambda arr: arr.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    assert driver.run(ptr(out), ptr(a), ptr(b), ctypes.c_size_t(n)) == 0
    want = np.float32(0.3) * a + np.float32(-1.7) * b.astype(np.float32)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


@pytest.mark.timeout(60)
def test_cpu_torch_tensors_in_place():
    import torch
    x = torch.randn(3000)
    grad16 = torch.empty(3000, dtype=torch.bfloat16)
    vecops.convert(grad16, x)  # the bf16 codec straight into a torch tensor
    assert torch.equal(grad16, x.to(torch.bfloat16))  # torch rounds to nearest even too
    y = torch.ones(3000, dtype=torch.float16)
    vecops.axpy(y, grad16, 0.5)
    want = (torch.ones(3000) + 0.5 * x.to(torch.bfloat16).float()).to(torch.float16)
    assert torch.equal(y, want)


# --------------------------------------------------------------------------
# Adasum's dot products
# --------------------------------------------------------------------------

def reference_dot_norms(a, b):
    """dot_norms' exact arithmetic in numpy: float32 products, each chunk of 1024 summed
    sequentially in float32 over 16 lanes (element i in lane i % 16), the lanes added in
    order into float64 sums."""
    sums = [0.0, 0.0, 0.0]
    for off in range(0, len(a), vecops.CHUNK):
        x, y = a[off:off + vecops.CHUNK], b[off:off + vecops.CHUNK]
        pad = -len(x) % 16
        for k, prod in enumerate((x * y, x * x, y * y)):
            lanes = np.add.accumulate(np.concatenate([prod, np.zeros(pad, np.float32)]).reshape(-1, 16),
                                      axis=0, dtype=np.float32)[-1]
            for lane in lanes:
                sums[k] += float(lane)
    return tuple(sums)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("a_dtype,b_dtype", [("float32", "float32"), ("float16", "float32"),
                                             ("bfloat16", "bfloat16"), ("float32", "bfloat16")])
def test_dot_norms_exact_against_numpy(isa, a_dtype, b_dtype):
    rng = np.random.default_rng(21)
    for n in (0, 1, 15, 16, 17, 1023, 1024, 1025, 5000):
        a = to_storage(rng.standard_normal(n) * 3, a_dtype)
        b = to_storage(rng.standard_normal(n) - 0.5, b_dtype)
        a32 = as_values(a, a_dtype).astype(np.float32)
        b32 = as_values(b, b_dtype).astype(np.float32)
        got = vecops.dot_norms(a, b, a_dtype=a_dtype, b_dtype=b_dtype)
        assert got == reference_dot_norms(a32, b32), (n, got)
        # close to the exact float64 values too: the float64 sums keep the error per chunk
        exact = (a32.astype(np.float64) @ b32, a32.astype(np.float64) @ a32, b32.astype(np.float64) @ b32)
        scale = np.sqrt(exact[1] * exact[2]) if n else 0.0
        assert all(abs(g - e) <= 1e-5 * max(scale, e) for g, e in zip(got, exact)), (n, got, exact)


@pytest.mark.timeout(60)
def test_dot_norms_of_a_vector_with_itself_and_refusals():
    x = np.random.default_rng(22).standard_normal(3000).astype(np.float32)
    ab, aa, bb = vecops.dot_norms(x, x)
    assert ab == aa == bb == reference_dot_norms(x, x)[0]
    assert vecops.dot_norms(np.zeros(7, np.float32), x[:7]) == (0.0, 0.0, reference_dot_norms(x[:7], x[:7])[2])
    with pytest.raises(SMBValueError, match="not float64"):
        vecops.dot_norms(x.astype(np.float64), x)
    with pytest.raises(SMBValueError, match="has 10 elements but a has 3000"):
        vecops.dot_norms(x, x[:10])
