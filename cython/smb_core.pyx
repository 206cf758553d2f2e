# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Native SMB core over UCX (UCP API): the server's request loop and the client's
transfers. Python policy (names, allocation, barriers, reductions) lives in
eddis.smb; this module moves bytes and runs the hot requests without the GIL.

Wire format: every request and reply is one UCP active message whose data is a
``smb_hdr_t`` followed by an op-specific payload. Requests go to AM id
``AM_REQUEST`` with ``UCP_AM_SEND_FLAG_REPLY`` so the server learns the endpoint
to answer on; replies go to ``AM_REPLY``. The first request on a connection must
be HELLO carrying the job token; anything else before it is refused and the
connection closed.
"""
from libc.stdint cimport uint8_t, uint16_t, int16_t, uint32_t, int32_t, uint64_t, int64_t, uintptr_t
from libc.stdlib cimport malloc, free, calloc, realloc
from libc.string cimport memcpy, memset, strlen, memcmp
from libc.stdio cimport FILE, fclose
from posix.mman cimport (mmap, munmap, shm_open, shm_unlink, madvise, PROT_READ, PROT_WRITE,
                         MAP_SHARED, MAP_FAILED, MADV_HUGEPAGE)
from posix.fcntl cimport O_RDWR, O_CREAT, O_EXCL, open as open_fd
from posix.unistd cimport ftruncate, close
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE, PyBUF_ANY_CONTIGUOUS
cimport libucp as ucp
from libucp cimport ucs_status_t, ucs_status_ptr_t
cimport smb_vecops as vec
cimport smb_vecpool as vp
cimport smb_sock as sk

import errno as _errno
import os as _os
import threading as _threading

from eddis import errors as _errors

# ------------------------------------------------------------------ C helpers
cdef extern from *:
    """
    #include <poll.h>
    #include <time.h>
    #include <sched.h>
    #include <errno.h>
    #include <stdio.h>
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
    static inline int smb_poll_fd(int fd, int ms) {
        struct pollfd p; p.fd = fd; p.events = POLLIN; p.revents = 0;
        return poll(&p, 1, ms);
    }
    static inline void smb_pause(unsigned idle) {
        /* Spin briefly, then yield, then sleep up to 200 us: low latency for
           quick replies without burning a shared core on long waits. */
        if (idle < 64) return;
        if (idle < 256) { sched_yield(); return; }
        struct timespec ts = {0, idle < 1024 ? 20000 : 200000};
        nanosleep(&ts, NULL);
    }
    static inline int smb_errno(void) { return errno; }
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
    static FILE *smb_memstream(char **buf, size_t *len) { return open_memstream(buf, len); }
    """
    int smb_cas_int(int *p, int expected, int desired) nogil
    int smb_load_int(const int *p) nogil
    void smb_store_int(int *p, int v) nogil
    int smb_fetch_add_int(int *p, int v) nogil
    int64_t smb_fetch_add64(int64_t *p, int64_t v) nogil
    int64_t smb_cas64(int64_t *p, int64_t expected, int64_t desired) nogil
    int64_t smb_load64(const int64_t *p) nogil
    void smb_store64(int64_t *p, int64_t v) nogil
    void smb_store_u32(uint32_t *p, uint32_t v) nogil
    uint32_t smb_load_u32(const uint32_t *p) nogil
    double smb_now() nogil
    int smb_poll_fd(int fd, int ms) nogil
    void smb_pause(unsigned idle) nogil
    int smb_errno() nogil
    int smb_memfd_hugetlb(const char *name) nogil
    enum: SMB_MADV_POPULATE_WRITE
    FILE *smb_memstream(char **buf, size_t *len) nogil

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

# ------------------------------------------------------------------ protocol
DEF SMB_MAGIC = 0x534D4231        # "SMB1"
DEF AM_REQUEST = 11
DEF AM_REPLY = 12
DEF MAX_CONNS = 1024
DEF MAX_REGIONS = 65536
DEF REPLY_SLOTS = 8192
DEF MAX_VEC_SOURCES = 1024
# The arena starts with one uint32 per region slot: the generation of the region
# living there (0: none). Same-node clients check it before touching mapped
# memory, so a handle to a freed region never reaches its successor.
DEF GEN_TABLE_BYTES = MAX_REGIONS * 4
GEN_TABLE_SIZE = GEN_TABLE_BYTES

cpdef enum SmbOp:
    OP_HELLO = 1
    OP_COUNTER = 2
    OP_VECOP = 3
    OP_CONTROL = 4
    OP_PUT = 5             # socket transport: data into a region, checked by the server
    OP_GET = 6             # socket transport: data out of a region, checked by the server

cpdef enum CounterOp:
    COUNTER_FETCH_ADD = 0
    COUNTER_COMPARE_SWAP = 1
    COUNTER_READ = 2

cpdef enum VecOp:
    VEC_WEIGHTED_SUM = 0
    VEC_AXPY = 1
    VEC_SCALE = 2
    VEC_COPY = 3

# the op codes as plain module-level ints for the Python layer
globals().update({m.name: int(m) for e in (SmbOp, CounterOp, VecOp) for m in e})

# dtype codes shared with the vector kernels (0..3) plus raw integer regions
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3, "int64": 4, "uint8": 5}
ITEMSIZES = {0: 4, 1: 2, 2: 2, 3: 8, 4: 8, 5: 1}

cdef packed struct smb_hdr_t:
    uint32_t magic
    uint16_t op
    int16_t status
    uint32_t length        # payload bytes after the header
    uint32_t reserved
    uint64_t req_id

cdef packed struct put_desc_t:     # OP_PUT payload head; the data follows
    uint32_t region
    uint32_t reserved
    uint64_t offset        # bytes from the region's start

cdef packed struct get_desc_t:     # OP_GET payload; the reply carries nbytes of data
    uint32_t region
    uint32_t reserved
    uint64_t offset
    uint64_t nbytes

# receive phases of a socket connection
DEF RX_HEADER = 0
DEF RX_BODY = 1
DEF RX_DESC = 2
DEF RX_DATA = 3
DEF SOCK_MAX_BODY = 64 << 20       # largest request other than a put (control, vector ops)
DEF SOCK_BUDGET = 4 << 20          # bytes one connection may move per pass of the loop
DEF SOCK_SCRATCH = 65536

cdef struct sock_rx_t:
    int phase
    smb_hdr_t hdr
    size_t got             # bytes of the header or descriptor read so far
    put_desc_t desc
    char *body             # a request's payload (owned)
    char *dest             # where incoming data lands (NULL: discarded)
    size_t remaining
    uint32_t region        # server: the put's region, re-checked while data arrives
    int status             # server: the put's outcome
    const char *error
    int slot               # client: reply slot being filled, or -1

cdef packed struct counter_req_t:
    uint32_t region
    uint32_t kind
    uint64_t index
    int64_t a
    int64_t b

cdef packed struct vec_req_t:
    uint32_t kind
    uint32_t nsrc
    uint32_t dst_region
    uint32_t dst_slot
    uint64_t start
    uint64_t count
    double alpha

cdef packed struct vec_src_t:
    uint32_t region
    uint32_t slot
    double weight


# what eddis.smb.protocol must agree with (tests/test_smb_protocol.py checks it)
WIRE_MAGIC = SMB_MAGIC
WIRE_SIZES = {"header": sizeof(smb_hdr_t), "counter_request": sizeof(counter_req_t),
              "vec_request": sizeof(vec_req_t), "vec_source": sizeof(vec_src_t),
              "put_desc": sizeof(put_desc_t), "get_desc": sizeof(get_desc_t)}
WIRE_STATUS = {"no_memory": ucp.UCS_ERR_EXCEEDS_LIMIT, "invalid": ucp.UCS_ERR_INVALID_PARAM,
               "no_elem": ucp.UCS_ERR_NO_ELEM, "bounds": ucp.UCS_ERR_OUT_OF_RANGE,
               "rejected": ucp.UCS_ERR_REJECTED}


cdef inline ucs_status_t _ptr_status(ucs_status_ptr_t p) noexcept nogil:
    if p == NULL:
        return ucp.UCS_OK
    if ucp.UCS_PTR_IS_ERR(p):
        return ucp.UCS_PTR_STATUS(p)
    return ucp.UCS_INPROGRESS


cdef str _status_text(ucs_status_t status):
    return (<bytes>ucp.ucs_status_string(status)).decode()


cdef int CHKERR(ucs_status_t status, str what) except -1:
    """Raise the eddis.errors exception for a failed UCX call."""
    if status == ucp.UCS_OK or status == ucp.UCS_INPROGRESS:
        return 0
    raise _errors.from_ucs_status(status, f"{what}: {_status_text(status)}")


def status_text(int status):
    """UCX's text for a status code."""
    return _status_text(status)


def ucx_version():
    """The version string of the UCX library this process runs with."""
    return (<bytes>ucp.ucp_get_version_string()).decode()


def ucx_transports():
    """Transports and devices UCX can use here: list of {"transport", "device"}."""
    cdef ucp.ucp_config_t *config = NULL
    cdef ucp.ucp_params_t params
    cdef ucp.ucp_context_h context = NULL
    cdef char *text = NULL
    cdef size_t length = 0
    cdef FILE *stream
    CHKERR(ucp.ucp_config_read(NULL, NULL, &config), "ucp_config_read")
    params.field_mask = ucp.UCP_PARAM_FIELD_FEATURES
    params.features = ucp.UCP_FEATURE_RMA | ucp.UCP_FEATURE_AM
    status = ucp.ucp_init(&params, config, &context)
    ucp.ucp_config_release(config)
    CHKERR(status, "ucp_init")
    stream = smb_memstream(&text, &length)
    if stream == NULL:
        ucp.ucp_cleanup(context)
        raise _errors.from_errno(smb_errno(), "open_memstream failed")
    ucp.ucp_context_print_info(context, stream)
    fclose(stream)
    ucp.ucp_cleanup(context)
    report = PyBytes_FromStringAndSize(text, length).decode(errors="replace")
    free(text)
    found = []
    for line in report.splitlines():
        # "#      resource 1  :  md 1  dev 1  flags -- tcp/lo"
        if "resource" in line and "--" in line:
            name = line.rsplit("--", 1)[1].strip()
            transport, _, device = name.partition("/")
            found.append({"transport": transport, "device": device})
    return found


# ================================================================== server
cdef enum conn_state_t:
    CONN_FREE = 0
    CONN_OPEN = 1          # connected, HELLO not yet seen
    CONN_AUTH = 2          # token checked
    CONN_REJECT = 3        # close after flushing the refusal
    CONN_FAILED = 4        # transport error: force close
    CONN_CLOSING = 5       # close request in flight

cdef struct server_conn_t:
    ucp.ucp_ep_h ep
    int state
    uint32_t gen
    void *close_req
    void *server            # back pointer for the error callback
    int index
    double opened           # when the connection arrived (HELLO deadline)
    int fd                  # socket transport: the proven peer's socket (-1: a UCX endpoint)
    sock_rx_t rx
    sk.smb_txq_t txq

cdef struct region_t:
    int valid
    uint32_t gen
    int dtype
    int itemsize
    uint64_t offset         # in the arena
    uint64_t nbytes
    uint64_t slots
    uint64_t length         # elements per slot on this server
    ucp.ucp_mem_h memh

cdef struct server_t:
    ucp.ucp_context_h context
    ucp.ucp_worker_h worker
    ucp.ucp_listener_h listener
    int efd
    volatile int stop
    char *arena
    uint64_t arena_size
    char token[256]
    size_t token_len
    char *hello_reply
    size_t hello_reply_len
    void *py_handler        # PyObject*: control requests
    server_conn_t conns[MAX_CONNS]
    int conn_hi
    int pending_close
    region_t *regions
    uint64_t requests
    uint64_t refused
    double hello_timeout    # seconds a new connection has to authenticate
    vp.smb_vecpool_t *vecpool   # reduction threads (NULL before start: the caller alone)
    int reduce_threads
    int adopt_fds[2]        # socket transport: proven sockets handed over by the handshake
    sk.pollfd *pfds
    int *pfd_conns
    char *scratch           # sink for data of a refused put


