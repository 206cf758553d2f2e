/*
 * A persistent pool of threads for the SMB server's vector operations.
 *
 * Why: the server reduces every bucket of every rank of a node; on one thread
 * that reduction becomes the node's bottleneck once several ranks push
 * gradients, while DDP's ring spreads the same additions over all ranks.
 *
 * How: the thread that asks for an operation (the server's request loop) cuts
 * the element range into contiguous parts, one per thread, wakes the workers,
 * runs part 0 itself and waits until the workers have finished theirs.  Part
 * boundaries are multiples of SMB_VECPOOL_ALIGN elements, so no two threads
 * write into the same cache line for any dtype.  Each element's arithmetic is
 * the same whoever computes it (smb_vecops.h: no FMA, per-element sums), so
 * the result is bit-identical to one thread's.
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
    pthread_cond_t done;            /* caller: remaining reached 0 */
    int stop;
    unsigned long epoch;
    const smb_vecjob_t *job;
    size_t nparts;
    size_t part;                    /* elements per part but the last */
    int remaining;                  /* worker parts of this epoch not finished */
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
    if (j->kind == SMB_VECJOB_CONVERT
        && !smb_convert_splittable(j->dst, j->dst_dtype, j->srcs[0], j->src_dtypes[0]))
        return 1;
    if (parts > (size_t)threads)
        parts = (size_t)threads;
    return parts ? parts : 1;
}

/* elements [begin, end) of part p */
static inline void smb_vecpool_bounds(size_t count, size_t nparts, size_t part, size_t p,
                                      size_t *begin, size_t *end)
{
    *begin = p * part;
    *end = p + 1 == nparts ? count : (p + 1) * part;
}

static void *smb_vecpool_worker(void *arg)
{
    smb_vecpool_arg_t *a = (smb_vecpool_arg_t *)arg;
    smb_vecpool_t *pool = a->pool;
    size_t me = (size_t)a->index;
    unsigned long seen = 0;
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
        seen = pool->epoch;
        if (me >= pool->nparts)
            continue;                       /* this operation has fewer parts */
        const smb_vecjob_t *job = pool->job;
        size_t nparts = pool->nparts, part = pool->part, begin, end;
        pthread_mutex_unlock(&pool->mu);
        smb_vecpool_bounds(job->count, nparts, part, me, &begin, &end);
        smb_vecjob_range(job, begin, end);
        pthread_mutex_lock(&pool->mu);
        if (--pool->remaining == 0)
            pthread_cond_signal(&pool->done);
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

/* Run one operation; *threads_used (may be NULL) says on how many threads.
   pool may be NULL: the caller alone.  Returns 0 or a SMB_VECOPS_E* code. */
static inline int smb_vecpool_run(smb_vecpool_t *pool, const smb_vecjob_t *job, int *threads_used)
{
    int rc = smb_vecjob_check(job);
    size_t nparts = 1, part = 0, begin, end;
    if (threads_used)
        *threads_used = rc == SMB_VECOPS_OK;
    if (rc != SMB_VECOPS_OK || job->count == 0)
        return rc;
    if (pool && pool->nthreads > 1 && smb_vecjob_parts(job, pool->nthreads) > 1
        && pthread_mutex_trylock(&pool->busy) == 0) {
        nparts = smb_vecjob_parts(job, pool->nthreads);
        part = job->count / nparts / SMB_VECPOOL_ALIGN * SMB_VECPOOL_ALIGN;
        pthread_mutex_lock(&pool->mu);
        pool->job = job;
        pool->nparts = nparts;
        pool->part = part;
        pool->remaining = (int)nparts - 1;
        pool->epoch++;
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->mu);
        smb_vecpool_bounds(job->count, nparts, part, 0, &begin, &end);
        smb_vecjob_range(job, begin, end);
        pthread_mutex_lock(&pool->mu);
        /* no timeout: the workers only compute on this process's memory and
           each finishes its part in bounded time */
        while (pool->remaining > 0)
            pthread_cond_wait(&pool->done, &pool->mu);
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
        *threads_used = (int)nparts;
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
