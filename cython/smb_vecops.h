/*
 * SMB vector kernels: weighted sum, axpy, scale and dtype conversion over
 * float32 / float16 / bfloat16 / float64 buffers, with fp32 accumulation
 * (fp64 when any operand is float64).
 *
 * Everything here is static inline C with no Python and no locks, so the SMB
 * server calls it from its request loop with the GIL released.
 *
 * How the loops are built: every kernel walks its buffers in chunks of
 * SMB_VECOPS_CHUNK elements.  Inputs that are not in the accumulation type are
 * first converted into a small stack buffer (L1-resident), the arithmetic runs
 * as plain restrict-qualified loops over the accumulation type, and the result
 * is converted into the destination.  Each inner loop touches one external
 * buffer at most, so gcc -O3 vectorizes all of them and a destination may be
 * the very same buffer as one of the sources (dst == src, same start) without
 * breaking the restrict promise.  Partially overlapping buffers are not
 * supported (callers check).
 *
 * Rounding is bit-exact and the same on every path: conversions round to
 * nearest even, handle subnormals, infinities and NaNs (NaNs keep sign and top
 * payload bits and come out quiet, as the x86 F16C instructions do), and the
 * arithmetic is never contracted into FMA, so results equal numpy's
 * elementwise `acc = w0*s0; acc += w1*s1; ...` in the same accumulation type.
 * float64 -> float16/bfloat16 goes through a round-to-odd float32, which
 * makes the two-step rounding exact.
 *
 * The loops (smb_vecops_loops.h) are compiled twice on x86: for the build's
 * target and for AVX2 + F16C, picked once at run time, so a generic x86-64
 * build still runs 256-bit loops and hardware float16 conversion where the
 * CPU has them; elsewhere float16 goes through a portable branch-free
 * software routine.
 *
 * Every kernel returns 0 or a negative SMB_VECOPS_E* code.
 */
#ifndef EDDIS_SMB_VECOPS_H
#define EDDIS_SMB_VECOPS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define SMB_VECOPS_X86 1
#include <immintrin.h>
#else
#define SMB_VECOPS_X86 0
#endif

#ifdef __cplusplus
#define SMB_RESTRICT __restrict__
#else
#define SMB_RESTRICT restrict
#endif

enum {
    SMB_DTYPE_FLOAT32 = 0,
    SMB_DTYPE_FLOAT16 = 1,
    SMB_DTYPE_BFLOAT16 = 2,
    SMB_DTYPE_FLOAT64 = 3,
    SMB_DTYPE_COUNT = 4
};

enum {
    SMB_VECOPS_OK = 0,
    SMB_VECOPS_EDTYPE = -1,   /* dtype code not one of SMB_DTYPE_* */
    SMB_VECOPS_ENOSRC = -2,   /* weighted_sum called with zero sources */
    SMB_VECOPS_ENULL = -3,    /* NULL buffer with a non-zero count */
    SMB_VECOPS_EISA = -4,     /* requested instruction set not available */
    SMB_VECOPS_EWIDE = -5     /* float64 operand where only the wire dtypes are taken */
};

/* Elements per chunk: small enough that the stack buffers (<= 3 x 8 KiB) stay
   in L1, large enough that the per-chunk dispatch costs nothing. */
#define SMB_VECOPS_CHUNK 1024

static inline const char *smb_vecops_strerror(int code)
{
    switch (code) {
    case SMB_VECOPS_OK: return "success";
    case SMB_VECOPS_EDTYPE:
        return "unknown dtype code (use 0 float32, 1 float16, 2 bfloat16, 3 float64)";
    case SMB_VECOPS_ENOSRC: return "weighted_sum needs at least one source slot";
    case SMB_VECOPS_ENULL: return "NULL buffer pointer with a non-zero element count";
    case SMB_VECOPS_EISA: return "this CPU lacks the requested instruction set";
    case SMB_VECOPS_EWIDE:
        return "dot_norms takes float32, float16 or bfloat16 operands, not float64";
    default: return "unknown vecops error";
    }
}