cdef void _free_cb(void *request, ucs_status_t status, void *user_data) noexcept nogil:
    free(user_data)
    ucp.ucp_request_free(request)


cdef int server_send_reply(server_t *st, int ci, uint64_t req_id, int status,
                           const void *payload, size_t plen) noexcept nogil:
    """Send a reply to connection ci; the buffer lives until UCX is done with it."""
    cdef server_conn_t *c = &st.conns[ci]
    if c.state != CONN_AUTH and c.state != CONN_OPEN and c.state != CONN_REJECT:
        return -1                           # the client is gone: drop the reply
    cdef size_t total = sizeof(smb_hdr_t) + plen
    cdef char *buf = <char*>malloc(total)
    if buf == NULL:
        return -1
    cdef smb_hdr_t *h = <smb_hdr_t*>buf
    h.magic = SMB_MAGIC
    h.op = 0
    h.status = <int16_t>status
    h.length = <uint32_t>plen
    h.reserved = 0
    h.req_id = req_id
    if plen:
        memcpy(buf + sizeof(smb_hdr_t), payload, plen)
    if c.fd >= 0:
        return sk.smb_txq_push(&c.txq, buf, total, NULL, 0)
    cdef ucp.ucp_request_param_t param
    param.op_attr_mask = (ucp.UCP_OP_ATTR_FIELD_CALLBACK | ucp.UCP_OP_ATTR_FIELD_USER_DATA
                          | ucp.UCP_OP_ATTR_FIELD_FLAGS)
    param.flags = ucp.UCP_AM_SEND_FLAG_EAGER
    param.cb.send = _free_cb
    param.user_data = buf
    cdef ucs_status_ptr_t p = ucp.ucp_am_send_nbx(c.ep, AM_REPLY, NULL, 0, buf, total, &param)
    if not ucp.UCS_PTR_IS_PTR(p):
        free(buf)
        return 0 if p == NULL else -1
    return 0


cdef int server_reply_error(server_t *st, int ci, uint64_t req_id, int status,
                            const char *message) noexcept nogil:
    st.refused += 1
    return server_send_reply(st, ci, req_id, status, message, strlen(message))


cdef int find_conn(server_t *st, ucp.ucp_ep_h ep) noexcept nogil:
    cdef int i
    for i in range(st.conn_hi):
        if st.conns[i].ep == ep and st.conns[i].state != CONN_FREE:
            return i
    return -1


cdef region_t *get_region(server_t *st, uint32_t rid) noexcept nogil:
    cdef uint32_t idx = rid & 0xFFFF
    cdef region_t *r = &st.regions[idx]
    if not r.valid or r.gen != (rid >> 16):
        return NULL
    return r


cdef void _server_ep_error(void *arg, ucp.ucp_ep_h ep, ucs_status_t status) noexcept nogil:
    cdef server_conn_t *c = <server_conn_t*>arg
    cdef server_t *st = <server_t*>c.server
    if c.state != CONN_FREE and c.state != CONN_CLOSING:
        c.state = CONN_FAILED
        st.pending_close = 1


cdef void _server_conn_request(ucp.ucp_conn_request_h request, void *arg) noexcept nogil:
    cdef server_t *st = <server_t*>arg
    cdef int i, slot = -1
    for i in range(MAX_CONNS):
        if st.conns[i].state == CONN_FREE:
            slot = i
            break
    if slot < 0 or st.stop:
        ucp.ucp_listener_reject(st.listener, request)
        return
    cdef server_conn_t *c = &st.conns[slot]
    cdef ucp.ucp_ep_params_t params
    params.field_mask = (ucp.UCP_EP_PARAM_FIELD_CONN_REQUEST | ucp.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                         | ucp.UCP_EP_PARAM_FIELD_ERR_HANDLER)
    params.conn_request = request
    params.err_mode = ucp.UCP_ERR_HANDLING_MODE_PEER
    params.err_handler.cb = _server_ep_error
    params.err_handler.arg = c
    c.server = st
    c.index = slot
    c.fd = -1
    c.close_req = NULL
    c.opened = smb_now()
    c.state = CONN_OPEN
    if ucp.ucp_ep_create(st.worker, &params, &c.ep) != ucp.UCS_OK:
        c.state = CONN_FREE
        return
    if slot + 1 > st.conn_hi:
        st.conn_hi = slot + 1


cdef void server_close_conns(server_t *st, bint all_conns) noexcept nogil:
    """Close endpoints marked for closing; finish closes in flight."""
    cdef int i
    cdef server_conn_t *c
    cdef ucp.ucp_request_param_t param
    cdef ucs_status_ptr_t p
    st.pending_close = 0
    for i in range(st.conn_hi):
        c = &st.conns[i]
        if c.state == CONN_FREE:
            continue
        if all_conns and c.state in (CONN_OPEN, CONN_AUTH):
            c.state = CONN_REJECT
        if c.state == CONN_REJECT or c.state == CONN_FAILED:
            param.op_attr_mask = ucp.UCP_OP_ATTR_FIELD_FLAGS
            # A refused client gets its error reply flushed first; a failed one cannot.
            param.flags = ucp.UCP_EP_CLOSE_FLAG_FORCE if c.state == CONN_FAILED else 0
            p = ucp.ucp_ep_close_nbx(c.ep, &param)
            if ucp.UCS_PTR_IS_PTR(p):
                c.close_req = p
                c.state = CONN_CLOSING
                st.pending_close = 1
            else:
                c.state = CONN_FREE
                c.gen += 1
        elif c.state == CONN_CLOSING:
            if ucp.ucp_request_check_status(c.close_req) != ucp.UCS_INPROGRESS:
                ucp.ucp_request_free(c.close_req)
                c.close_req = NULL
                c.state = CONN_FREE
                c.gen += 1
            else:
                st.pending_close = 1


cdef int check_range(region_t *r, uint32_t slot, uint64_t start, uint64_t count) noexcept nogil:
    if slot >= r.slots or start > r.length or count > r.length - start:
        return -1
    return 0


cdef const char *run_vecop(server_t *st, const vec_req_t *q, const vec_src_t *srcs,
                           int *status, int *threads_used) noexcept nogil:
    """Validate and run one vector operation on the server's own memory.

    Returns NULL on success, else a message (and *status) for the error reply;
    *threads_used says on how many threads it ran."""
    cdef region_t *dst = get_region(st, q.dst_region)
    cdef vp.smb_vecjob_t job
    cdef region_t *r
    cdef uint32_t i
    cdef int rc = 0
    cdef const void *ptrs[MAX_VEC_SOURCES]
    cdef int dtypes[MAX_VEC_SOURCES]
    cdef double weights[MAX_VEC_SOURCES]
    status[0] = ucp.UCS_ERR_NO_ELEM
    if dst == NULL:
        return b"vector op: unknown destination region"
    status[0] = ucp.UCS_ERR_INVALID_PARAM
    if dst.dtype > 3:
        return b"vector op: destination is not a float32/float16/bfloat16/float64 region"
    if q.nsrc > MAX_VEC_SOURCES:
        return b"vector op: too many sources (at most 1024)"
    status[0] = ucp.UCS_ERR_OUT_OF_RANGE
    if check_range(dst, q.dst_slot, q.start, q.count) != 0:
        return b"vector op: destination slot/range outside the region"
    for i in range(q.nsrc):
        r = get_region(st, srcs[i].region)
        if r == NULL:
            status[0] = ucp.UCS_ERR_NO_ELEM
            return b"vector op: unknown source region"
        if r.dtype > 3:
            status[0] = ucp.UCS_ERR_INVALID_PARAM
            return b"vector op: source is not a float region"
        if check_range(r, srcs[i].slot, q.start, q.count) != 0:
            status[0] = ucp.UCS_ERR_OUT_OF_RANGE
            return b"vector op: source slot/range outside the region"
        ptrs[i] = st.arena + r.offset + (srcs[i].slot * r.length + q.start) * r.itemsize
        dtypes[i] = r.dtype
        weights[i] = srcs[i].weight
    job.dst = st.arena + dst.offset + (q.dst_slot * dst.length + q.start) * dst.itemsize
    job.dst_dtype = dst.dtype
    job.srcs = ptrs
    job.src_dtypes = dtypes
    job.weights = weights
    job.nsrc = q.nsrc
    job.alpha = q.alpha
    job.count = q.count
    status[0] = ucp.UCS_ERR_INVALID_PARAM
    if q.kind == VEC_WEIGHTED_SUM:
        if q.nsrc < 1:
            return b"weighted_sum: needs at least one source"
        job.kind = vp.SMB_VECJOB_WEIGHTED_SUM
    elif q.kind == VEC_AXPY:
        if q.nsrc != 1:
            return b"axpy: needs exactly one source"
        job.kind = vp.SMB_VECJOB_AXPY
    elif q.kind == VEC_SCALE:
        job.kind = vp.SMB_VECJOB_SCALE
    elif q.kind == VEC_COPY:
        if q.nsrc != 1:
            return b"copy: needs exactly one source"
        job.kind = vp.SMB_VECJOB_CONVERT
    else:
        return b"vector op: unknown kind"
    rc = vp.smb_vecpool_run(st.vecpool, &job, threads_used)
    if rc != 0:
        return b"vector op: kernel refused the dtype"
    status[0] = ucp.UCS_OK
    return NULL


cdef void handle_counter(server_t *st, int ci, uint64_t req_id, const char *payload,
                         size_t plen) noexcept nogil:
    cdef counter_req_t q
    cdef region_t *r
    cdef int64_t *p
    cdef int64_t old
    if plen != sizeof(counter_req_t):
        server_reply_error(st, ci, req_id, ucp.UCS_ERR_INVALID_PARAM, b"counter: malformed request")
        return
    memcpy(&q, payload, sizeof(q))
    r = get_region(st, q.region)
    if r == NULL:
        server_reply_error(st, ci, req_id, ucp.UCS_ERR_NO_ELEM, b"counter: unknown counter")
        return
    if r.dtype != 4 or q.index >= r.length * r.slots:
        server_reply_error(st, ci, req_id, ucp.UCS_ERR_OUT_OF_RANGE,
                           b"counter: index outside an int64 region")
        return
    # The server applies the op with CPU atomics on its own memory, the same
    # instructions a same-node client uses on the mapped arena, so both paths
    # stay coherent. NIC (UCX AMO) atomics are not atomic with respect to CPU
    # atomics on the target, which is why counters do not use them.
    p = <int64_t*>(st.arena + r.offset) + q.index
    if q.kind == COUNTER_FETCH_ADD:
        old = smb_fetch_add64(p, q.a)
    elif q.kind == COUNTER_COMPARE_SWAP:
        old = smb_cas64(p, q.a, q.b)
    elif q.kind == COUNTER_READ:
        old = smb_load64(p)
    else:
        server_reply_error(st, ci, req_id, ucp.UCS_ERR_INVALID_PARAM, b"counter: unknown op")
        return
    server_send_reply(st, ci, req_id, 0, &old, sizeof(old))


