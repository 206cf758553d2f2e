/*
 * A persistent pool of threads for the SMB server's vector operations.
 *
 * Why: the server reduces every bucket of every rank of a node; on one thread
 * that reduction becomes the node's bottleneck once several ranks push
 * gradients, while DDP's ring spreads the same additions over all ranks.
 *
 * How: the thread that asks for an operation (the server's request loop) cuts
 * the element range into contiguous parts, up to SMB_VECPOOL_PARTS_PER_THREAD
 * per thread, and wakes the workers; then it and every worker that is awake
 * claim parts one at a time until none is left, and the caller waits only for
 * parts already claimed.  On a node where the trainers keep every core busy a
 * worker may not run for a while: the others take its share instead of waiting
 * for it.  Part boundaries are multiples of SMB_VECPOOL_ALIGN elements, so no
 * two threads write into the same cache line for any dtype.  Each element's
 * arithmetic is the same whoever computes it (smb_vecops.h: no FMA,
 * per-element sums), so the result is bit-identical to one thread's.
 *
 * A claim is a compare-and-swap on one word that holds the operation's epoch
 * and the next part, so a worker that wakes late can never take a part of a
 * later operation with the job of an earlier one.
 *
 * Operations smaller than SMB_VECPOOL_MIN_PART elements per part stay on the
 * calling thread: waking a sleeping worker costs a few microseconds, as much
 * as reducing tens of thousands of elements.
 *
 * One operation runs at a time.  A second caller that finds the pool busy
 * does its operation alone instead of waiting for the first one.
 *
 * Plain C with pthreads, no Python, no GIL; every call returns 0 or an errno
 * value (init) / a SMB_VECOPS_E* code (run).
 */
#ifndef EDDIS_SMB_VECPOOL_H
#define EDDIS_SMB_VECPOOL_H

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "smb_vecops.h"

enum {
    SMB_VECJOB_WEIGHTED_SUM = 0,
    SMB_VECJOB_AXPY = 1,
    SMB_VECJOB_SCALE = 2,
    SMB_VECJOB_CONVERT = 3
};

/* 64 elements: a whole number of 64-byte cache lines for 2-, 4- and 8-byte
   dtypes alike (buffers in the server's arena start 64-byte aligned). */
#define SMB_VECPOOL_ALIGN 64
/* Below 32 Ki elements a part (128 KiB of float32 per operand) the wake-up
   of a worker costs about as much as the work it would take over. */
#define SMB_VECPOOL_MIN_PART 32768
#define SMB_VECPOOL_MAX_THREADS 256
/* More parts than threads, so that a thread the scheduler holds back costs
   one small part of delay at most, not a whole thread's share. */
#define SMB_VECPOOL_PARTS_PER_THREAD 4
/* the claim word: epoch << SMB_VECPOOL_PART_BITS | next part */
#define SMB_VECPOOL_PART_BITS 20

typedef struct {
    int kind;                       /* SMB_VECJOB_* */
    void *dst;                      /* y of axpy, x of scale */
    int dst_dtype;
    const void *const *srcs;        /* x of axpy and src of convert: srcs[0] */
    const int *src_dtypes;
    const double *weights;
    size_t nsrc;
    double alpha;
    size_t count;
} smb_vecjob_t;

struct smb_vecpool;

typedef struct {
    struct smb_vecpool *pool;
    int index;                      /* the part it runs: 1 .. nworkers */
} smb_vecpool_arg_t;

typedef struct smb_vecpool {
    int nthreads;                   /* threads that reduce, the caller included */
    int nworkers;                   /* of them started as workers: nthreads - 1 */
    pthread_t *workers;
    smb_vecpool_arg_t *args;        /* one per worker, alive as long as it */
    pthread_mutex_t busy;           /* held by the caller of the running operation */
    pthread_mutex_t mu;             /* guards everything below */
    pthread_cond_t wake;            /* workers: a new epoch, or stop */
    pthread_cond_t done;            /* caller: finished reached nparts */
    int stop;
    uint64_t epoch;
    const smb_vecjob_t *job;
    size_t nparts;
    size_t part;                    /* elements per part but the last */
    size_t finished;                /* parts of this epoch done */
    int helpers;                    /* workers that ran a part of this epoch */
    uint64_t claim;                 /* atomic: epoch << PART_BITS | next part */
    unsigned long ops;              /* operations run, and how many were split */
    unsigned long split_ops;
} smb_vecpool_t;

static inline int smb_vecjob_check(const smb_vecjob_t *j)
{
    switch (j->kind) {
    case SMB_VECJOB_WEIGHTED_SUM:
        return smb_weighted_sum_check(j->dst, j->dst_dtype, j->srcs, j->src_dtypes, j->nsrc,
                                      j->count);
    case SMB_VECJOB_AXPY:
        if (j->nsrc != 1)
            return SMB_VECOPS_ENOSRC;
        return smb_axpy_check(j->dst, j->dst_dtype, j->srcs[0], j->src_dtypes[0], j->count);
    case SMB_VECJOB_SCALE:
        return smb_scale_check(j->dst, j->dst_dtype, j->count);
    case SMB_VECJOB_CONVERT:
        if (j->nsrc != 1)
            return SMB_VECOPS_ENOSRC;
        return smb_convert_check(j->dst, j->dst_dtype, j->srcs[0], j->src_dtypes[0], j->count);
    default:
        return SMB_VECOPS_EDTYPE;
    }
}