static inline size_t smb_dtype_size(int dtype)
{
    switch (dtype) {
    case SMB_DTYPE_FLOAT32: return 4;
    case SMB_DTYPE_FLOAT16: return 2;
    case SMB_DTYPE_BFLOAT16: return 2;
    case SMB_DTYPE_FLOAT64: return 8;
    default: return 0;
    }
}

static inline int smb_dtype_valid(int dtype)
{
    return dtype >= 0 && dtype < SMB_DTYPE_COUNT;
}

/* ------------------------------------------------------------------------ */
/* Scalar conversions (branch-free, so the array loops vectorize)            */
/* ------------------------------------------------------------------------ */

static inline uint32_t smb_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float smb_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* all-ones when cond, else zero: selects written as masks keep the loops
   free of control flow, which gcc needs to vectorize them */
static inline uint32_t smb_mask(int cond)
{
    return (uint32_t)0 - (uint32_t)(cond != 0);
}

static inline uint32_t smb_select(uint32_t mask, uint32_t if_set, uint32_t if_clear)
{
    return (if_set & mask) | (if_clear & ~mask);
}

static inline uint16_t smb_f32_to_bf16(float f)
{
    uint32_t u = smb_f32_bits(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (u >> 16) | 0x40u;
    uint32_t is_nan = smb_mask((u & 0x7fffffffu) > 0x7f800000u);
    return (uint16_t)smb_select(is_nan, quiet_nan, rounded);
}

static inline float smb_bf16_to_f32(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    /* quiet a signalling NaN, as the float16 path (and F16C) does */
    uint32_t is_nan = smb_mask((u & 0x7fffffffu) > 0x7f800000u);
    return smb_bits_f32(u | (is_nan & 0x00400000u));
}

static inline uint16_t smb_f32_to_f16(float f)
{
    uint32_t u = smb_f32_bits(f);
    uint32_t sign = (u & 0x80000000u) >> 16;
    uint32_t a = u & 0x7fffffffu;
    /* |f| >= 65536 (or inf/NaN): inf, or a quiet NaN keeping the top payload */
    uint32_t special = 0x7c00u | (smb_mask(a > 0x7f800000u) & (0x200u | ((a >> 13) & 0x3ffu)));
    /* |f| < 2^-14: adding 0.5 puts the float16 subnormal quantum (2^-24) at
       the last mantissa bit, so the FPU itself rounds to nearest even */
    uint32_t subnormal = smb_f32_bits(smb_bits_f32(a) + 0.5f) - 0x3f000000u;
    /* normal: rebias the exponent, round the 13 dropped bits to nearest even;
       a carry out of the mantissa correctly bumps the exponent (up to inf) */
    uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
    uint32_t r = smb_select(smb_mask(a < 0x38800000u), subnormal, normal);
    r = smb_select(smb_mask(a >= 0x47800000u), special, r);
    return (uint16_t)(r | sign);
}

static inline float smb_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = (uint32_t)(h & 0x7fffu) << 13;    /* exponent+mantissa, aligned */
    uint32_t exp = em & 0x0f800000u;
    uint32_t normal = em + 0x38000000u;             /* rebias 15 -> 127 */
    uint32_t special = em | 0x7f800000u;            /* inf / NaN */
    special |= smb_mask((em & 0x007fe000u) != 0) & 0x00400000u;  /* NaN comes out quiet */
    /* subnormal/zero: 2^-14 * (1 + m/1024) - 2^-14 is exact and never subnormal
       in float32, so FTZ/DAZ modes cannot disturb it */
    uint32_t subnormal = smb_f32_bits(smb_bits_f32(em + 0x38800000u) - smb_bits_f32(0x38800000u));
    uint32_t r = smb_select(smb_mask(exp == 0), subnormal, normal);
    r = smb_select(smb_mask(exp == 0x0f800000u), special, r);
    return smb_bits_f32(r | sign);
}

/* float64 -> float32 rounding to odd: truncate toward zero and set the last
   bit when inexact.  Rounding that to a format of <= 22 bits is then exactly
   the correct single rounding of the float64 value. */