cdef void handle_vecop(server_t *st, int ci, uint64_t req_id, const char *payload,
                       size_t plen) noexcept nogil:
    cdef vec_req_t q
    cdef int status = 0
    cdef int threads_used = 0
    cdef const char *err
    if plen < sizeof(vec_req_t):
        server_reply_error(st, ci, req_id, ucp.UCS_ERR_INVALID_PARAM, b"vector op: malformed request")
        return
    memcpy(&q, payload, sizeof(q))
    if q.nsrc > MAX_VEC_SOURCES or plen != sizeof(vec_req_t) + q.nsrc * sizeof(vec_src_t):
        server_reply_error(st, ci, req_id, ucp.UCS_ERR_INVALID_PARAM, b"vector op: malformed request")
        return
    err = run_vecop(st, &q, <const vec_src_t*>(payload + sizeof(vec_req_t)), &status,
                    &threads_used)
    if err != NULL:
        server_reply_error(st, ci, req_id, status, err)
    else:
        server_send_reply(st, ci, req_id, 0, NULL, 0)


cdef void handle_control(server_t *st, int ci, uint64_t req_id, const char *payload,
                         size_t plen) noexcept nogil:
    with gil:
        try:
            handler = <object>st.py_handler
            conn_id = (st.conns[ci].gen << 16) | ci
            result = handler(conn_id, req_id, PyBytes_FromStringAndSize(payload, plen))
            if result is not None:
                status, data = result
                server_send_reply(st, ci, req_id, status, <const char*>data, len(data))
        except BaseException as exc:
            message = f"server error: {exc!r}".encode()
            server_reply_error(st, ci, req_id, ucp.UCS_ERR_INVALID_PARAM, message)


cdef ucs_status_t _server_am_request(void *arg, const void *header, size_t header_length,
                                     void *data, size_t length,
                                     const ucp.ucp_am_recv_param_t *param) noexcept nogil:
    cdef server_t *st = <server_t*>arg
    cdef int ci = -1
    if param.recv_attr & ucp.UCP_AM_RECV_ATTR_FIELD_REPLY_EP:
        ci = find_conn(st, param.reply_ep)
    if ci < 0:
        return ucp.UCS_OK                   # no way to answer: drop
    st.requests += 1
    cdef server_conn_t *c = &st.conns[ci]
    cdef smb_hdr_t h
    if param.recv_attr & ucp.UCP_AM_RECV_ATTR_FLAG_RNDV or length < sizeof(smb_hdr_t):
        server_reply_error(st, ci, 0, ucp.UCS_ERR_INVALID_PARAM, b"malformed or oversized request")
        return ucp.UCS_OK
    memcpy(&h, data, sizeof(h))
    cdef const char *payload = <const char*>data + sizeof(smb_hdr_t)
    cdef size_t plen = length - sizeof(smb_hdr_t)
    if h.magic != SMB_MAGIC or h.length != plen:
        server_reply_error(st, ci, h.req_id, ucp.UCS_ERR_INVALID_PARAM, b"malformed request header")
        return ucp.UCS_OK
    if c.state != CONN_AUTH:
        if c.state != CONN_OPEN:
            return ucp.UCS_OK               # being closed already: drop
        if h.op == OP_HELLO and plen == st.token_len \
                and memcmp(payload, st.token, plen) == 0:
            c.state = CONN_AUTH
            server_send_reply(st, ci, h.req_id, 0, st.hello_reply, st.hello_reply_len)
        else:
            server_reply_error(st, ci, h.req_id, ucp.UCS_ERR_REJECTED,
                               b"connection refused: wrong or missing job token "
                               b"(use the token file of this job's run directory)")
            c.state = CONN_REJECT
            st.pending_close = 1
        return ucp.UCS_OK
    dispatch_request(st, ci, &h, payload, plen)
    return ucp.UCS_OK


cdef void dispatch_request(server_t *st, int ci, const smb_hdr_t *h, const char *payload,
                           size_t plen) noexcept nogil:
    """Run one request of a proven connection (either transport)."""
    if h.op == OP_COUNTER:
        handle_counter(st, ci, h.req_id, payload, plen)
    elif h.op == OP_VECOP:
        handle_vecop(st, ci, h.req_id, payload, plen)
    elif h.op == OP_CONTROL:
        handle_control(st, ci, h.req_id, payload, plen)
    elif h.op == OP_HELLO:
        server_send_reply(st, ci, h.req_id, 0, st.hello_reply, st.hello_reply_len)
    elif h.op == OP_GET and st.conns[ci].fd >= 0:
        handle_get(st, ci, h.req_id, payload, plen)
    else:
        server_reply_error(st, ci, h.req_id, ucp.UCS_ERR_INVALID_PARAM, b"unknown request op")


cdef region_t *checked_span(server_t *st, uint32_t rid, uint64_t offset, uint64_t nbytes,
                            int *status, const char **error) noexcept nogil:
    """The region a data request addresses, or NULL with the refusal: a region that
    was freed (its generation moved on) is gone, never the region now in its place."""
    cdef region_t *r = get_region(st, rid)
    if r == NULL:
        status[0] = ucp.UCS_ERR_NO_ELEM
        error[0] = b"no such region: it was freed (a stale pool handle?); look the pool up again"
        return NULL
    if offset > r.nbytes or nbytes > r.nbytes - offset:
        status[0] = ucp.UCS_ERR_OUT_OF_RANGE
        error[0] = b"data request outside the region"
        return NULL
    return r


cdef void handle_get(server_t *st, int ci, uint64_t req_id, const char *payload,
                     size_t plen) noexcept nogil:
    cdef get_desc_t q
    cdef int status = 0
    cdef const char *error = NULL
    cdef region_t *r
    cdef char *head
    cdef smb_hdr_t *h
    if plen != sizeof(get_desc_t):
        server_reply_error(st, ci, req_id, ucp.UCS_ERR_INVALID_PARAM, b"get: malformed request")
        return
    memcpy(&q, payload, sizeof(q))
    r = checked_span(st, q.region, q.offset, q.nbytes, &status, &error)
    if r == NULL:
        server_reply_error(st, ci, req_id, status, error)
        return
    if q.nbytes >> 32:
        server_reply_error(st, ci, req_id, ucp.UCS_ERR_INVALID_PARAM, b"get: at most 4 GiB per request")
        return
    head = <char*>malloc(sizeof(smb_hdr_t))
    if head == NULL:
        return
    h = <smb_hdr_t*>head
    h.magic = SMB_MAGIC
    h.op = 0
    h.status = 0
    h.length = <uint32_t>q.nbytes
    h.reserved = 0
    h.req_id = req_id
    # the arena itself is the reply's tail: no copy
    sk.smb_txq_push(&st.conns[ci].txq, head, sizeof(smb_hdr_t), st.arena + r.offset + q.offset, q.nbytes)


cdef void drop_silent_conns(server_t *st, double now) noexcept nogil:
    """Close connections that sent no HELLO in time: they hold a slot and prove nothing."""
    cdef int i
    for i in range(st.conn_hi):
        if st.conns[i].state == CONN_OPEN and now - st.conns[i].opened > st.hello_timeout:
            st.conns[i].state = CONN_REJECT
            st.refused += 1
            st.pending_close = 1


cdef void server_loop(server_t *st) noexcept nogil:
    cdef unsigned n
    cdef ucs_status_t s
    cdef double now, last_sweep = smb_now(), last_busy = 0
    while not st.stop:
        n = ucp.ucp_worker_progress(st.worker)
        now = smb_now()
        if now - last_sweep > 1.0:
            last_sweep = now
            drop_silent_conns(st, now)
        if st.pending_close:
            server_close_conns(st, False)
        if n != 0:
            last_busy = now
            continue
        if now - last_busy < 50e-6:
            # Requests come in bursts (buckets, counters): poll a little longer
            # before sleeping, which saves a wakeup per request of a burst.
            continue
        s = ucp.ucp_worker_arm(st.worker)
        if s == ucp.UCS_OK:
            # Bounded sleep: the stop flag is seen within 100 ms even without a wakeup.
            smb_poll_fd(st.efd, 10 if st.pending_close else 100)


# ------------------------------------------------------ server: socket transport
# A socket reaches this loop only after the handshake (eddis.smb.handshake) proved
# the job's token on it, so every byte below comes from a peer that knows it; the
# checks still guard the server against a confused client.

cdef void sock_close_conn(server_t *st, int ci) noexcept nogil:
    cdef server_conn_t *c = &st.conns[ci]
    close(c.fd)
    c.fd = -1
    free(c.rx.body)
    c.rx.body = NULL
    sk.smb_txq_clear(&c.txq)
    c.state = CONN_FREE
    c.gen += 1


cdef void sock_adopt(server_t *st) noexcept nogil:
    """Take the proven sockets the handshake thread wrote into the pipe."""
    cdef int fd, i, slot
    cdef server_conn_t *c
    while sk.read(st.adopt_fds[0], &fd, sizeof(fd)) == sizeof(fd):
        slot = -1
        for i in range(MAX_CONNS):
            if st.conns[i].state == CONN_FREE:
                slot = i
                break
        if slot < 0 or st.stop or sk.smb_sock_prepare(fd) != 0:
            close(fd)
            st.refused += 1
            continue
        c = &st.conns[slot]
        memset(&c.rx, 0, sizeof(c.rx))
        c.txq.first = NULL
        c.txq.last = NULL
        c.fd = fd
        c.ep = NULL
        c.server = st
        c.index = slot
        c.opened = smb_now()
        c.state = CONN_AUTH
        if slot + 1 > st.conn_hi:
            st.conn_hi = slot + 1


cdef void sock_finish_put(server_t *st, int ci) noexcept nogil:
    cdef sock_rx_t *rx = &st.conns[ci].rx
    if rx.status == 0:
        server_send_reply(st, ci, rx.hdr.req_id, 0, NULL, 0)
    else:
        server_reply_error(st, ci, rx.hdr.req_id, rx.status, rx.error)
    rx.phase = RX_HEADER
    rx.got = 0


cdef long sock_server_rx(server_t *st, int ci) noexcept nogil:
    """Read and run what connection ci sent; bytes taken, or -1 to close it."""
    cdef server_conn_t *c = &st.conns[ci]
    cdef sock_rx_t *rx = &c.rx
    cdef long n, total = 0
    cdef region_t *r
    cdef size_t want
    while total < SOCK_BUDGET and c.state == CONN_AUTH:
        if rx.phase == RX_HEADER:
            n = sk.smb_sock_recv(c.fd, (<char*>&rx.hdr) + rx.got, sizeof(smb_hdr_t) - rx.got)
            if n <= 0:
                return n if n < 0 else total
            total += n
            rx.got += n
            if rx.got < sizeof(smb_hdr_t):
                continue
            rx.got = 0
            if rx.hdr.magic != SMB_MAGIC:
                return -1
            st.requests += 1
            if rx.hdr.op == OP_PUT:
                if rx.hdr.length < sizeof(put_desc_t):
                    return -1
                rx.phase = RX_DESC
            else:
                if rx.hdr.length > SOCK_MAX_BODY:
                    return -1
                rx.body = <char*>malloc(rx.hdr.length + 1)
                if rx.body == NULL:
                    return -1
                rx.phase = RX_BODY
        elif rx.phase == RX_BODY:
            if rx.got < rx.hdr.length:
                n = sk.smb_sock_recv(c.fd, rx.body + rx.got, rx.hdr.length - rx.got)
                if n <= 0:
                    return n if n < 0 else total
                total += n
                rx.got += n
                if rx.got < rx.hdr.length:
                    continue
            dispatch_request(st, ci, &rx.hdr, rx.body, rx.hdr.length)
            free(rx.body)
            rx.body = NULL
            rx.phase = RX_HEADER
            rx.got = 0
        elif rx.phase == RX_DESC:
            n = sk.smb_sock_recv(c.fd, (<char*>&rx.desc) + rx.got, sizeof(put_desc_t) - rx.got)
            if n <= 0:
                return n if n < 0 else total
            total += n
            rx.got += n
            if rx.got < sizeof(put_desc_t):
                continue
            rx.got = 0
            rx.remaining = rx.hdr.length - sizeof(put_desc_t)
            rx.region = rx.desc.region
            rx.status = 0
            rx.error = NULL
            r = checked_span(st, rx.desc.region, rx.desc.offset, rx.remaining, &rx.status, &rx.error)
            rx.dest = NULL if r == NULL else st.arena + r.offset + rx.desc.offset
            rx.phase = RX_DATA
            if rx.remaining == 0:
                sock_finish_put(st, ci)
        else:   # RX_DATA
            if rx.dest != NULL and get_region(st, rx.region) == NULL:
                # freed while its data streamed in: the rest must not land in a successor
                rx.dest = NULL
                rx.status = ucp.UCS_ERR_NO_ELEM
                rx.error = b"the region was freed during the write"
            want = min(rx.remaining, <size_t>(SOCK_BUDGET - total))
            if rx.dest == NULL:
                want = min(want, <size_t>SOCK_SCRATCH)
            n = sk.smb_sock_recv(c.fd, rx.dest if rx.dest != NULL else st.scratch, want)
            if n <= 0:
                return n if n < 0 else total
            total += n
            rx.remaining -= n
            if rx.dest != NULL:
                rx.dest += n
            if rx.remaining == 0:
                sock_finish_put(st, ci)
    return total


