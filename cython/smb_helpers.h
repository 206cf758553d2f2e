/* C helpers of the SMB native core: atomics, clocks, waits, memfd (no Python here). */
#ifndef SMB_HELPERS_H
#define SMB_HELPERS_H
#include <stdint.h>
#include <stddef.h>
#include <time.h>
#include <sched.h>
static inline int smb_cas_int(int *p, int expected, int desired) {
    return __atomic_compare_exchange_n(p, &expected, desired, 0,
                                       __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}
static inline int smb_load_int(const int *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void smb_store_int(int *p, int v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline int smb_fetch_add_int(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
static inline int64_t smb_fetch_add64(int64_t *p, int64_t v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
static inline int64_t smb_cas64(int64_t *p, int64_t expected, int64_t desired) {
    __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
static inline int64_t smb_load64(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
static inline void smb_store_u32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline uint32_t smb_load_u32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void smb_store64(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
static inline double smb_now(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
static inline void smb_pause(unsigned idle) {
    /* Spin briefly, then yield, then sleep up to 200 us: low latency for
       quick replies without burning a shared core on long waits. */
    if (idle < 64) return;
    if (idle < 256) { sched_yield(); return; }
    struct timespec ts = {0, idle < 1024 ? 20000 : 200000};
    nanosleep(&ts, NULL);
}
#include <sys/mman.h>
#ifndef MFD_HUGETLB
#define MFD_HUGETLB 0x0004U
#endif
static inline int smb_memfd_hugetlb(const char *name) {
    /* not MFD_CLOEXEC: like the POSIX arena, same-node clients open it
       through /proc/<pid>/fd, which needs no inheritance anyway */
    return memfd_create(name, MFD_HUGETLB);
}
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#define SMB_MADV_POPULATE_WRITE MADV_POPULATE_WRITE
#endif
