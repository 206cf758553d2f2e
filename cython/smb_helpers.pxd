# Declarations of cython/smb_helpers.h and of the POSIX socket calls the SMB core uses (no logic here).
from libc.stdint cimport int64_t, uint16_t, uint32_t

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
    int smb_poll_fd(int fd, int ms)
    void smb_pause(unsigned idle)
    int smb_memfd_hugetlb(const char *name)
    enum: SMB_MADV_POPULATE_WRITE

cdef extern from "<sys/socket.h>" nogil:
    enum: AF_INET

cdef extern from "<netinet/in.h>" nogil:
    struct in_addr:
        uint32_t s_addr
    struct sockaddr_in:
        uint16_t sin_family
        uint16_t sin_port
        in_addr sin_addr
    uint16_t htons(uint16_t)
    uint16_t ntohs(uint16_t)

cdef extern from "<arpa/inet.h>" nogil:
    int inet_pton(int af, const char *src, void *dst)