cdef void server_loop_sock(server_t *st) noexcept nogil:
    cdef double now, last_busy = 0
    cdef int i, k, n, ci, timeout
    cdef long moved
    cdef int busy
    cdef server_conn_t *c
    while not st.stop:
        st.pfds[0].fd = st.adopt_fds[0]
        st.pfds[0].events = sk.POLLIN
        st.pfds[0].revents = 0
        k = 1
        for i in range(st.conn_hi):
            c = &st.conns[i]
            if c.state == CONN_FREE or c.fd < 0:
                continue
            st.pfds[k].fd = c.fd
            st.pfds[k].events = sk.POLLIN | (sk.POLLOUT if c.txq.first != NULL else 0)
            st.pfds[k].revents = 0
            st.pfd_conns[k] = i
            k += 1
        now = smb_now()
        # Requests come in bursts (buckets, counters): poll without sleeping a
        # little longer, which saves a wakeup per request of a burst.
        timeout = 0 if now - last_busy < 50e-6 else 100
        n = sk.poll(st.pfds, k, timeout)
        if n <= 0:
            continue
        busy = 0
        if st.pfds[0].revents:
            sock_adopt(st)
            busy = 1
        for i in range(1, k):
            if not st.pfds[i].revents:
                continue
            ci = st.pfd_conns[i]
            c = &st.conns[ci]
            moved = 0
            if st.pfds[i].revents & (sk.POLLIN | sk.POLLHUP | sk.POLLERR | sk.POLLNVAL):
                moved = sock_server_rx(st, ci)
            if moved >= 0 and c.txq.first != NULL:
                moved = sk.smb_txq_flush(c.fd, &c.txq, SOCK_BUDGET)
            if moved < 0:
                sock_close_conn(st, ci)
            elif moved > 0:
                busy = 1
        # replies a request queued on other connections (a barrier's release)
        for i in range(st.conn_hi):
            c = &st.conns[i]
            if c.state == CONN_AUTH and c.fd >= 0 and c.txq.first != NULL:
                moved = sk.smb_txq_flush(c.fd, &c.txq, SOCK_BUDGET)
                if moved < 0:
                    sock_close_conn(st, i)
                elif moved > 0:
                    busy = 1
        if busy:
            last_busy = smb_now()


