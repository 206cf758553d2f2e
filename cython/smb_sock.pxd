# Declarations of cython/smb_sock.h, the socket transport's send queue and receive (no logic here).
cdef extern from "smb_sock.h" nogil:
    ctypedef struct smb_frame_t:
        pass

    ctypedef struct smb_txq_t:
        smb_frame_t *first
        smb_frame_t *last

    int smb_txq_push(smb_txq_t *q, char *head, size_t head_len, const char *data, size_t data_len)
    void smb_txq_clear(smb_txq_t *q)
    long smb_txq_flush(int fd, smb_txq_t *q, size_t budget)
    long smb_sock_recv(int fd, void *buf, size_t n)
    int smb_sock_prepare(int fd, size_t unsent)
    int smb_pipe_nonblocking(int fds[2])

    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    enum: POLLIN
    enum: POLLOUT
    enum: POLLERR
    enum: POLLHUP
    enum: POLLNVAL

    int shutdown(int fd, int how)
    enum: SHUT_RDWR

    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_init(pthread_mutex_t *m, void *attr)
    int pthread_mutex_destroy(pthread_mutex_t *m)
    int pthread_mutex_lock(pthread_mutex_t *m)
    int pthread_mutex_trylock(pthread_mutex_t *m)
    int pthread_mutex_unlock(pthread_mutex_t *m)

    ctypedef struct smb_waker_t:
        pass
    int smb_waker_init(smb_waker_t *w)
    void smb_waker_destroy(smb_waker_t *w)
    unsigned long smb_waker_count(smb_waker_t *w)
    void smb_waker_bump(smb_waker_t *w)
    int smb_waker_wait(smb_waker_t *w, unsigned long seen, int timeout_ms)
