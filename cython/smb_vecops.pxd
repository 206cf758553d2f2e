# Declarations of cython/smb_vecops.h, the SMB vector kernels (no logic here).
from libc.stdint cimport uint16_t

cdef extern from "smb_vecops.h" nogil:
    enum:
        SMB_DTYPE_FLOAT32
        SMB_DTYPE_FLOAT16
        SMB_DTYPE_BFLOAT16
        SMB_DTYPE_FLOAT64
        SMB_DTYPE_COUNT

    enum:
        SMB_VECOPS_OK
        SMB_VECOPS_EDTYPE
        SMB_VECOPS_ENOSRC
        SMB_VECOPS_ENULL
        SMB_VECOPS_EISA
        SMB_VECOPS_EWIDE

    enum:
        SMB_ISA_AUTO
        SMB_ISA_GENERIC
        SMB_ISA_AVX2

    enum:
        SMB_VECOPS_CHUNK

    const char *smb_vecops_strerror(int code)
    size_t smb_dtype_size(int dtype)
    int smb_dtype_valid(int dtype)

    uint16_t smb_f32_to_f16(float f)
    float smb_f16_to_f32(uint16_t h)
    uint16_t smb_f32_to_bf16(float f)
    float smb_bf16_to_f32(uint16_t b)

    int smb_vecops_cpu_has_avx2()
    int smb_vecops_isa()
    int smb_vecops_set_isa(int isa)

    int smb_weighted_sum(void *dst, int dst_dtype, const void *const *srcs,
                         const int *src_dtypes, const double *weights, size_t nsrc,
                         size_t count)
    int smb_axpy(void *y, int y_dtype, const void *x, int x_dtype, double alpha,
                 size_t count)
    int smb_scale(void *x, int dtype, double alpha, size_t count)
    int smb_convert(void *dst, int dst_dtype, const void *src, int src_dtype, size_t count)
    int smb_copy(void *dst, int dst_dtype, const void *src, int src_dtype, size_t count)
    int smb_dot_norms(const void *a, int a_dtype, const void *b, int b_dtype, size_t count,
                      double *out)
    int smb_compress_f32(void *dst, int codec_dtype, const float *src, size_t count)
    int smb_decompress_f32(float *dst, const void *src, int codec_dtype, size_t count)