cdef class ServerCore:
    """UCX state of one smb-server: arena, listener, region table, request loop."""
    cdef server_t *st
    cdef int shm_fd
    cdef object handler
    cdef object thread
    cdef public int port
    cdef int started
    cdef uint64_t touched_end

    def __cinit__(self):
        self.st = <server_t*>calloc(1, sizeof(server_t))
        if self.st == NULL:
            raise MemoryError()
        self.st.regions = <region_t*>calloc(MAX_REGIONS, sizeof(region_t))
        if self.st.regions == NULL:
            raise MemoryError()
        self.st.efd = -1
        self.st.adopt_fds[0] = -1
        self.st.adopt_fds[1] = -1
        self.shm_fd = -1

    def __dealloc__(self):
        if self.st != NULL:
            if not self.started:
                vp.smb_vecpool_destroy(self.st.vecpool)
                free(self.st.regions)
                free(self.st.hello_reply)
                free(self.st)
            # A started server that was never stopped keeps its state: the
            # progress thread may still use it.
            self.st = NULL

    @property
    def arena_fd(self):
        return self.shm_fd

    @property
    def arena_size(self):
        return self.st.arena_size

    @property
    def stats(self):
        cdef unsigned long ops = 0, split_ops = 0
        vp.smb_vecpool_counts(self.st.vecpool, &ops, &split_ops)
        return {"requests": self.st.requests, "refused": self.st.refused,
                "reduce_threads": self.st.reduce_threads, "vector_ops": ops,
                "vector_ops_split": split_ops}

    def create_arena(self, str shm_name, uint64_t size, uint64_t hugetlb_page=0,
                     bint transparent=False):
        """Create and map the shared-memory arena of `size` bytes.

        hugetlb_page > 0: back it with explicit huge pages of that size (an
        anonymous MFD_HUGETLB memfd, size rounded up to whole pages); the kernel
        reserves the pages at mmap, so a shortage is an error here (MemoryError
        for ENOMEM), never a SIGBUS later. Otherwise POSIX shared memory, with
        madvise(MADV_HUGEPAGE) when `transparent`; returns False when that
        madvise is refused. Policy (which to try, fallbacks, reports) is the
        caller's."""
        name = shm_name.encode()
        cdef int fd
        cdef int err
        cdef uint64_t mapped = size
        if hugetlb_page:
            mapped = (size + hugetlb_page - 1) // hugetlb_page * hugetlb_page
            fd = smb_memfd_hugetlb(name)
            if fd < 0:
                err = smb_errno()
                raise _errors.from_errno(err, f"memfd_create(MFD_HUGETLB) failed: {_os.strerror(err)}")
        else:
            fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0o600)
            if fd < 0:
                err = smb_errno()
                if err == _errno.EEXIST:
                    raise _errors.SMBValueError(
                        f"shared memory {shm_name} already exists (it is unlinked right after "
                        f"creation, so another process is creating one now); retry", err)
                raise _errors.from_errno(err, f"shm_open({shm_name}) failed: {_os.strerror(err)}")
            # Unlinked at once: the memory lives as long as this process holds the
            # descriptor, so even a SIGKILLed server leaves nothing in /dev/shm.
            # Same-node clients map it through /proc/<pid>/fd/<fd>.
            shm_unlink(name)
        self.shm_fd = fd
        if ftruncate(fd, mapped) != 0:
            err = smb_errno()
            self.destroy_arena()
            raise _errors.from_errno(err, f"cannot size shared memory to {mapped} bytes: {_os.strerror(err)}")
        cdef void *p = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if p == MAP_FAILED:
            err = smb_errno()
            self.destroy_arena()
            raise _errors.from_errno(err, f"cannot map {mapped} bytes of shared memory: {_os.strerror(err)}")
        self.st.arena = <char*>p
        self.st.arena_size = mapped
        if transparent and not hugetlb_page:
            return madvise(p, mapped, MADV_HUGEPAGE) == 0
        return True

    @property
    def arena_address(self):
        return <uintptr_t>self.st.arena

    def destroy_arena(self):
        if self.st.arena != NULL:
            munmap(self.st.arena, self.st.arena_size)
            self.st.arena = NULL
        if self.shm_fd >= 0:
            close(self.shm_fd)
            self.shm_fd = -1

    def _prepare(self, bytes hello_reply, handler, int reduce_threads):
        """Reduction threads, HELLO reply and request handler: what both transports need."""
        if reduce_threads < 1 or reduce_threads > vp.SMB_VECPOOL_MAX_THREADS:
            raise _errors.ConfigError(
                f"{reduce_threads} reduction threads: use 1..{vp.SMB_VECPOOL_MAX_THREADS}")
        if self.st.vecpool == NULL:
            err = vp.smb_vecpool_create(reduce_threads, &self.st.vecpool)
            if err != 0:
                raise _errors.from_errno(
                    err, f"cannot start {reduce_threads} reduction threads: {_os.strerror(err)}; "
                         "use fewer (SMB_REDUCE_THREADS / smb-server --reduce-threads)")
        self.st.reduce_threads = reduce_threads
        self.st.hello_reply = <char*>malloc(len(hello_reply) + 1)
        if self.st.hello_reply == NULL:
            raise MemoryError()
        memcpy(self.st.hello_reply, <const char*>hello_reply, len(hello_reply))
        self.st.hello_reply_len = len(hello_reply)
        self.handler = handler
        self.st.py_handler = <void*>handler

    def start(self, str host, int port, bytes token, bytes hello_reply, handler,
              double hello_timeout=30.0, int reduce_threads=1):
        """Create the reduction threads, context, worker and listener; returns the port
        listened on. reduce_threads counts the request thread: 1 starts no worker."""
        cdef ucp.ucp_config_t *config = NULL
        cdef ucp.ucp_params_t params
        cdef ucp.ucp_worker_params_t wparams
        cdef ucp.ucp_listener_params_t lparams
        cdef ucp.ucp_listener_attr_t lattr
        cdef ucp.ucp_am_handler_param_t am
        cdef sockaddr_in addr
        if len(token) == 0 or len(token) > 255:
            raise _errors.SMBValueError("job token must be 1..255 bytes; recreate the run directory")
        memcpy(self.st.token, <const char*>token, len(token))
        self.st.token_len = len(token)
        self.st.hello_timeout = hello_timeout
        self._prepare(hello_reply, handler, reduce_threads)
        CHKERR(ucp.ucp_config_read(NULL, NULL, &config), "ucp_config_read")
        params.field_mask = ucp.UCP_PARAM_FIELD_FEATURES
        params.features = ucp.UCP_FEATURE_RMA | ucp.UCP_FEATURE_AM | ucp.UCP_FEATURE_WAKEUP
        status = ucp.ucp_init(&params, config, &self.st.context)
        ucp.ucp_config_release(config)
        CHKERR(status, "ucp_init")
        self.started = 1
        wparams.field_mask = ucp.UCP_WORKER_PARAM_FIELD_THREAD_MODE
        wparams.thread_mode = ucp.UCS_THREAD_MODE_SERIALIZED
        CHKERR(ucp.ucp_worker_create(self.st.context, &wparams, &self.st.worker), "ucp_worker_create")
        CHKERR(ucp.ucp_worker_get_efd(self.st.worker, &self.st.efd), "ucp_worker_get_efd")
        am.field_mask = (ucp.UCP_AM_HANDLER_PARAM_FIELD_ID | ucp.UCP_AM_HANDLER_PARAM_FIELD_CB
                         | ucp.UCP_AM_HANDLER_PARAM_FIELD_ARG | ucp.UCP_AM_HANDLER_PARAM_FIELD_FLAGS)
        am.id = AM_REQUEST
        am.flags = ucp.UCP_AM_FLAG_WHOLE_MSG
        am.cb = _server_am_request
        am.arg = self.st
        CHKERR(ucp.ucp_worker_set_am_recv_handler(self.st.worker, &am), "ucp_worker_set_am_recv_handler")
        memset(&addr, 0, sizeof(addr))
        addr.sin_family = AF_INET
        addr.sin_port = htons(port)
        if inet_pton(AF_INET, host.encode(), &addr.sin_addr) != 1:
            raise _errors.SMBValueError(f"listen address {host!r} is not an IPv4 address; pass --host A.B.C.D")
        lparams.field_mask = ucp.UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | ucp.UCP_LISTENER_PARAM_FIELD_CONN_HANDLER
        lparams.sockaddr.addr = <ucp.sockaddr*>&addr
        lparams.sockaddr.addrlen = sizeof(addr)
        lparams.conn_handler.cb = _server_conn_request
        lparams.conn_handler.arg = self.st
        CHKERR(ucp.ucp_listener_create(self.st.worker, &lparams, &self.st.listener),
               f"cannot listen on {host}:{port}")
        lattr.field_mask = ucp.UCP_LISTENER_ATTR_FIELD_SOCKADDR
        CHKERR(ucp.ucp_listener_query(self.st.listener, &lattr), "ucp_listener_query")
        self.port = ntohs((<sockaddr_in*>&lattr.sockaddr).sin_port)
        return self.port

    def start_sockets(self, bytes hello_reply, handler, int reduce_threads=1):
        """Serve over the socket transport: the caller proves each peer's token
        (eddis.smb.handshake) and hands the socket over with adopt_socket().
        No UCX context exists, so no port but the caller's own listens."""
        self._prepare(hello_reply, handler, reduce_threads)
        self.st.pfds = <sk.pollfd*>calloc(MAX_CONNS + 1, sizeof(sk.pollfd))
        self.st.pfd_conns = <int*>calloc(MAX_CONNS + 1, sizeof(int))
        self.st.scratch = <char*>malloc(SOCK_SCRATCH)
        if self.st.pfds == NULL or self.st.pfd_conns == NULL or self.st.scratch == NULL:
            raise MemoryError()
        if sk.smb_pipe_nonblocking(self.st.adopt_fds) != 0:
            err = smb_errno()
            raise _errors.from_errno(err, f"cannot create the socket hand-over pipe: {_os.strerror(err)}")
        self.started = 1

    def adopt_socket(self, int fd):
        """Give a proven connection's socket to the request loop, which owns it from now on."""
        if self.st.adopt_fds[1] < 0 or self.st.stop:
            close(fd)
            raise _errors.UsageError("the SMB server core is not serving sockets")
        if sk.write(self.st.adopt_fds[1], &fd, sizeof(fd)) != sizeof(fd):
            close(fd)
            raise _errors.SMBConnectionError("cannot hand a connection to the request loop")

    def _run(self):
        with nogil:
            if self.st.worker != NULL:
                server_loop(self.st)
            else:
                server_loop_sock(self.st)

    def run_in_thread(self):
        self.thread = _threading.Thread(target=self._run, name="smb-server-progress", daemon=True)
        self.thread.start()

    def stop(self):
        """Stop the loop, close every endpoint and release UCX state."""
        cdef double deadline
        if not self.started:
            self._stop_reduce_threads()
            self.destroy_arena()
            return
        self.st.stop = 1
        if self.st.worker != NULL:
            ucp.ucp_worker_signal(self.st.worker)
        if self.thread is not None:
            self.thread.join(10)
            self.thread = None
        for i in range(self.st.conn_hi):
            if self.st.conns[i].state != CONN_FREE and self.st.conns[i].fd >= 0:
                sock_close_conn(self.st, i)
        for i in range(2):
            if self.st.adopt_fds[i] >= 0:
                close(self.st.adopt_fds[i])
                self.st.adopt_fds[i] = -1
        # after the request loop: it is the only thread that hands work to the pool
        self._stop_reduce_threads()
        if self.st.listener != NULL:
            ucp.ucp_listener_destroy(self.st.listener)
            self.st.listener = NULL
        if self.st.worker != NULL:
            with nogil:
                server_close_conns(self.st, True)
                deadline = smb_now() + 2.0
                while self.st.pending_close and smb_now() < deadline:
                    ucp.ucp_worker_progress(self.st.worker)
                    server_close_conns(self.st, False)
        for i in range(MAX_REGIONS):
            if self.st.regions[i].valid:
                if self.st.context != NULL:
                    ucp.ucp_mem_unmap(self.st.context, self.st.regions[i].memh)
                self.st.regions[i].valid = 0
        if self.st.worker != NULL:
            ucp.ucp_worker_destroy(self.st.worker)
            self.st.worker = NULL
        if self.st.context != NULL:
            ucp.ucp_cleanup(self.st.context)
            self.st.context = NULL
        self.destroy_arena()
        self.started = 0

    def _stop_reduce_threads(self):
        with nogil:
            vp.smb_vecpool_destroy(self.st.vecpool)
        self.st.vecpool = NULL

    # -------------------------------------------- called from the control handler
    def region_register(self, int index, uint64_t offset, uint64_t nbytes, uint64_t slots,
                        uint64_t length, int dtype):
        """Map [offset, offset+nbytes) of the arena as region `index`: (rid, addr, rkey)."""
        cdef region_t *r = &self.st.regions[index]
        cdef ucp.ucp_mem_map_params_t mp
        cdef void *rkey_buf = NULL
        cdef size_t rkey_len = 0
        if index < 0 or index >= MAX_REGIONS or r.valid:
            raise _errors.SMBValueError(f"region slot {index} is not free")
        if offset + nbytes > self.st.arena_size:
            raise _errors.SMBBoundsError("region outside the arena")
        # Only memory a freed region may have dirtied needs clearing; the arena
        # beyond touched_end was never handed out and reads as zero already.
        cdef uint64_t dirty_end = min(offset + nbytes, self.touched_end)
        cdef char *start = self.st.arena + offset
        if dirty_end > offset:
            with nogil:
                memset(start, 0, dirty_end - offset)
        self.touched_end = max(self.touched_end, offset + nbytes)
        rkey = b""
        if self.st.context != NULL:
            # UCX transport: remote peers reach the region one-sidedly through its key
            mp.field_mask = ucp.UCP_MEM_MAP_PARAM_FIELD_ADDRESS | ucp.UCP_MEM_MAP_PARAM_FIELD_LENGTH
            mp.address = self.st.arena + offset
            mp.length = nbytes if nbytes else 1
            CHKERR(ucp.ucp_mem_map(self.st.context, &mp, &r.memh), "ucp_mem_map")
            status = ucp.ucp_rkey_pack(self.st.context, r.memh, &rkey_buf, &rkey_len)
            if status != ucp.UCS_OK:
                ucp.ucp_mem_unmap(self.st.context, r.memh)
                CHKERR(status, "ucp_rkey_pack")
            rkey = PyBytes_FromStringAndSize(<char*>rkey_buf, rkey_len)
            ucp.ucp_rkey_buffer_release(rkey_buf)
        r.offset = offset
        r.nbytes = nbytes
        r.slots = slots
        r.length = length
        r.dtype = dtype
        r.itemsize = ITEMSIZES[dtype]
        r.gen = (r.gen + 1) & 0xFFFF
        if r.gen == 0:
            r.gen = 1          # 0 means "no region" in the arena's generation table
        r.valid = 1
        if self.st.arena_size >= GEN_TABLE_BYTES:
            smb_store_u32(<uint32_t*>self.st.arena + index, r.gen)
        rid = (r.gen << 16) | index
        return rid, <uintptr_t>(self.st.arena + offset), rkey

    def region_unregister(self, uint32_t rid):
        cdef region_t *r = get_region(self.st, rid)
        if r == NULL:
            raise _errors.SMBKeyError(f"no region with id {rid}")
        r.valid = 0
        if self.st.arena_size >= GEN_TABLE_BYTES:
            smb_store_u32(<uint32_t*>self.st.arena + (rid & 0xFFFF), 0)
        if self.st.context != NULL:
            ucp.ucp_mem_unmap(self.st.context, r.memh)

    def write_int64(self, uint32_t rid, uint64_t index, int64_t value):
        cdef region_t *r = get_region(self.st, rid)
        if r == NULL or r.dtype != 4 or index >= r.length * r.slots:
            raise _errors.SMBBoundsError("write_int64 outside an int64 region")
        smb_store64(<int64_t*>(self.st.arena + r.offset) + index, value)

    def reply(self, uint32_t conn_id, uint64_t req_id, int status, bytes payload):
        """A deferred reply (barrier, event, reduce); dropped if the client left."""
        cdef int ci = conn_id & 0xFFFF
        if ci >= MAX_CONNS or self.st.conns[ci].gen != (conn_id >> 16):
            return False
        return server_send_reply(self.st, ci, req_id, status, <const char*>payload, len(payload)) == 0

    def conn_alive(self, uint32_t conn_id):
        cdef int ci = conn_id & 0xFFFF
        return (ci < MAX_CONNS and self.st.conns[ci].gen == (conn_id >> 16)
                and self.st.conns[ci].state == CONN_AUTH)

    def weighted_sum(self, uint32_t dst_region, uint32_t dst_slot, uint64_t start, uint64_t count,
                     list sources):
        """dst = sum(w * src) over [(region, slot, weight)], with the GIL released.

        Returns the number of threads that computed it."""
        cdef size_t n = len(sources)
        if n > MAX_VEC_SOURCES:
            raise _errors.SMBValueError("weighted_sum: at most 1024 sources")
        cdef vec_req_t q
        cdef vec_src_t *srcs = <vec_src_t*>malloc(max(n, 1) * sizeof(vec_src_t))
        cdef int status = 0
        cdef int threads_used = 0
        cdef const char *err
        if srcs == NULL:
            raise MemoryError()
        q.kind = VEC_WEIGHTED_SUM
        q.nsrc = <uint32_t>n
        q.dst_region = dst_region
        q.dst_slot = dst_slot
        q.start = start
        q.count = count
        q.alpha = 0
        for i, (region, slot, weight) in enumerate(sources):
            srcs[i].region = region
            srcs[i].slot = slot
            srcs[i].weight = weight
        with nogil:
            err = run_vecop(self.st, &q, srcs, &status, &threads_used)
        free(srcs)
        if err != NULL:
            raise _errors.from_ucs_status(status, (<bytes>err).decode())
        return threads_used


# ================================================================== client
cdef enum slot_state_t:
    SLOT_FREE = 0
    SLOT_PENDING = 1
    SLOT_FILLING = 2
    SLOT_DONE = 3

cdef struct reply_slot_t:
    int state
    uint32_t gen
    int status
    char *data
    size_t length
    char *dest              # socket get: the reply's data lands here, not in `data`
    size_t dest_len

cdef struct client_conn_t:
    ucp.ucp_ep_h ep
    int failed
    int status
    int closed
    int fd                  # socket transport (-1: a UCX endpoint)
    sock_rx_t rx
    sk.smb_txq_t txq

cdef struct client_t:
    ucp.ucp_context_h context
    ucp.ucp_worker_h worker     # NULL on the socket transport
    reply_slot_t slots[REPLY_SLOTS]
    # socket transport: posting threads and the progressing thread share the queues
    sk.pthread_mutex_t io_lock
    sk.pollfd pfds[MAX_CONNS]
    int pfd_conns[MAX_CONNS]
    char scratch[SOCK_SCRATCH]


cdef ucs_status_t _client_am_reply(void *arg, const void *header, size_t header_length,
                                   void *data, size_t length,
                                   const ucp.ucp_am_recv_param_t *param) noexcept nogil:
    cdef client_t *cl = <client_t*>arg
    cdef smb_hdr_t h
    if length < sizeof(smb_hdr_t) or param.recv_attr & ucp.UCP_AM_RECV_ATTR_FLAG_RNDV:
        return ucp.UCS_OK
    memcpy(&h, data, sizeof(h))
    if h.magic != SMB_MAGIC or h.length != length - sizeof(smb_hdr_t):
        return ucp.UCS_OK
    cdef uint32_t idx = h.req_id & 0xFFFF
    if idx >= REPLY_SLOTS:
        return ucp.UCS_OK
    cdef reply_slot_t *s = &cl.slots[idx]
    if s.gen != <uint32_t>(h.req_id >> 16):
        return ucp.UCS_OK                   # a late reply to a request that timed out
    if not smb_cas_int(&s.state, SLOT_PENDING, SLOT_FILLING):
        return ucp.UCS_OK
    s.status = h.status
    s.length = h.length
    s.data = NULL
    if h.length:
        s.data = <char*>malloc(h.length)
        if s.data != NULL:
            memcpy(s.data, <char*>data + sizeof(smb_hdr_t), h.length)
        else:
            s.status = ucp.UCS_ERR_NO_MEMORY
            s.length = 0
    smb_store_int(&s.state, SLOT_DONE)
    return ucp.UCS_OK


