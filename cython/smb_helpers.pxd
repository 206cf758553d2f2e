# Declarations of cython/smb_helpers.h (no logic here).
from libc.stdint cimport int64_t, uint32_t

cdef extern from "smb_helpers.h" nogil:
    int smb_cas_int(int *p, int expected, int desired)
    int smb_load_int(const int *p)
    void smb_store_int(int *p, int v)
    int smb_fetch_add_int(int *p, int v)
    int64_t smb_fetch_add64(int64_t *p, int64_t v)
    int64_t smb_cas64(int64_t *p, int64_t expected, int64_t desired)
    int64_t smb_load64(const int64_t *p)
    void smb_store64(int64_t *p, int64_t v)
    void smb_store_u32(uint32_t *p, uint32_t v)
    uint32_t smb_load_u32(const uint32_t *p)
    double smb_now()
    void smb_pause(unsigned idle)
    int smb_memfd_hugetlb(const char *name)
    enum: SMB_MADV_POPULATE_WRITE
