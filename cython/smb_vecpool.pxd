# Declarations of cython/smb_vecpool.h, the SMB server's reduction threads (no logic here).
cdef extern from "smb_vecpool.h" nogil:
    enum:
        SMB_VECJOB_WEIGHTED_SUM
        SMB_VECJOB_AXPY
        SMB_VECJOB_SCALE
        SMB_VECJOB_CONVERT

    enum:
        SMB_VECPOOL_ALIGN
        SMB_VECPOOL_MIN_PART
        SMB_VECPOOL_MAX_THREADS

    ctypedef struct smb_vecjob_t:
        int kind
        void *dst
        int dst_dtype
        const void *const *srcs
        const int *src_dtypes
        const double *weights
        size_t nsrc
        double alpha
        size_t count

    ctypedef struct smb_vecpool_t:
        int nthreads

    int smb_vecpool_create(int threads, smb_vecpool_t **out)
    void smb_vecpool_destroy(smb_vecpool_t *pool)
    int smb_vecpool_run(smb_vecpool_t *pool, const smb_vecjob_t *job, int *threads_used)
    void smb_vecpool_counts(const smb_vecpool_t *pool, unsigned long *ops,
                            unsigned long *split_ops)