cdef void _client_ep_error(void *arg, ucp.ucp_ep_h ep, ucs_status_t status) noexcept nogil:
    cdef client_conn_t *c = <client_conn_t*>arg
    c.status = status
    smb_store_int(&c.failed, 1)


# ------------------------------------------------------ client: socket transport
cdef void client_sock_fail(client_conn_t *c, int status) noexcept nogil:
    """The server is gone (or timed out): waits on it fail, queued frames are dropped."""
    if not smb_load_int(&c.failed):
        c.status = status
        smb_store_int(&c.failed, 1)
    sk.shutdown(c.fd, sk.SHUT_RDWR)
    sk.smb_txq_clear(&c.txq)


cdef long client_sock_rx(client_t *cl, client_conn_t *c) noexcept nogil:
    """Read replies into their slots (a get's data straight into its buffer); -1: lost."""
    cdef sock_rx_t *rx = &c.rx
    cdef long n, total = 0
    cdef uint32_t idx
    cdef reply_slot_t *s
    cdef size_t want
    while total < SOCK_BUDGET:
        if rx.phase == RX_HEADER:
            n = sk.smb_sock_recv(c.fd, (<char*>&rx.hdr) + rx.got, sizeof(smb_hdr_t) - rx.got)
            if n <= 0:
                return n if n < 0 else total
            total += n
            rx.got += n
            if rx.got < sizeof(smb_hdr_t):
                continue
            rx.got = 0
            if rx.hdr.magic != SMB_MAGIC:
                return -1
            rx.slot = -1
            rx.dest = NULL
            rx.remaining = rx.hdr.length
            idx = rx.hdr.req_id & 0xFFFF
            if idx < REPLY_SLOTS:
                s = &cl.slots[idx]
                # a late reply to a request given up on finds its slot moved on: discarded
                if s.gen == <uint32_t>(rx.hdr.req_id >> 16) and smb_cas_int(&s.state, SLOT_PENDING,
                                                                             SLOT_FILLING):
                    rx.slot = idx
                    s.status = rx.hdr.status
                    s.data = NULL
                    s.length = 0
                    if s.dest != NULL and rx.hdr.status == 0:
                        if rx.hdr.length == s.dest_len:
                            rx.dest = s.dest
                        else:
                            s.status = ucp.UCS_ERR_IO_ERROR
                    elif rx.hdr.length:
                        s.data = <char*>malloc(rx.hdr.length)
                        if s.data == NULL:
                            s.status = ucp.UCS_ERR_NO_MEMORY
                        else:
                            s.length = rx.hdr.length
                            rx.dest = s.data
            rx.phase = RX_DATA
        else:
            if rx.remaining:
                want = min(rx.remaining, <size_t>(SOCK_BUDGET - total))
                if rx.dest == NULL:
                    want = min(want, <size_t>SOCK_SCRATCH)
                n = sk.smb_sock_recv(c.fd, rx.dest if rx.dest != NULL else cl.scratch, want)
                if n <= 0:
                    return n if n < 0 else total
                total += n
                rx.remaining -= n
                if rx.dest != NULL:
                    rx.dest += n
                if rx.remaining:
                    continue
            if rx.slot >= 0:
                smb_store_int(&cl.slots[rx.slot].state, SLOT_DONE)
            rx.slot = -1
            rx.dest = NULL
            rx.phase = RX_HEADER
    return total


cdef long client_sock_progress(client_t *cl, client_conn_t *conns, int nconns,
                               int timeout_ms) noexcept nogil:
    """One pass over the sockets; another thread already progressing them makes it a no-op."""
    cdef int i, k = 0
    cdef long moved, total = 0
    cdef client_conn_t *c
    cdef short revents
    if sk.pthread_mutex_trylock(&cl.io_lock) != 0:
        return 0
    for i in range(nconns):
        c = &conns[i]
        if c.fd < 0 or smb_load_int(&c.failed):
            continue
        cl.pfds[k].fd = c.fd
        cl.pfds[k].events = sk.POLLIN | (sk.POLLOUT if c.txq.first != NULL else 0)
        cl.pfds[k].revents = 0
        cl.pfd_conns[k] = i
        k += 1
    if k and sk.poll(cl.pfds, k, timeout_ms) > 0:
        for i in range(k):
            revents = cl.pfds[i].revents
            if not revents:
                continue
            c = &conns[cl.pfd_conns[i]]
            moved = 0
            if revents & (sk.POLLIN | sk.POLLHUP | sk.POLLERR | sk.POLLNVAL):
                moved = client_sock_rx(cl, c)
            if moved >= 0 and c.txq.first != NULL:
                moved = sk.smb_txq_flush(c.fd, &c.txq, SOCK_BUDGET)
            if moved < 0:
                client_sock_fail(c, ucp.UCS_ERR_CONNECTION_RESET)
            else:
                total += moved
    sk.pthread_mutex_unlock(&cl.io_lock)
    return total


# wait results
DEF WAIT_DONE = 0
DEF WAIT_TIMEOUT = 1
DEF WAIT_CONN_FAILED = 2
DEF WAIT_CLOSED = 3


cdef void *realloc_or_raise(void *p, size_t n) except NULL:
    cdef void *q = realloc(p, n)
    if q == NULL:
        raise MemoryError()
    return q


_ABANDONED_BUFFERS = []


cdef class Pending:
    """Outstanding UCX requests and reply slots, waited on together without the GIL."""
    cdef void **reqs
    cdef int *req_conns
    cdef int nreq
    cdef int cap
    cdef uint64_t *slot_ids
    cdef int *slot_conns
    cdef char *slot_xfer           # 1: the slot is a socket put/get (a data transfer)
    cdef int nslot
    cdef int slot_cap
    cdef ClientCore core
    cdef public object keep        # buffers that must outlive the transfers
    cdef public int error_status
    cdef public int error_conn

    def __cinit__(self, ClientCore core):
        self.core = core
        self.error_status = 0
        self.error_conn = -1

    def __dealloc__(self):
        cdef int i
        # After client.close() the worker is gone and took its requests with it.
        cdef bint live = self.core is not None and self.core.cl != NULL
        for i in range(self.nreq):
            if self.reqs[i] != NULL and live:
                if ucp.ucp_request_check_status(self.reqs[i]) == ucp.UCS_INPROGRESS \
                        and self.keep is not None:
                    # Abandoned mid-transfer: UCX may still touch the buffer, so it
                    # must outlive this object (a small leak beats a heap corruption).
                    _ABANDONED_BUFFERS.append(self.keep)
                    self.keep = None
                ucp.ucp_request_free(self.reqs[i])   # released by UCX once it completes
        if self.core is not None:
            if self.keep is not None and live:
                for i in range(self.nslot):
                    if self.slot_xfer[i] and smb_load_int(
                            &self.core.cl.slots[self.slot_ids[i] & 0xFFFF].state) != SLOT_DONE:
                        # a put may still be queued on its socket, borrowing the buffer
                        _ABANDONED_BUFFERS.append(self.keep)
                        self.keep = None
                        break
            for i in range(self.nslot):
                self.core.release_slot(self.slot_ids[i])
        free(self.reqs)
        free(self.req_conns)
        free(self.slot_ids)
        free(self.slot_conns)
        free(self.slot_xfer)

    cdef int add_request(self, ucs_status_ptr_t p, int conn) except -1:
        if p == NULL:
            return 0
        if ucp.UCS_PTR_IS_ERR(p):
            if self.error_status == 0:
                self.error_status = ucp.UCS_PTR_STATUS(p)
                self.error_conn = conn
            return 0
        if self.nreq == self.cap:
            self.cap = self.cap * 2 + 4
            self.reqs = <void**>realloc_or_raise(self.reqs, self.cap * sizeof(void*))
            self.req_conns = <int*>realloc_or_raise(self.req_conns, self.cap * sizeof(int))
        self.reqs[self.nreq] = p
        self.req_conns[self.nreq] = conn
        self.nreq += 1
        return 0

    cdef int add_slot(self, uint64_t slot_id, int conn, bint transfer=False) except -1:
        if self.nslot == self.slot_cap:
            self.slot_cap = self.slot_cap * 2 + 4
            self.slot_ids = <uint64_t*>realloc_or_raise(self.slot_ids, self.slot_cap * sizeof(uint64_t))
            self.slot_conns = <int*>realloc_or_raise(self.slot_conns, self.slot_cap * sizeof(int))
            self.slot_xfer = <char*>realloc_or_raise(self.slot_xfer, self.slot_cap)
        self.slot_ids[self.nslot] = slot_id
        self.slot_conns[self.nslot] = conn
        self.slot_xfer[self.nslot] = transfer
        self.nslot += 1
        return 0

    cdef int _poll(self) noexcept nogil:
        """1 when all done; records the first error in error_status."""
        cdef int i
        cdef ucs_status_t s
        cdef int all_done = 1
        cdef client_t *cl = self.core.cl
        for i in range(self.nreq):
            if self.reqs[i] == NULL:
                continue
            s = ucp.ucp_request_check_status(self.reqs[i])
            if s == ucp.UCS_INPROGRESS:
                all_done = 0
                continue
            ucp.ucp_request_free(self.reqs[i])
            self.reqs[i] = NULL
            if s != ucp.UCS_OK and self.error_status == 0:
                self.error_status = s
                self.error_conn = self.req_conns[i]
        for i in range(self.nslot):
            if smb_load_int(&cl.slots[self.slot_ids[i] & 0xFFFF].state) != SLOT_DONE:
                if smb_load_int(&self.core.conns[self.slot_conns[i]].failed):
                    if self.error_status == 0:
                        self.error_status = ucp.UCS_ERR_CONNECTION_RESET
                        self.error_conn = self.slot_conns[i]
                    continue
                all_done = 0
        return all_done

    def done(self):
        """True once every transfer and reply is in (progresses UCX once)."""
        self.core._enter()
        try:
            with nogil:
                self.core._progress(0)
                r = self._poll()
        finally:
            self.core._leave()
        return bool(r)

    def wait(self, double timeout):
        """Wait for all; returns 0 done, 1 timed out. Errors are left in error_status."""
        cdef double deadline = smb_now() + timeout
        cdef unsigned idle = 0
        cdef unsigned n
        cdef int result = WAIT_TIMEOUT
        self.core._enter()
        with nogil:
            while True:
                if smb_load_int(&self.core.closing):
                    result = WAIT_CLOSED
                    break
                n = self.core._progress(1 if idle >= 256 else 0)
                # Even after an error, wait for the other transfers: a get still
                # in flight would otherwise land in a buffer the caller reuses.
                if self._poll():
                    result = WAIT_DONE
                    break
                if smb_now() > deadline:
                    break
                if n:
                    idle = 0
                else:
                    idle += 1
                    smb_pause(idle)
        self.core._leave()
        return result

    def replies(self):
        """[(status, bytes)] of the reply slots, in the order they were added."""
        out = []
        cdef reply_slot_t *s
        self.core._check_open()
        for i in range(self.nslot):
            s = &self.core.cl.slots[self.slot_ids[i] & 0xFFFF]
            if smb_load_int(&s.state) != SLOT_DONE:
                out.append(None)
            else:
                out.append((s.status, PyBytes_FromStringAndSize(s.data, s.length) if s.data else b""))
        return out

    @property
    def has_transfers(self):
        return self.nreq > 0 or any(self.slot_xfer[i] for i in range(self.nslot))

    def inflight_conns(self):
        """Connections with transfers still in progress."""
        conns = {self.req_conns[i] for i in range(self.nreq) if self.reqs[i] != NULL
                 and ucp.ucp_request_check_status(self.reqs[i]) == ucp.UCS_INPROGRESS}
        conns.update(self.slot_conns[i] for i in range(self.nslot) if self.slot_xfer[i] and smb_load_int(
            &self.core.cl.slots[self.slot_ids[i] & 0xFFFF].state) != SLOT_DONE)
        return sorted(conns)

    def slot_conns_list(self):
        return [self.slot_conns[i] for i in range(self.nslot)]