static inline void smb_vecjob_range(const smb_vecjob_t *j, size_t begin, size_t end)
{
    switch (j->kind) {
    case SMB_VECJOB_WEIGHTED_SUM:
        smb_weighted_sum_range(j->dst, j->dst_dtype, j->srcs, j->src_dtypes, j->weights, j->nsrc,
                               begin, end);
        break;
    case SMB_VECJOB_AXPY:
        smb_axpy_range(j->dst, j->dst_dtype, j->srcs[0], j->src_dtypes[0], j->alpha, begin, end);
        break;
    case SMB_VECJOB_SCALE:
        smb_scale_range(j->dst, j->dst_dtype, j->alpha, begin, end);
        break;
    default:
        smb_convert_range(j->dst, j->dst_dtype, j->srcs[0], j->src_dtypes[0], begin, end);
        break;
    }
}

/* How many parts an operation is cut into on `threads` threads: 1 when it is
   too small to be worth waking anyone, or cannot be split. */
static inline size_t smb_vecjob_parts(const smb_vecjob_t *j, int threads)
{
    size_t parts = j->count / SMB_VECPOOL_MIN_PART;
    size_t most = (size_t)threads * SMB_VECPOOL_PARTS_PER_THREAD;
    if (j->kind == SMB_VECJOB_CONVERT
        && !smb_convert_splittable(j->dst, j->dst_dtype, j->srcs[0], j->src_dtypes[0]))
        return 1;
    if (parts > most)
        parts = most;
    return parts ? parts : 1;
}

/* Claim and run parts of operation `epoch` until none is left; returns how
   many this thread ran.  Also the caller's loop. */
static inline size_t smb_vecpool_claim_and_run(smb_vecpool_t *pool, uint64_t epoch,
                                               const smb_vecjob_t *job, size_t nparts, size_t part)
{
    size_t ran = 0;
    uint64_t word = __atomic_load_n(&pool->claim, __ATOMIC_ACQUIRE);
    for (;;) {
        size_t p = (size_t)(word & ((1u << SMB_VECPOOL_PART_BITS) - 1));
        if (word >> SMB_VECPOOL_PART_BITS != epoch || p >= nparts)
            return ran;
        if (!__atomic_compare_exchange_n(&pool->claim, &word, word + 1, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue;                       /* word now holds the current value */
        size_t begin = p * part, end = p + 1 == nparts ? job->count : (p + 1) * part;
        smb_vecjob_range(job, begin, end);
        ran++;
        word++;
    }
}

static void *smb_vecpool_worker(void *arg)
{
    smb_vecpool_arg_t *a = (smb_vecpool_arg_t *)arg;
    smb_vecpool_t *pool = a->pool;
    uint64_t seen = 0;
    sigset_t all;
    /* signals belong to the server's main thread (its SIGTERM handler) */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    pthread_mutex_lock(&pool->mu);
    for (;;) {
        /* idle wait without timeout: the only events are a new operation and
           stop, and both broadcast `wake` under `mu` */
        while (!pool->stop && pool->epoch == seen)
            pthread_cond_wait(&pool->wake, &pool->mu);
        if (pool->stop)
            break;
        /* job, nparts and part belong to this epoch; a claim only succeeds
           while the claim word still carries it, that is while the caller
           waits for this very operation */
        seen = pool->epoch;
        const smb_vecjob_t *job = pool->job;
        size_t nparts = pool->nparts, part = pool->part;
        pthread_mutex_unlock(&pool->mu);
        size_t ran = smb_vecpool_claim_and_run(pool, seen, job, nparts, part);
        pthread_mutex_lock(&pool->mu);
        if (ran) {
            pool->helpers++;
            pool->finished += ran;
            if (pool->finished == pool->nparts)
                pthread_cond_signal(&pool->done);
        }
    }
    pthread_mutex_unlock(&pool->mu);
    return NULL;
}

/* Stop and join the workers, free the pool; NULL is fine. */
static inline void smb_vecpool_destroy(smb_vecpool_t *pool)
{
    if (!pool)
        return;
    pthread_mutex_lock(&pool->mu);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->nworkers; i++)
        pthread_join(pool->workers[i], NULL);
    pthread_cond_destroy(&pool->done);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->mu);
    pthread_mutex_destroy(&pool->busy);
    free(pool->workers);
    free(pool->args);
    free(pool);
}

