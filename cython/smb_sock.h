/* Byte moving for SMB's socket transport: a send queue of frames and
 * non-blocking receive. Framing and dispatch live in smb_core.pyx; this file
 * only knows file descriptors, buffers and errno. */
#ifndef SMB_SOCK_H
#define SMB_SOCK_H

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <pthread.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <netinet/in.h>
#include <netinet/tcp.h>

/* One outgoing frame: an owned head (header and small payload) followed by
 * an optional borrowed tail (arena memory on the server, the caller's buffer
 * on the client) sent without a copy. */
typedef struct smb_frame {
    struct smb_frame *next;
    char *head;
    size_t head_len;
    const char *data;
    size_t data_len;
    size_t sent;
} smb_frame_t;

typedef struct {
    smb_frame_t *first;
    smb_frame_t *last;
} smb_txq_t;

/* Takes ownership of head (freed on failure too). 0, or -1 without memory.
 *
 * A frame without a data tail (a request, a short reply) goes ahead of the
 * data frames at the queue's end that have not started: a get or a reduce
 * never waits behind megabytes of puts queued before it (nor a reduce's
 * completion behind the data of gets). Frames without a tail keep their order
 * among themselves, and a frame that has started is never overtaken. A data
 * frame is ordered before a later request only once it completed, as the
 * one-sided transports order them; every caller waits for its puts first. */
static inline int smb_txq_push(smb_txq_t *q, char *head, size_t head_len,
                               const char *data, size_t data_len)
{
    smb_frame_t *f = (smb_frame_t*)calloc(1, sizeof(*f));
    smb_frame_t *after = NULL, *g;
    if (f == NULL) {
        free(head);
        return -1;
    }
    f->head = head;
    f->head_len = head_len;
    f->data = data;
    f->data_len = data_len;
    if (data_len != 0 || q->last == NULL || q->last->data_len == 0) {
        after = q->last;
    } else {
        for (g = q->first; g != NULL; g = g->next) {
            if (g->sent > 0 || g->data_len == 0) after = g;
        }
    }
    if (after == NULL) {
        f->next = q->first;
        q->first = f;
    } else {
        f->next = after->next;
        after->next = f;
    }
    if (f->next == NULL) q->last = f;
    return 0;
}

static inline void smb_txq_clear(smb_txq_t *q)
{
    smb_frame_t *f = q->first, *next;
    while (f != NULL) {
        next = f->next;
        free(f->head);
        free(f);
        f = next;
    }
    q->first = q->last = NULL;
}

static inline int smb_would_block(int err)
{
    return err == EAGAIN || err == EWOULDBLOCK || err == EINTR;
}

/* Send queued frames until the queue is empty, the socket is full or about
 * `budget` bytes went out (so one large frame does not starve other peers).
 * Returns bytes sent (>= 0), or -1 when the connection failed. */
static inline long smb_txq_flush(int fd, smb_txq_t *q, size_t budget)
{
    long total = 0;
    while (q->first != NULL && (size_t)total < budget) {
        smb_frame_t *f = q->first;
        struct iovec iov[2];
        struct msghdr m;
        int n = 0;
        size_t done = f->sent;
        memset(&m, 0, sizeof(m));
        if (done < f->head_len) {
            iov[n].iov_base = f->head + done;
            iov[n].iov_len = f->head_len - done;
            n++;
            done = 0;
        } else {
            done -= f->head_len;
        }
        if (done < f->data_len) {
            size_t left = f->data_len - done;
            size_t room = budget - (size_t)total;
            iov[n].iov_base = (void*)(f->data + done);
            iov[n].iov_len = left < room ? left : room;
            n++;
        }
        if (n == 0) {
            q->first = f->next;
            if (q->first == NULL) q->last = NULL;
            free(f->head);
            free(f);
            continue;
        }
        m.msg_iov = iov;
        m.msg_iovlen = n;
        ssize_t sent = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (sent < 0) {
            if (smb_would_block(errno)) break;
            return -1;
        }
        f->sent += (size_t)sent;
        total += sent;
        if (f->sent == f->head_len + f->data_len) {
            q->first = f->next;
            if (q->first == NULL) q->last = NULL;
            free(f->head);
            free(f);
        } else if (sent == 0) {
            break;
        }
    }
    return total;
}

/* Non-blocking receive: bytes read (> 0), 0 when nothing is there yet,
 * -1 when the peer closed the connection or it failed. */
static inline long smb_sock_recv(int fd, void *buf, size_t n)
{
    ssize_t got = recv(fd, buf, n, MSG_DONTWAIT);
    if (got > 0) return (long)got;
    if (got == 0) return -1;
    return smb_would_block(errno) ? 0 : -1;
}

/* `unsent`: the most bytes the kernel may hold that are not on the wire yet
 * (TCP_NOTSENT_LOWAT; 0: the kernel's own limit, several MiB), so that a
 * request that overtakes queued data (smb_txq_push) does not wait behind
 * megabytes the kernel took earlier. */
static inline int smb_sock_prepare(int fd, size_t unsent)
{
    int one = 1;
    int lowat = unsent > (size_t)(1 << 30) ? (1 << 30) : (int)unsent;
    int flags = fcntl(fd, F_GETFL, 0);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) return -1;
    /* requests are small and latency-bound; do not wait for Nagle */
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (lowat > 0 && setsockopt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &lowat, sizeof(lowat)) != 0)
        return -1;
    return 0;
}

static inline int smb_pipe_nonblocking(int fds[2])
{
    if (pipe(fds) != 0) return -1;
    fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL, 0) | O_NONBLOCK);
    fcntl(fds[0], F_SETFD, FD_CLOEXEC);
    fcntl(fds[1], F_SETFD, FD_CLOEXEC);
    return 0;
}

/* A count of completions that threads can sleep on: the thread that moves a
 * client's sockets bumps it when replies complete, and a thread whose requests
 * it moves meanwhile sleeps until then instead of spinning on the lock. */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    unsigned long count;
} smb_waker_t;

static inline int smb_waker_init(smb_waker_t *w)
{
    pthread_condattr_t attr;
    int err = pthread_condattr_init(&attr);
    if (err) return err;
    err = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    if (!err) err = pthread_mutex_init(&w->lock, NULL);
    if (!err && (err = pthread_cond_init(&w->cond, &attr)) != 0) pthread_mutex_destroy(&w->lock);
    pthread_condattr_destroy(&attr);
    w->count = 0;
    return err;
}

static inline void smb_waker_destroy(smb_waker_t *w)
{
    pthread_cond_destroy(&w->cond);
    pthread_mutex_destroy(&w->lock);
}

static inline unsigned long smb_waker_count(smb_waker_t *w)
{
    return __atomic_load_n(&w->count, __ATOMIC_ACQUIRE);
}

static inline void smb_waker_bump(smb_waker_t *w)
{
    pthread_mutex_lock(&w->lock);
    __atomic_store_n(&w->count, w->count + 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&w->cond);
    pthread_mutex_unlock(&w->lock);
}

/* Sleep until the count differs from `seen` or `timeout_ms` passed: 1 if it
 * moved, 0 if the time ran out. */
static inline int smb_waker_wait(smb_waker_t *w, unsigned long seen, int timeout_ms)
{
    struct timespec until;
    int moved;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) { until.tv_sec += 1; until.tv_nsec -= 1000000000L; }
    pthread_mutex_lock(&w->lock);
    while (w->count == seen && pthread_cond_timedwait(&w->cond, &w->lock, &until) != ETIMEDOUT)
        ;
    moved = w->count != seen;
    pthread_mutex_unlock(&w->lock);
    return moved;
}

#endif