cdef class ClientCore:
    """One client's connections to its servers: proven sockets (the default), or a UCX
    context and worker with endpoints and remote keys (``ucx=True``)."""
    cdef client_t *cl
    cdef client_conn_t *conns
    cdef int nconns
    cdef list free_slots
    cdef object slot_lock
    cdef dict rkeys                   # (conn, rid) -> rkey handle as int
    cdef list maps                    # (addr, size) of mapped arenas
    # close() from one thread while another waits or posts must not free the
    # worker under it: operations count themselves in `active`, close() sets
    # `closing` (waits see it and stop) and waits for `active` to drain.
    cdef int active
    cdef int closing

    def __cinit__(self, bint ucx=False):
        cdef ucp.ucp_config_t *config = NULL
        cdef ucp.ucp_params_t params
        cdef ucp.ucp_worker_params_t wparams
        cdef ucp.ucp_am_handler_param_t am
        self.cl = <client_t*>calloc(1, sizeof(client_t))
        self.conns = <client_conn_t*>calloc(MAX_CONNS, sizeof(client_conn_t))
        if self.cl == NULL or self.conns == NULL:
            raise MemoryError()
        for i in range(MAX_CONNS):
            self.conns[i].fd = -1
        sk.pthread_mutex_init(&self.cl.io_lock, NULL)
        self.free_slots = list(range(REPLY_SLOTS - 1, -1, -1))
        self.slot_lock = _threading.Lock()
        self.rkeys = {}
        self.maps = []
        if not ucx:
            return
        CHKERR(ucp.ucp_config_read(NULL, NULL, &config), "ucp_config_read")
        params.field_mask = ucp.UCP_PARAM_FIELD_FEATURES
        params.features = ucp.UCP_FEATURE_RMA | ucp.UCP_FEATURE_AM
        status = ucp.ucp_init(&params, config, &self.cl.context)
        ucp.ucp_config_release(config)
        CHKERR(status, "ucp_init")
        # MULTI: the runtime's communication thread and the main thread share it.
        wparams.field_mask = ucp.UCP_WORKER_PARAM_FIELD_THREAD_MODE
        wparams.thread_mode = ucp.UCS_THREAD_MODE_MULTI
        CHKERR(ucp.ucp_worker_create(self.cl.context, &wparams, &self.cl.worker), "ucp_worker_create")
        am.field_mask = (ucp.UCP_AM_HANDLER_PARAM_FIELD_ID | ucp.UCP_AM_HANDLER_PARAM_FIELD_CB
                         | ucp.UCP_AM_HANDLER_PARAM_FIELD_ARG | ucp.UCP_AM_HANDLER_PARAM_FIELD_FLAGS)
        am.id = AM_REPLY
        am.flags = ucp.UCP_AM_FLAG_WHOLE_MSG
        am.cb = _client_am_reply
        am.arg = self.cl
        CHKERR(ucp.ucp_worker_set_am_recv_handler(self.cl.worker, &am), "ucp_worker_set_am_recv_handler")

    def __dealloc__(self):
        self.close()

    cdef int _enter(self) except -1:
        if self.cl == NULL or smb_load_int(&self.closing):
            raise _errors.UsageError("the SMB client is closed (or closing)")
        smb_fetch_add_int(&self.active, 1)
        return 0

    cdef void _leave(self) noexcept:
        smb_fetch_add_int(&self.active, -1)

    cdef unsigned _progress(self, int timeout_ms) noexcept nogil:
        """Move what can move on every connection; non-zero when something did."""
        if self.cl.worker != NULL:
            return ucp.ucp_worker_progress(self.cl.worker)
        return client_sock_progress(self.cl, self.conns, self.nconns, timeout_ms) > 0

    @property
    def uses_ucx(self):
        return self.cl != NULL and self.cl.worker != NULL

    def adopt_socket(self, int fd):
        """Take a socket on which the handshake proved the token; returns its connection index."""
        self._check_open()
        if self.cl.worker != NULL:
            close(fd)
            raise _errors.UsageError("this client core speaks UCX; it takes no sockets")
        if self.nconns >= MAX_CONNS:
            close(fd)
            raise _errors.SMBValueError("too many SMB servers for one client (1024)")
        if sk.smb_sock_prepare(fd) != 0:
            err = smb_errno()
            close(fd)
            raise _errors.from_errno(err, f"cannot use the server connection: {_os.strerror(err)}")
        cdef int ci = self.nconns
        memset(&self.conns[ci], 0, sizeof(client_conn_t))
        self.conns[ci].fd = fd
        self.conns[ci].rx.slot = -1
        self.nconns += 1
        return ci

    cdef int _sock_send(self, int ci, char *head, size_t head_len, const char *data,
                        size_t data_len) except -1:
        """Queue a frame (head owned, data borrowed until the reply) and send what fits now."""
        cdef client_conn_t *c
        cdef int rc = 0
        cdef long moved
        try:
            self._enter()      # close() must not free the lock under us
        except BaseException:
            free(head)
            raise
        c = &self.conns[ci]
        with nogil:
            sk.pthread_mutex_lock(&self.cl.io_lock)
            if smb_load_int(&c.failed):
                free(head)   # the wait on its reply reports the lost server
            else:
                rc = sk.smb_txq_push(&c.txq, head, head_len, data, data_len)
                if rc == 0:
                    moved = sk.smb_txq_flush(c.fd, &c.txq, SOCK_BUDGET)
                    if moved < 0:
                        client_sock_fail(c, ucp.UCS_ERR_CONNECTION_RESET)
            sk.pthread_mutex_unlock(&self.cl.io_lock)
        self._leave()
        if rc != 0:
            raise MemoryError()
        return 0

    cdef char *_data_head(self, int op, uint64_t slot_id, size_t length, const void *desc,
                          size_t desc_len) except NULL:
        cdef char *head = <char*>malloc(sizeof(smb_hdr_t) + desc_len)
        if head == NULL:
            raise MemoryError()
        cdef smb_hdr_t *h = <smb_hdr_t*>head
        h.magic = SMB_MAGIC
        h.op = op
        h.status = 0
        h.length = <uint32_t>length
        h.reserved = 0
        h.req_id = slot_id
        memcpy(head + sizeof(smb_hdr_t), desc, desc_len)
        return head

    def close(self):
        """Destroy remote keys, close endpoints, release the worker and context."""
        cdef int i
        cdef ucp.ucp_request_param_t param
        cdef ucs_status_ptr_t p
        cdef double deadline
        if self.cl == NULL or smb_load_int(&self.closing):
            return
        smb_store_int(&self.closing, 1)
        deadline = smb_now() + 5.0
        with nogil:
            while smb_load_int(&self.active) > 0 and smb_now() < deadline:
                smb_pause(1024)
        for handle in self.rkeys.values():
            ucp.ucp_rkey_destroy(<ucp.ucp_rkey_h><uintptr_t>handle)
        self.rkeys.clear()
        for addr, size in self.maps:
            munmap(<void*><uintptr_t>addr, size)
        self.maps = []
        for i in range(self.nconns):
            if self.conns[i].fd >= 0:
                sk.smb_txq_clear(&self.conns[i].txq)
                close(self.conns[i].fd)
                self.conns[i].fd = -1
                self.conns[i].closed = 1
            if self.conns[i].closed:
                continue
            self.conns[i].closed = 1
            param.op_attr_mask = ucp.UCP_OP_ATTR_FIELD_FLAGS
            param.flags = ucp.UCP_EP_CLOSE_FLAG_FORCE if self.conns[i].failed else 0
            p = ucp.ucp_ep_close_nbx(self.conns[i].ep, &param)
            if ucp.UCS_PTR_IS_PTR(p):
                deadline = smb_now() + 1.0
                with nogil:
                    while ucp.ucp_request_check_status(p) == ucp.UCS_INPROGRESS and smb_now() < deadline:
                        ucp.ucp_worker_progress(self.cl.worker)
                if ucp.ucp_request_check_status(p) == ucp.UCS_INPROGRESS:
                    ucp.ucp_request_cancel(self.cl.worker, p)
                ucp.ucp_request_free(p)
        if self.cl.worker != NULL:
            ucp.ucp_worker_destroy(self.cl.worker)
            ucp.ucp_cleanup(self.cl.context)
        sk.pthread_mutex_destroy(&self.cl.io_lock)
        for i in range(REPLY_SLOTS):
            free(self.cl.slots[i].data)
        free(self.cl)
        free(self.conns)
        self.cl = NULL
        self.conns = NULL

    cdef int _check_open(self) except -1:
        if self.cl == NULL or smb_load_int(&self.closing):
            raise _errors.UsageError("the SMB client is closed")
        return 0

    def connect(self, str host, int port):
        """Create a UCX endpoint to host:port; returns its connection index."""
        self._check_open()
        if self.cl.worker == NULL:
            raise _errors.UsageError("this client core uses sockets: connect through adopt_socket()")
        cdef ucp.ucp_ep_params_t params
        cdef sockaddr_in addr
        if self.nconns >= MAX_CONNS:
            raise _errors.SMBValueError("too many SMB servers for one client (1024)")
        memset(&addr, 0, sizeof(addr))
        addr.sin_family = AF_INET
        addr.sin_port = htons(port)
        if inet_pton(AF_INET, host.encode(), &addr.sin_addr) != 1:
            raise _errors.SMBValueError(f"server address {host!r} is not an IPv4 address")
        cdef int ci = self.nconns
        cdef client_conn_t *c = &self.conns[ci]
        params.field_mask = (ucp.UCP_EP_PARAM_FIELD_FLAGS | ucp.UCP_EP_PARAM_FIELD_SOCK_ADDR
                             | ucp.UCP_EP_PARAM_FIELD_ERR_HANDLER
                             | ucp.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE)
        params.flags = ucp.UCP_EP_PARAMS_FLAGS_CLIENT_SERVER
        params.sockaddr.addr = <ucp.sockaddr*>&addr
        params.sockaddr.addrlen = sizeof(addr)
        params.err_mode = ucp.UCP_ERR_HANDLING_MODE_PEER
        params.err_handler.cb = _client_ep_error
        params.err_handler.arg = c
        CHKERR(ucp.ucp_ep_create(self.cl.worker, &params, &c.ep), f"cannot connect to {host}:{port}")
        self.nconns += 1
        return ci

    def progress(self):
        """Progress once (lets the transport report a dead peer)."""
        self._enter()
        with nogil:
            self._progress(0)
        self._leave()

    def conn_failed(self, int ci):
        return self.conns == NULL or bool(self.conns[ci].failed)

    def conn_status(self, int ci):
        return ucp.UCS_ERR_NOT_CONNECTED if self.conns == NULL else self.conns[ci].status

    def fail_conn(self, int ci):
        """Give up on a server (a transfer to it timed out): purge its requests."""
        cdef ucp.ucp_request_param_t param
        if self.conns == NULL or self.conns[ci].closed:
            return
        if self.conns[ci].fd >= 0:
            self._enter()
            with nogil:
                sk.pthread_mutex_lock(&self.cl.io_lock)
                client_sock_fail(&self.conns[ci], ucp.UCS_ERR_TIMED_OUT)
                sk.pthread_mutex_unlock(&self.cl.io_lock)
            self._leave()
            return
        self.conns[ci].closed = 1
        self.conns[ci].status = ucp.UCS_ERR_TIMED_OUT
        smb_store_int(&self.conns[ci].failed, 1)
        param.op_attr_mask = ucp.UCP_OP_ATTR_FIELD_FLAGS
        param.flags = ucp.UCP_EP_CLOSE_FLAG_FORCE
        p = ucp.ucp_ep_close_nbx(self.conns[ci].ep, &param)
        if ucp.UCS_PTR_IS_PTR(p):
            ucp.ucp_request_free(p)

    cdef uint64_t _alloc_slot(self) except? 0xFFFFFFFFFFFFFFFF:
        cdef int idx
        with self.slot_lock:
            if not self.free_slots:
                raise _errors.SMBMemoryError("more than 8192 SMB requests in flight; wait on some first")
            idx = self.free_slots.pop()
        cdef reply_slot_t *s = &self.cl.slots[idx]
        s.gen = <uint32_t>(s.gen + 1)
        s.data = NULL
        s.length = 0
        s.dest = NULL
        s.dest_len = 0
        s.status = 0
        smb_store_int(&s.state, SLOT_PENDING)
        return (<uint64_t>s.gen << 16) | idx

    def release_slot(self, uint64_t slot_id):
        cdef int idx = slot_id & 0xFFFF
        cdef int i
        cdef reply_slot_t *s
        if self.cl == NULL:
            return
        s = &self.cl.slots[idx]
        if s.gen != <uint32_t>(slot_id >> 16):
            return
        if self.cl.worker == NULL:
            # A socket reply may be half read into this slot: the rest is discarded.
            # Counted as active, so a concurrent close() waits before freeing the lock.
            smb_fetch_add_int(&self.active, 1)
            if smb_load_int(&self.closing):
                smb_fetch_add_int(&self.active, -1)
                return
            with nogil:
                sk.pthread_mutex_lock(&self.cl.io_lock)
                for i in range(self.nconns):
                    if self.conns[i].fd >= 0 and self.conns[i].rx.slot == idx:
                        self.conns[i].rx.slot = -1
                        self.conns[i].rx.dest = NULL
                        smb_store_int(&s.state, SLOT_DONE)
                sk.pthread_mutex_unlock(&self.cl.io_lock)
            smb_fetch_add_int(&self.active, -1)
        # A reply may be landing right now: claim the slot or wait for it to finish.
        while not smb_cas_int(&s.state, SLOT_PENDING, SLOT_FREE):
            if smb_load_int(&s.state) == SLOT_DONE:
                smb_store_int(&s.state, SLOT_FREE)
                break
            if smb_load_int(&s.state) == SLOT_FREE:
                return
        s.gen = <uint32_t>(s.gen + 1)
        free(s.data)
        s.data = NULL
        s.dest = NULL
        with self.slot_lock:
            self.free_slots.append(idx)

    def post_request(self, Pending pending, int ci, int op, payload):
        """Send one request (header + payload) to connection ci; its reply goes into `pending`."""
        self._check_open()
        cdef const unsigned char[::1] view = payload
        cdef size_t plen = view.shape[0]
        cdef size_t total = sizeof(smb_hdr_t) + plen
        cdef char *buf = <char*>malloc(total)
        if buf == NULL:
            raise MemoryError()
        cdef uint64_t slot_id
        try:
            slot_id = self._alloc_slot()
        except BaseException:
            free(buf)
            raise
        cdef smb_hdr_t *h = <smb_hdr_t*>buf
        h.magic = SMB_MAGIC
        h.op = op
        h.status = 0
        h.length = <uint32_t>plen
        h.reserved = 0
        h.req_id = slot_id
        if plen:
            memcpy(buf + sizeof(smb_hdr_t), &view[0], plen)
        pending.add_slot(slot_id, ci)
        cdef ucp.ucp_request_param_t param
        param.op_attr_mask = (ucp.UCP_OP_ATTR_FIELD_CALLBACK | ucp.UCP_OP_ATTR_FIELD_USER_DATA
                              | ucp.UCP_OP_ATTR_FIELD_FLAGS)
        # Eager only: the server takes whole messages in its callback (a
        # rendezvous request would arrive without its header).
        param.flags = ucp.UCP_AM_SEND_FLAG_REPLY | ucp.UCP_AM_SEND_FLAG_EAGER
        param.cb.send = _free_cb
        param.user_data = buf
        if self.conns[ci].fd >= 0:
            self._sock_send(ci, buf, total, NULL, 0)
            return
        cdef ucp.ucp_ep_h ep = self.conns[ci].ep
        cdef ucs_status_ptr_t p
        if self.conns[ci].failed:
            free(buf)
            return
        self._enter()
        with nogil:
            p = ucp.ucp_am_send_nbx(ep, AM_REQUEST, NULL, 0, buf, total, &param)
        self._leave()
        if not ucp.UCS_PTR_IS_PTR(p):
            free(buf)
            if ucp.UCS_PTR_IS_ERR(p) and pending.error_status == 0:
                pending.error_status = ucp.UCS_PTR_STATUS(p)
                pending.error_conn = ci

    def rkey(self, int ci, uint32_t rid, bytes packed):
        """Unpack (once) the remote key of region rid on connection ci."""
        cdef ucp.ucp_rkey_h rkey = NULL
        key = (ci, rid)
        handle = self.rkeys.get(key)
        if handle is None:
            self._check_open()
            CHKERR(ucp.ucp_ep_rkey_unpack(self.conns[ci].ep, <const char*>packed, &rkey),
                   "ucp_ep_rkey_unpack")
            handle = <uintptr_t>rkey
            self.rkeys[key] = handle
        return handle

    def forget_rkey(self, int ci, uint32_t rid):
        handle = self.rkeys.pop((ci, rid), None)
        if handle is not None and self.cl != NULL:
            ucp.ucp_rkey_destroy(<ucp.ucp_rkey_h><uintptr_t>handle)

    def post_put(self, Pending pending, int ci, uintptr_t local, size_t nbytes,
                 uint32_t rid, uint64_t offset, uint64_t remote, uintptr_t rkey):
        """Write nbytes at `local` to region rid at byte `offset` (socket: a checked
        request per GiB; UCX: a one-sided put to `remote` with `rkey`)."""
        cdef ucp.ucp_request_param_t param
        cdef ucs_status_ptr_t p
        cdef put_desc_t desc
        cdef size_t done = 0, piece
        cdef uint64_t slot_id
        if self.conns[ci].fd >= 0:
            self._check_open()
            while True:
                piece = min(nbytes - done, <size_t>(1 << 30))
                slot_id = self._alloc_slot()
                pending.add_slot(slot_id, ci, True)
                desc.region = rid
                desc.reserved = 0
                desc.offset = offset + done
                self._sock_send(ci, self._data_head(OP_PUT, slot_id, sizeof(desc) + piece, &desc, sizeof(desc)),
                                sizeof(smb_hdr_t) + sizeof(desc), <const char*>(local + done), piece)
                done += piece
                if done >= nbytes:
                    return
        self._enter()
        cdef ucp.ucp_ep_h ep = self.conns[ci].ep
        param.op_attr_mask = 0
        with nogil:
            p = ucp.ucp_put_nbx(ep, <void*>local, nbytes, remote, <ucp.ucp_rkey_h>rkey, &param)
        self._leave()
        pending.add_request(p, ci)

    def post_get(self, Pending pending, int ci, uintptr_t local, size_t nbytes,
                 uint32_t rid, uint64_t offset, uint64_t remote, uintptr_t rkey):
        """Read nbytes of region rid at byte `offset` into `local` (see post_put)."""
        cdef ucp.ucp_request_param_t param
        cdef ucs_status_ptr_t p
        cdef get_desc_t desc
        cdef size_t done = 0, piece
        cdef uint64_t slot_id
        cdef reply_slot_t *s
        if self.conns[ci].fd >= 0:
            self._check_open()
            while True:
                piece = min(nbytes - done, <size_t>(1 << 30))
                slot_id = self._alloc_slot()
                s = &self.cl.slots[slot_id & 0xFFFF]
                s.dest = <char*>(local + done)
                s.dest_len = piece
                pending.add_slot(slot_id, ci, True)
                desc.region = rid
                desc.reserved = 0
                desc.offset = offset + done
                desc.nbytes = piece
                self._sock_send(ci, self._data_head(OP_GET, slot_id, sizeof(desc), &desc, sizeof(desc)),
                                sizeof(smb_hdr_t) + sizeof(desc), NULL, 0)
                done += piece
                if done >= nbytes:
                    return
        self._enter()
        cdef ucp.ucp_ep_h ep = self.conns[ci].ep
        param.op_attr_mask = 0
        with nogil:
            p = ucp.ucp_get_nbx(ep, <void*>local, nbytes, remote, <ucp.ucp_rkey_h>rkey, &param)
        self._leave()
        pending.add_request(p, ci)

    def post_flush(self, Pending pending, int ci):
        """Remote completion of earlier puts on ci (puts complete locally first;
        a socket put completes only when the server acknowledged it)."""
        cdef ucp.ucp_request_param_t param
        cdef ucs_status_ptr_t p
        if self.conns[ci].fd >= 0:
            return
        self._enter()
        cdef ucp.ucp_ep_h ep = self.conns[ci].ep
        param.op_attr_mask = 0
        with nogil:
            p = ucp.ucp_ep_flush_nbx(ep, &param)
        self._leave()
        pending.add_request(p, ci)

    # ------------------------------------------------ same-node mapping
    def map_arena(self, str path, uint64_t size):
        """Map a same-host server's arena (/proc/<pid>/fd/<fd>); its address, or 0 if it cannot."""
        cdef int fd = open_fd(path.encode(), O_RDWR)
        if fd < 0:
            return 0
        cdef void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        close(fd)
        if p == MAP_FAILED:
            return 0
        self.maps.append((<uintptr_t>p, size))
        return <uintptr_t>p