/* A pool of `threads` reducing threads: the caller of each operation and
   threads-1 workers started here.  Returns 0 and *out, or an errno value
   (EINVAL for a count outside 1..SMB_VECPOOL_MAX_THREADS, else what calloc,
   pthread_*_init or pthread_create said; nothing is left running then). */
static inline int smb_vecpool_create(int threads, smb_vecpool_t **out)
{
    int rc;
    *out = NULL;
    if (threads < 1 || threads > SMB_VECPOOL_MAX_THREADS)
        return EINVAL;
    /* the instruction-set choice is made once, here, not raced by the workers */
    smb_vecops_isa();
    smb_vecpool_t *pool = (smb_vecpool_t *)calloc(1, sizeof *pool);
    if (!pool)
        return ENOMEM;
    pool->nthreads = threads;
    pool->nparts = 1;
    pool->workers = (pthread_t *)calloc((size_t)threads, sizeof(pthread_t));
    pool->args = (smb_vecpool_arg_t *)calloc((size_t)threads, sizeof(smb_vecpool_arg_t));
    if (!pool->workers || !pool->args) {
        rc = ENOMEM;
        goto fail_alloc;
    }
    if ((rc = pthread_mutex_init(&pool->busy, NULL)) != 0)
        goto fail_alloc;
    if ((rc = pthread_mutex_init(&pool->mu, NULL)) != 0)
        goto fail_mu;
    if ((rc = pthread_cond_init(&pool->wake, NULL)) != 0)
        goto fail_wake;
    if ((rc = pthread_cond_init(&pool->done, NULL)) != 0)
        goto fail_done;
    for (int i = 0; i < threads - 1; i++) {
        pool->args[i].pool = pool;
        pool->args[i].index = i + 1;
        rc = pthread_create(&pool->workers[i], NULL, smb_vecpool_worker, &pool->args[i]);
        if (rc != 0) {
            smb_vecpool_destroy(pool);      /* joins the nworkers already started */
            return rc;
        }
        pool->nworkers = i + 1;
    }
    *out = pool;
    return 0;

fail_done:
    pthread_cond_destroy(&pool->wake);
fail_wake:
    pthread_mutex_destroy(&pool->mu);
fail_mu:
    pthread_mutex_destroy(&pool->busy);
fail_alloc:
    free(pool->workers);
    free(pool->args);
    free(pool);
    return rc;
}

/* Run one operation; *threads_used (may be NULL) says how many threads took
   part.  pool may be NULL: the caller alone.  Returns 0 or a SMB_VECOPS_E* code. */
static inline int smb_vecpool_run(smb_vecpool_t *pool, const smb_vecjob_t *job, int *threads_used)
{
    int rc = smb_vecjob_check(job);
    int used = 1;
    if (threads_used)
        *threads_used = rc == SMB_VECOPS_OK;
    if (rc != SMB_VECOPS_OK || job->count == 0)
        return rc;
    if (pool && pool->nthreads > 1 && smb_vecjob_parts(job, pool->nthreads) > 1
        && pthread_mutex_trylock(&pool->busy) == 0) {
        size_t nparts = smb_vecjob_parts(job, pool->nthreads);
        size_t part = job->count / nparts / SMB_VECPOOL_ALIGN * SMB_VECPOOL_ALIGN;
        uint64_t epoch;
        pthread_mutex_lock(&pool->mu);
        epoch = ++pool->epoch;
        pool->job = job;
        pool->nparts = nparts;
        pool->part = part;
        pool->finished = 0;
        pool->helpers = 0;
        __atomic_store_n(&pool->claim, epoch << SMB_VECPOOL_PART_BITS, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->mu);
        size_t ran = smb_vecpool_claim_and_run(pool, epoch, job, nparts, part);
        pthread_mutex_lock(&pool->mu);
        pool->finished += ran;
        /* no timeout: every part left is being computed by a worker that
           claimed it, on this process's memory, in bounded time */
        while (pool->finished < nparts)
            pthread_cond_wait(&pool->done, &pool->mu);
        used += pool->helpers;
        pool->job = NULL;
        pthread_mutex_unlock(&pool->mu);
        pthread_mutex_unlock(&pool->busy);
        __atomic_fetch_add(&pool->split_ops, 1, __ATOMIC_RELAXED);
    } else {
        smb_vecjob_range(job, 0, job->count);
    }
    if (pool)
        __atomic_fetch_add(&pool->ops, 1, __ATOMIC_RELAXED);
    if (threads_used)
        *threads_used = used;
    return SMB_VECOPS_OK;
}

/* Operations run so far, and how many of them were split over threads
   (readable from any thread while operations run). */
static inline void smb_vecpool_counts(const smb_vecpool_t *pool, unsigned long *ops,
                                      unsigned long *split_ops)
{
    *ops = pool ? __atomic_load_n(&pool->ops, __ATOMIC_RELAXED) : 0;
    *split_ops = pool ? __atomic_load_n(&pool->split_ops, __ATOMIC_RELAXED) : 0;
}

#endif /* EDDIS_SMB_VECPOOL_H */