static inline float smb_f64_to_f32_odd(double d)
{
    float f = (float)d;
    double back = (double)f;
    uint32_t u = smb_f32_bits(f);
    /* |f| > |d| (f rounded away from zero): step one ulp back toward zero */
    u -= smb_mask(__builtin_fabs(back) > __builtin_fabs(d)) & 1u;
    u |= smb_mask(back != d) & 1u;   /* inexact; a NaN stays a NaN */
    return smb_bits_f32(u);
}

/* ------------------------------------------------------------------------ */
/* Instruction sets: the loops exist twice, picked once at run time          */
/* ------------------------------------------------------------------------ */

/* SMB_ISA_GENERIC: whatever the compiler targets (SSE2 on x86-64), software
   float16.  SMB_ISA_AVX2: 256-bit loops and F16C float16 conversion, for
   x86 CPUs with AVX2 and F16C.  Both give identical bits (no FMA anywhere). */
enum { SMB_ISA_AUTO = -1, SMB_ISA_GENERIC = 0, SMB_ISA_AVX2 = 1 };

/* One flag per translation unit: the path the kernels take. */
static int smb_vecops_isa_state = SMB_ISA_AUTO;

static inline int smb_vecops_cpu_has_avx2(void)
{
#if SMB_VECOPS_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

/* The path in use: SMB_ISA_AVX2 or SMB_ISA_GENERIC. */
static inline int smb_vecops_isa(void)
{
    int isa = smb_vecops_isa_state;
    if (isa == SMB_ISA_AUTO) {
        isa = smb_vecops_cpu_has_avx2() ? SMB_ISA_AVX2 : SMB_ISA_GENERIC;
        smb_vecops_isa_state = isa;
    }
    return isa;
}

/* Force a path (tests compare both); SMB_ISA_AUTO picks the best again. */
static inline int smb_vecops_set_isa(int isa)
{
    if (isa == SMB_ISA_AVX2 && !smb_vecops_cpu_has_avx2())
        return SMB_VECOPS_EISA;
    if (isa != SMB_ISA_AUTO && isa != SMB_ISA_GENERIC && isa != SMB_ISA_AVX2)
        return SMB_VECOPS_EISA;
    smb_vecops_isa_state = isa;
    return SMB_VECOPS_OK;
}

/* Fixed lanes of the dot products: each lane sums every SMB_DOT_LANES-th
   product in order, so the bits do not depend on how the compiler vectorizes. */
#define SMB_DOT_LANES 16

#define SMB_LOOP(name) name##_generic
#define SMB_LOOP_ATTR
#include "smb_vecops_loops.h"
#undef SMB_LOOP
#undef SMB_LOOP_ATTR

#if SMB_VECOPS_X86
#define SMB_LOOP(name) name##_avx2
#define SMB_LOOP_ATTR __attribute__((target("avx2,f16c")))
#define SMB_LOOP_F16C 1
#include "smb_vecops_loops.h"
#undef SMB_LOOP
#undef SMB_LOOP_ATTR
#undef SMB_LOOP_F16C
#define SMB_DISPATCH(name, ...) \
    (smb_vecops_isa() == SMB_ISA_AVX2 ? name##_avx2 : name##_generic)(__VA_ARGS__)
#else
#define SMB_DISPATCH(name, ...) name##_generic(__VA_ARGS__)
#endif

/* One dispatching entry per loop; the kernels below call these per chunk. */
static inline void smb_cvt_f16_f32(float *dst, const uint16_t *src, size_t n)
{ SMB_DISPATCH(smb_cvt_f16_f32, dst, src, n); }
static inline void smb_cvt_f32_f16(uint16_t *dst, const float *src, size_t n)
{ SMB_DISPATCH(smb_cvt_f32_f16, dst, src, n); }
static inline void smb_cvt_bf16_f32(float *dst, const uint16_t *src, size_t n)
{ SMB_DISPATCH(smb_cvt_bf16_f32, dst, src, n); }
static inline void smb_cvt_f32_bf16(uint16_t *dst, const float *src, size_t n)
{ SMB_DISPATCH(smb_cvt_f32_bf16, dst, src, n); }
static inline void smb_cvt_f32_f64(double *dst, const float *src, size_t n)
{ SMB_DISPATCH(smb_cvt_f32_f64, dst, src, n); }
static inline void smb_cvt_f64_f32(float *dst, const double *src, size_t n)
{ SMB_DISPATCH(smb_cvt_f64_f32, dst, src, n); }
static inline void smb_cvt_f64_f32_odd(float *dst, const double *src, size_t n)
{ SMB_DISPATCH(smb_cvt_f64_f32_odd, dst, src, n); }
static inline void smb_mul_f32(float *acc, float w, const float *x, size_t n)
{ SMB_DISPATCH(smb_mul_f32, acc, w, x, n); }
static inline void smb_muladd_f32(float *acc, float w, const float *x, size_t n)
{ SMB_DISPATCH(smb_muladd_f32, acc, w, x, n); }
static inline void smb_mul_f64(double *acc, double w, const double *x, size_t n)
{ SMB_DISPATCH(smb_mul_f64, acc, w, x, n); }
static inline void smb_muladd_f64(double *acc, double w, const double *x, size_t n)
{ SMB_DISPATCH(smb_muladd_f64, acc, w, x, n); }
static inline void smb_axpy_inplace_f32(float *y, float a, const float *x, size_t n)
{ SMB_DISPATCH(smb_axpy_inplace_f32, y, a, x, n); }
static inline void smb_axpy_inplace_f64(double *y, double a, const double *x, size_t n)
{ SMB_DISPATCH(smb_axpy_inplace_f64, y, a, x, n); }
static inline void smb_scale_inplace_f32(float *x, float a, size_t n)
{ SMB_DISPATCH(smb_scale_inplace_f32, x, a, n); }
static inline void smb_scale_inplace_f64(double *x, double a, size_t n)
{ SMB_DISPATCH(smb_scale_inplace_f64, x, a, n); }
static inline void smb_dot3_f32(float *lanes, const float *a, const float *b, size_t n)
{ SMB_DISPATCH(smb_dot3_f32, lanes, a, b, n); }

/* ------------------------------------------------------------------------ */
/* Chunk loaders and storers: any dtype <-> the accumulation type            */
/* ------------------------------------------------------------------------ */

/* n elements of src (dtype, element offset off) as float32: a pointer into
   src itself when it is float32, else converted into tmp. */
static inline const float *smb_load_f32(const void *src, int dtype, size_t off, size_t n,
                                        float *SMB_RESTRICT tmp)
{
    switch (dtype) {
    case SMB_DTYPE_FLOAT32:
        return (const float *)src + off;
    case SMB_DTYPE_FLOAT16:
        smb_cvt_f16_f32(tmp, (const uint16_t *)src + off, n);
        return tmp;
    case SMB_DTYPE_BFLOAT16:
        smb_cvt_bf16_f32(tmp, (const uint16_t *)src + off, n);
        return tmp;
    default: /* float64 never reaches the float32 accumulator */
        smb_cvt_f64_f32(tmp, (const double *)src + off, n);
        return tmp;
    }
}

/* the same as float64; tmp32 is scratch for the half types */
static inline const double *smb_load_f64(const void *src, int dtype, size_t off, size_t n,
                                         double *SMB_RESTRICT tmp, float *SMB_RESTRICT tmp32)
{
    if (dtype == SMB_DTYPE_FLOAT64)
        return (const double *)src + off;
    smb_cvt_f32_f64(tmp, smb_load_f32(src, dtype, off, n, tmp32), n);
    return tmp;
}

/* n float32 values into dst (dtype, element offset off) */
static inline void smb_store_f32(void *dst, int dtype, size_t off, const float *SMB_RESTRICT acc,
                                 size_t n)
{
    switch (dtype) {
    case SMB_DTYPE_FLOAT32:
        memcpy((float *)dst + off, acc, n * sizeof(float));
        break;
    case SMB_DTYPE_FLOAT16:
        smb_cvt_f32_f16((uint16_t *)dst + off, acc, n);
        break;
    case SMB_DTYPE_BFLOAT16:
        smb_cvt_f32_bf16((uint16_t *)dst + off, acc, n);
        break;
    default:
        smb_cvt_f32_f64((double *)dst + off, acc, n);
        break;
    }
}

/* n float64 values into dst; tmp32 is scratch for the half types */
static inline void smb_store_f64(void *dst, int dtype, size_t off, const double *SMB_RESTRICT acc,
                                 size_t n, float *SMB_RESTRICT tmp32)
{
    switch (dtype) {
    case SMB_DTYPE_FLOAT64:
        memcpy((double *)dst + off, acc, n * sizeof(double));
        break;
    case SMB_DTYPE_FLOAT32:
        smb_cvt_f64_f32((float *)dst + off, acc, n);
        break;
    default:
        smb_cvt_f64_f32_odd(tmp32, acc, n);
        smb_store_f32(dst, dtype, off, tmp32, n);
        break;
    }
}

/* length of the chunk at off in a range that ends at end */
static inline size_t smb_chunk_len(size_t off, size_t end)
{
    size_t left = end - off;
    return left < SMB_VECOPS_CHUNK ? left : SMB_VECOPS_CHUNK;
}

/* ------------------------------------------------------------------------ */
/* Kernels                                                                   */
/* ------------------------------------------------------------------------ */

/* Each kernel is a check of its arguments plus a *_range loop over elements
   [begin, end).  Every element's arithmetic depends on that element alone, so
   running disjoint ranges on several threads (smb_vecpool.h) gives exactly the
   bits of one call over the whole count. */

/* dst[i] = sum_k weights[k] * srcs[k][i], k < nsrc, i < count.
   Accumulates in float64 when dst or any source is float64, else float32.
   dst may be the same buffer as any source. */
static inline int smb_weighted_sum_check(const void *dst, int dst_dtype, const void *const *srcs,
                                         const int *src_dtypes, size_t nsrc, size_t count)
{
    if (!smb_dtype_valid(dst_dtype))
        return SMB_VECOPS_EDTYPE;
    if (nsrc == 0)
        return SMB_VECOPS_ENOSRC;
    for (size_t k = 0; k < nsrc; k++) {
        if (!smb_dtype_valid(src_dtypes[k]))
            return SMB_VECOPS_EDTYPE;
        if (count && !srcs[k])
            return SMB_VECOPS_ENULL;
    }
    if (count && !dst)
        return SMB_VECOPS_ENULL;
    return SMB_VECOPS_OK;
}

static inline void smb_weighted_sum_range(void *dst, int dst_dtype, const void *const *srcs,
                                          const int *src_dtypes, const double *weights,
                                          size_t nsrc, size_t begin, size_t end)
{
    int wide = dst_dtype == SMB_DTYPE_FLOAT64;
    for (size_t k = 0; k < nsrc; k++)
        wide |= src_dtypes[k] == SMB_DTYPE_FLOAT64;
    if (!wide) {
        float acc[SMB_VECOPS_CHUNK], tmp[SMB_VECOPS_CHUNK];
        for (size_t off = begin; off < end; off += SMB_VECOPS_CHUNK) {
            size_t n = smb_chunk_len(off, end);
            smb_mul_f32(acc, (float)weights[0], smb_load_f32(srcs[0], src_dtypes[0], off, n, tmp), n);
            for (size_t k = 1; k < nsrc; k++)
                smb_muladd_f32(acc, (float)weights[k],
                               smb_load_f32(srcs[k], src_dtypes[k], off, n, tmp), n);
            smb_store_f32(dst, dst_dtype, off, acc, n);
        }
    } else {
        double acc[SMB_VECOPS_CHUNK], tmp[SMB_VECOPS_CHUNK];
        float tmp32[SMB_VECOPS_CHUNK];
        for (size_t off = begin; off < end; off += SMB_VECOPS_CHUNK) {
            size_t n = smb_chunk_len(off, end);
            smb_mul_f64(acc, weights[0], smb_load_f64(srcs[0], src_dtypes[0], off, n, tmp, tmp32), n);
            for (size_t k = 1; k < nsrc; k++)
                smb_muladd_f64(acc, weights[k],
                               smb_load_f64(srcs[k], src_dtypes[k], off, n, tmp, tmp32), n);
            smb_store_f64(dst, dst_dtype, off, acc, n, tmp32);
        }
    }
}

static inline int smb_weighted_sum(void *dst, int dst_dtype, const void *const *srcs,
                                   const int *src_dtypes, const double *weights, size_t nsrc,
                                   size_t count)
{
    int rc = smb_weighted_sum_check(dst, dst_dtype, srcs, src_dtypes, nsrc, count);
    if (rc == SMB_VECOPS_OK)
        smb_weighted_sum_range(dst, dst_dtype, srcs, src_dtypes, weights, nsrc, 0, count);
    return rc;
}

/* y[i] += alpha * x[i]; x may be the same buffer as y. */
static inline int smb_axpy_check(const void *y, int y_dtype, const void *x, int x_dtype,
                                 size_t count)
{
    if (!smb_dtype_valid(y_dtype) || !smb_dtype_valid(x_dtype))
        return SMB_VECOPS_EDTYPE;
    if (count && (!x || !y))
        return SMB_VECOPS_ENULL;
    return SMB_VECOPS_OK;
}

static inline void smb_axpy_range(void *y, int y_dtype, const void *x, int x_dtype, double alpha,
                                  size_t begin, size_t end)
{
    if (y_dtype != SMB_DTYPE_FLOAT64 && x_dtype != SMB_DTYPE_FLOAT64) {
        float acc[SMB_VECOPS_CHUNK], tmp[SMB_VECOPS_CHUNK];
        float a = (float)alpha;
        for (size_t off = begin; off < end; off += SMB_VECOPS_CHUNK) {
            size_t n = smb_chunk_len(off, end);
            if (y_dtype == SMB_DTYPE_FLOAT32) {
                /* x is staged in tmp unless it is float32 too */
                smb_axpy_inplace_f32((float *)y + off, a, smb_load_f32(x, x_dtype, off, n, tmp), n);
            } else {
                smb_load_f32(y, y_dtype, off, n, acc);  /* a half type: staged into acc */
                smb_axpy_inplace_f32(acc, a, smb_load_f32(x, x_dtype, off, n, tmp), n);
                smb_store_f32(y, y_dtype, off, acc, n);
            }
        }
    } else {
        double acc[SMB_VECOPS_CHUNK], tmp[SMB_VECOPS_CHUNK];
        float tmp32[SMB_VECOPS_CHUNK];
        for (size_t off = begin; off < end; off += SMB_VECOPS_CHUNK) {
            size_t n = smb_chunk_len(off, end);
            if (y_dtype == SMB_DTYPE_FLOAT64) {
                smb_axpy_inplace_f64((double *)y + off, alpha,
                                     smb_load_f64(x, x_dtype, off, n, tmp, tmp32), n);
            } else {
                smb_load_f64(y, y_dtype, off, n, acc, tmp32);  /* not float64: staged into acc */
                smb_axpy_inplace_f64(acc, alpha, smb_load_f64(x, x_dtype, off, n, tmp, tmp32), n);
                smb_store_f64(y, y_dtype, off, acc, n, tmp32);
            }
        }
    }
}

static inline int smb_axpy(void *y, int y_dtype, const void *x, int x_dtype, double alpha,
                           size_t count)
{
    int rc = smb_axpy_check(y, y_dtype, x, x_dtype, count);
    if (rc == SMB_VECOPS_OK)
        smb_axpy_range(y, y_dtype, x, x_dtype, alpha, 0, count);
    return rc;
}

/* x[i] *= alpha */
static inline int smb_scale_check(const void *x, int dtype, size_t count)
{
    if (!smb_dtype_valid(dtype))
        return SMB_VECOPS_EDTYPE;
    if (count && !x)
        return SMB_VECOPS_ENULL;
    return SMB_VECOPS_OK;
}

static inline void smb_scale_range(void *x, int dtype, double alpha, size_t begin, size_t end)
{
    if (begin >= end)
        return;
    if (dtype == SMB_DTYPE_FLOAT32) {
        smb_scale_inplace_f32((float *)x + begin, (float)alpha, end - begin);
    } else if (dtype == SMB_DTYPE_FLOAT64) {
        smb_scale_inplace_f64((double *)x + begin, alpha, end - begin);
    } else {
        float acc[SMB_VECOPS_CHUNK];
        for (size_t off = begin; off < end; off += SMB_VECOPS_CHUNK) {
            size_t n = smb_chunk_len(off, end);
            smb_load_f32(x, dtype, off, n, acc);
            smb_scale_inplace_f32(acc, (float)alpha, n);
            smb_store_f32(x, dtype, off, acc, n);
        }
    }
}

static inline int smb_scale(void *x, int dtype, double alpha, size_t count)
{
    int rc = smb_scale_check(x, dtype, count);
    if (rc == SMB_VECOPS_OK)
        smb_scale_range(x, dtype, alpha, 0, count);
    return rc;
}

/* dst[i] = src[i] converted to dst_dtype.  dst and src may be the very same
   address (in-place conversion, e.g. float32 -> float16 compressing into the
   front half of its own buffer, or back); otherwise they must not overlap. */
static inline int smb_convert_check(const void *dst, int dst_dtype, const void *src, int src_dtype,
                                    size_t count)
{
    if (!smb_dtype_valid(dst_dtype) || !smb_dtype_valid(src_dtype))
        return SMB_VECOPS_EDTYPE;
    if (count && (!dst || !src))
        return SMB_VECOPS_ENULL;
    return SMB_VECOPS_OK;
}

/* An in-place conversion between sizes moves every element to another byte
   offset, so its chunks depend on each other's order: one range only, the
   whole count, never split over threads. */
static inline int smb_convert_splittable(const void *dst, int dst_dtype, const void *src,
                                         int src_dtype)
{
    return dst != src || smb_dtype_size(dst_dtype) == smb_dtype_size(src_dtype);
}

static inline void smb_convert_range(void *dst, int dst_dtype, const void *src, int src_dtype,
                                     size_t begin, size_t end)
{
    if (begin >= end)
        return;
    if (dst_dtype == src_dtype) {
        size_t size = smb_dtype_size(src_dtype);
        if (dst != src)
            memcpy((char *)dst + begin * size, (const char *)src + begin * size, (end - begin) * size);
        return;
    }
    int in_place = dst == src;
    /* in place and widening: walk backwards so no chunk overwrites unread input */
    int backwards = in_place && smb_dtype_size(dst_dtype) > smb_dtype_size(src_dtype);
    size_t nchunks = (end - begin + SMB_VECOPS_CHUNK - 1) / SMB_VECOPS_CHUNK;
    int wide = dst_dtype == SMB_DTYPE_FLOAT64 || src_dtype == SMB_DTYPE_FLOAT64;
    float tmp[SMB_VECOPS_CHUNK];
    double tmp64[SMB_VECOPS_CHUNK];
    for (size_t c = 0; c < nchunks; c++) {
        size_t off = begin + (backwards ? nchunks - 1 - c : c) * SMB_VECOPS_CHUNK;
        size_t n = smb_chunk_len(off, end);
        if (!wide) {
            const float *v = smb_load_f32(src, src_dtype, off, n, tmp);
            if (in_place && v != tmp) {  /* float32 source still points into the buffer */
                memcpy(tmp, v, n * sizeof(float));
                v = tmp;
            }
            smb_store_f32(dst, dst_dtype, off, v, n);
        } else if (src_dtype == SMB_DTYPE_FLOAT64) {
            const double *v = (const double *)src + off;
            if (in_place) {
                memcpy(tmp64, v, n * sizeof(double));
                v = tmp64;
            }
            smb_store_f64(dst, dst_dtype, off, v, n, tmp);
        } else {
            /* widening to float64: everything is staged in tmp64 first */
            smb_store_f64(dst, dst_dtype, off, smb_load_f64(src, src_dtype, off, n, tmp64, tmp), n,
                          tmp);
        }
    }
}

static inline int smb_convert(void *dst, int dst_dtype, const void *src, int src_dtype,
                              size_t count)
{
    int rc = smb_convert_check(dst, dst_dtype, src, src_dtype, count);
    if (rc == SMB_VECOPS_OK)
        smb_convert_range(dst, dst_dtype, src, src_dtype, 0, count);
    return rc;
}

/* The contract's name for the same operation. */
static inline int smb_copy(void *dst, int dst_dtype, const void *src, int src_dtype, size_t count)
{
    return smb_convert(dst, dst_dtype, src, src_dtype, count);
}

/* The three dot products Adasum needs of a pair of vectors:
   out[0] = a.b, out[1] = a.a, out[2] = b.b.  Each chunk's products are
   summed in float32 over SMB_DOT_LANES fixed lanes, and the chunk's lanes are
   added in lane order into float64 accumulators: the error stays that of a
   1024-element float32 sum whatever the count, and the bits depend on the
   count alone (not on the instruction set or the thread).  a may be b.
   Only the wire dtypes (float32, float16, bfloat16) are taken. */
static inline int smb_dot_norms(const void *a, int a_dtype, const void *b, int b_dtype,
                                size_t count, double *out)
{
    if (!smb_dtype_valid(a_dtype) || !smb_dtype_valid(b_dtype))
        return SMB_VECOPS_EDTYPE;
    if (a_dtype == SMB_DTYPE_FLOAT64 || b_dtype == SMB_DTYPE_FLOAT64)
        return SMB_VECOPS_EWIDE;
    if (!out || (count && (!a || !b)))
        return SMB_VECOPS_ENULL;
    double ab = 0.0, aa = 0.0, bb = 0.0;
    float ta[SMB_VECOPS_CHUNK], tb[SMB_VECOPS_CHUNK];
    float lanes[3 * SMB_DOT_LANES];
    for (size_t off = 0; off < count; off += SMB_VECOPS_CHUNK) {
        size_t n = smb_chunk_len(off, count);
        memset(lanes, 0, sizeof lanes);
        smb_dot3_f32(lanes, smb_load_f32(a, a_dtype, off, n, ta),
                     smb_load_f32(b, b_dtype, off, n, tb), n);
        for (size_t j = 0; j < SMB_DOT_LANES; j++) {
            ab += (double)lanes[j];
            aa += (double)lanes[SMB_DOT_LANES + j];
            bb += (double)lanes[2 * SMB_DOT_LANES + j];
        }
    }
    out[0] = ab;
    out[1] = aa;
    out[2] = bb;
    return SMB_VECOPS_OK;
}

/* Compression codecs of the runtime: float32 <-> float16 / bfloat16.
   dst may equal src (in place: the halves end up packed at the front). */
static inline int smb_compress_f32(void *dst, int codec_dtype, const float *src, size_t count)
{
    if (codec_dtype != SMB_DTYPE_FLOAT16 && codec_dtype != SMB_DTYPE_BFLOAT16)
        return SMB_VECOPS_EDTYPE;
    return smb_convert(dst, codec_dtype, src, SMB_DTYPE_FLOAT32, count);
}

static inline int smb_decompress_f32(float *dst, const void *src, int codec_dtype, size_t count)
{
    if (codec_dtype != SMB_DTYPE_FLOAT16 && codec_dtype != SMB_DTYPE_BFLOAT16)
        return SMB_VECOPS_EDTYPE;
    return smb_convert(dst, SMB_DTYPE_FLOAT32, src, codec_dtype, count);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

#endif /* EDDIS_SMB_VECOPS_H */