def prefault(uintptr_t addr, size_t nbytes):
    """Map [addr, addr+nbytes) of a mapped arena into this process's page tables now
    (MADV_POPULATE_WRITE, Linux 5.14+), so the first transfer does not pay one
    page fault per 4 KiB. Returns False where the kernel cannot."""
    cdef uintptr_t start = addr & ~(<uintptr_t>4095)
    cdef size_t length = nbytes + (addr - start)
    cdef int rc
    if nbytes == 0:
        return True
    with nogil:
        rc = madvise(<void*>start, length, SMB_MADV_POPULATE_WRITE)
    return rc == 0


def memcpy_nogil(uintptr_t dst, uintptr_t src, size_t nbytes):
    """memcpy with the GIL released (same-node transfers)."""
    with nogil:
        memcpy(<void*>dst, <const void*>src, nbytes)


def local_fetch_add(uintptr_t addr, int64_t value):
    return smb_fetch_add64(<int64_t*>addr, value)


def local_compare_swap(uintptr_t addr, int64_t expected, int64_t desired):
    return smb_cas64(<int64_t*>addr, expected, desired)


def local_load(uintptr_t addr):
    return smb_load64(<int64_t*>addr)


def local_generation(uintptr_t table, uint32_t rid):
    """The generation the mapped arena's table holds for rid's slot (0: none)."""
    return smb_load_u32(<uint32_t*>table + (rid & 0xFFFF))


def buffer_address(obj, bint writable):
    """(address, nbytes, keepalive) of any C-contiguous buffer, without copying."""
    cdef Py_buffer view
    flags = PyBUF_ANY_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0)
    PyObject_GetBuffer(obj, &view, flags)
    try:
        return <uintptr_t>view.buf, view.len
    finally:
        PyBuffer_Release(&view)
