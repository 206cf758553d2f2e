/*
 * The elementwise loops of the SMB vector kernels, included by smb_vecops.h
 * once per instruction set: SMB_LOOP(name) gives each copy its own suffix and
 * SMB_LOOP_ATTR its target attribute, so one generic x86-64 (or other) build
 * still runs AVX2 loops on a CPU that has AVX2.  With SMB_LOOP_F16C defined the
 * float16 conversions use the F16C instructions instead of the software
 * routine (both round the same way, bit for bit).
 *
 * Every loop touches at most one buffer besides its restrict-qualified
 * scratch, has no control flow, and is written for gcc -O3 to vectorize.
 * No header guard: included on purpose more than once.
 */

SMB_LOOP_ATTR
static inline void SMB_LOOP(smb_cvt_f16_f32)(float *SMB_RESTRICT dst,
                                             const uint16_t *SMB_RESTRICT src, size_t n)
{
    size_t i = 0;
#ifdef SMB_LOOP_F16C
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++)
        dst[i] = smb_f16_to_f32(src[i]);
}

SMB_LOOP_ATTR
static inline void SMB_LOOP(smb_cvt_f32_f16)(uint16_t *SMB_RESTRICT dst,
                                             const float *SMB_RESTRICT src, size_t n)
{
    size_t i = 0;
#ifdef SMB_LOOP_F16C
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++)
        dst[i] = smb_f32_to_f16(src[i]);
}

SMB_LOOP_ATTR
static inline void SMB_LOOP(smb_cvt_bf16_f32)(float *SMB_RESTRICT dst,
                                              const uint16_t *SMB_RESTRICT src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = smb_bf16_to_f32(src[i]);
}

SMB_LOOP_ATTR
static inline void SMB_LOOP(smb_cvt_f32_bf16)(uint16_t *SMB_RESTRICT dst,
                                              const float *SMB_RESTRICT src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = smb_f32_to_bf16(src[i]);
}

SMB_LOOP_ATTR
static inline void SMB_LOOP(smb_cvt_f32_f64)(double *SMB_RESTRICT dst,
                                             const float *SMB_RESTRICT src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = (double)src[i];
}

SMB_LOOP_ATTR
static inline void SMB_LOOP(smb_cvt_f64_f32)(float *SMB_RESTRICT dst,
                                             const double *SMB_RESTRICT src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = (float)src[i];
}

SMB_LOOP_ATTR
static inline void SMB_LOOP(smb_cvt_f64_f32_odd)(float *SMB_RESTRICT dst,
                                                 const double *SMB_RESTRICT src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = smb_f64_to_f32_odd(src[i]);
}

SMB_LOOP_ATTR
static inline void SMB_LOOP(smb_mul_f32)(float *SMB_RESTRICT acc, float w,
                                         const float *SMB_RESTRICT x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        acc[i] = w * x[i];
}

SMB_LOOP_ATTR
static inline void SMB_LOOP(smb_muladd_f32)(float *SMB_RESTRICT acc, float w,
                                            const float *SMB_RESTRICT x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        acc[i] = acc[i] + w * x[i];
}

SMB_LOOP_ATTR
static inline void SMB_LOOP(smb_mul_f64)(double *SMB_RESTRICT acc, double w,
                                         const double *SMB_RESTRICT x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        acc[i] = w * x[i];
}

SMB_LOOP_ATTR
static inline void SMB_LOOP(smb_muladd_f64)(double *SMB_RESTRICT acc, double w,
                                            const double *SMB_RESTRICT x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        acc[i] = acc[i] + w * x[i];
}

/* y += a*x in place; x may be y itself, hence no restrict */
SMB_LOOP_ATTR
static inline void SMB_LOOP(smb_axpy_inplace_f32)(float *y, float a, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        y[i] = y[i] + a * x[i];
}

SMB_LOOP_ATTR
static inline void SMB_LOOP(smb_axpy_inplace_f64)(double *y, double a, const double *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        y[i] = y[i] + a * x[i];
}

SMB_LOOP_ATTR
static inline void SMB_LOOP(smb_scale_inplace_f32)(float *SMB_RESTRICT x, float a, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = a * x[i];
}

SMB_LOOP_ATTR
static inline void SMB_LOOP(smb_scale_inplace_f64)(double *SMB_RESTRICT x, double a, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = a * x[i];
}

/* lanes (3 x SMB_DOT_LANES: a.b, a.a, b.b) += the products of n elements; a
   and b are only read, so they may be the same buffer */
SMB_LOOP_ATTR
static inline void SMB_LOOP(smb_dot3_f32)(float *SMB_RESTRICT lanes, const float *SMB_RESTRICT a,
                                          const float *SMB_RESTRICT b, size_t n)
{
    float *SMB_RESTRICT ab = lanes;
    float *SMB_RESTRICT aa = lanes + SMB_DOT_LANES;
    float *SMB_RESTRICT bb = lanes + 2 * SMB_DOT_LANES;
    size_t i = 0;
    for (; i + SMB_DOT_LANES <= n; i += SMB_DOT_LANES) {
        for (size_t j = 0; j < SMB_DOT_LANES; j++) {
            float x = a[i + j], y = b[i + j];
            ab[j] = ab[j] + x * y;
            aa[j] = aa[j] + x * x;
            bb[j] = bb[j] + y * y;
        }
    }
    for (size_t j = 0; i < n; i++, j++) {
        float x = a[i], y = b[i];
        ab[j] = ab[j] + x * y;
        aa[j] = aa[j] + x * x;
        bb[j] = bb[j] + y * y;
    }
}
