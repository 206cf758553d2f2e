# ================================================================== server
cdef enum conn_state_t:
    CONN_FREE = 0
    CONN_AUTH = 2          # a socket the gate proved (eddis.smb.handshake)

cdef struct server_conn_t:
    int state
    uint32_t gen
    int index
    double opened
    int fd                  # the proven peer's socket
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
    # rdma transport: UCX serves one-sided put/get into registered regions; it has no
    # listener, its worker address goes out only over proven sockets (NULL: socket only)
    ucp.ucp_context_h context
    ucp.ucp_worker_h worker
    ucp.ucp_mem_h gen_memh      # the arena's generation table, remote-readable only
    int efd
    volatile int stop
    char *arena
    uint64_t arena_size
    char *hello_reply
    size_t hello_reply_len
    void *py_handler        # PyObject*: control requests
    server_conn_t conns[MAX_CONNS]
    int conn_hi
    region_t *regions
    uint64_t requests
    uint64_t refused
    uint64_t put_bytes      # data the request loop itself received into regions (OP_PUT)
    uint64_t get_bytes      # data the request loop itself sent out of regions (OP_GET)
    uint64_t registrations  # regions registered with UCX now (rdma)
    vp.smb_vecpool_t *vecpool   # reduction threads (NULL before start: the caller alone)
    int reduce_threads
    size_t unsent           # socket transport: SMB_SOCKET_UNSENT of each connection
    double spin             # socket transport: SMB_SERVER_SPIN_US, in seconds
    int adopt_fds[2]        # socket transport: proven sockets handed over by the handshake
    sk.pollfd *pfds
    int *pfd_conns
    char *scratch           # sink for data of a refused put
    const char *failed_call # the call that ended the request loop on its own (NULL: none)
    int failed_errno
    int failed_ucs          # ... or its UCX status (0: an errno)


cdef int server_send_reply(server_t *st, int ci, uint64_t req_id, int status,
                           const void *payload, size_t plen) noexcept nogil:
    """Queue a reply on connection ci's socket."""
    cdef server_conn_t *c = &st.conns[ci]
    if c.state != CONN_AUTH:
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
    return sk.smb_txq_push(&c.txq, buf, total, NULL, 0)


cdef int server_reply_error(server_t *st, int ci, uint64_t req_id, int status,
                            const char *message) noexcept nogil:
    st.refused += 1
    return server_send_reply(st, ci, req_id, status, message, strlen(message))


cdef region_t *get_region(server_t *st, uint32_t rid) noexcept nogil:
    cdef uint32_t idx = rid & 0xFFFF
    cdef region_t *r = &st.regions[idx]
    if not r.valid or r.gen != (rid >> 16):
        return NULL
    return r


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
    cdef char message[320]
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
        if checked_fetch_add64(p, q.a, &old) != 0:
            # a counter that wrapped would hand out a value it handed out before
            snprintf(message, sizeof(message), FETCH_ADD_OVERFLOW, <long long>q.a, <long long>old,
                     <long long>INT64_MIN, <long long>INT64_MAX, <long long>old)
            server_reply_error(st, ci, req_id, ucp.UCS_ERR_INVALID_PARAM, message)
            return
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
    if q.kind == VEC_DOT_NORMS or q.kind == VEC_PAIR_SUM:
        handle_segment_op(st, ci, req_id, &q, payload + sizeof(vec_req_t), plen - sizeof(vec_req_t))
        return
    if q.nsrc > MAX_VEC_SOURCES or plen != sizeof(vec_req_t) + q.nsrc * sizeof(vec_src_t):
        server_reply_error(st, ci, req_id, ucp.UCS_ERR_INVALID_PARAM, b"vector op: malformed request")
        return
    err = run_vecop(st, &q, <const vec_src_t*>(payload + sizeof(vec_req_t)), &status,
                    &threads_used)
    if err != NULL:
        server_reply_error(st, ci, req_id, status, err)
    else:
        server_send_reply(st, ci, req_id, 0, NULL, 0)


cdef const char *segment_pair(server_t *st, const vec_req_t *q, const vec_src_t *srcs,
                              const char **a, const char **b, int *a_dtype, int *b_dtype,
                              size_t *a_size, size_t *b_size, int *status) noexcept nogil:
    """The two sources of a segment op: their slots' first columns, checked over the
    request's range; NULL, or the refusal (and *status)."""
    cdef region_t *r
    cdef int i
    for i in range(2):
        r = get_region(st, srcs[i].region)
        if r == NULL:
            status[0] = ucp.UCS_ERR_NO_ELEM
            return b"segment op: unknown source region"
        if r.dtype > 2:
            status[0] = ucp.UCS_ERR_INVALID_PARAM
            return b"segment op: sources must be float32, float16 or bfloat16 regions"
        if check_range(r, srcs[i].slot, q.start, q.count) != 0:
            status[0] = ucp.UCS_ERR_OUT_OF_RANGE
            return b"segment op: source slot/range outside the region"
        if i == 0:
            a[0] = st.arena + r.offset + srcs[i].slot * r.length * r.itemsize
            a_dtype[0] = r.dtype
            a_size[0] = r.itemsize
        else:
            b[0] = st.arena + r.offset + srcs[i].slot * r.length * r.itemsize
            b_dtype[0] = r.dtype
            b_size[0] = r.itemsize
    return NULL


cdef void handle_segment_op(server_t *st, int ci, uint64_t req_id, const vec_req_t *q,
                            const char *body, size_t blen) noexcept nogil:
    """Adasum's per-tensor work on this server's columns: segments (a tensor's part of the
    request's range [start, start+count)) of two sources a and b. VEC_DOT_NORMS replies
    (a.b, a.a, b.b) as three float64 per segment, so that the client can add up the
    partial sums of every server before it knows a tensor's coefficients; VEC_PAIR_SUM
    writes dst = weight_a * a + weight_b * b per segment (fp32 accumulation, dst may be
    a or b), each segment a weighted sum on the reduction threads."""
    cdef size_t fixed = 2 * sizeof(vec_src_t)
    cdef size_t nseg, i
    cdef const vec_src_t *srcs = <const vec_src_t*>body
    cdef const char *segs
    cdef vec_segment_t seg
    cdef const char *a = NULL
    cdef const char *b = NULL
    cdef int a_dtype = 0, b_dtype = 0
    cdef size_t a_size = 0, b_size = 0
    cdef int status = 0
    cdef int rc = 0
    cdef int threads_used = 0
    cdef const char *err
    cdef region_t *dst
    cdef char *d = NULL
    cdef double *dots
    cdef const void *ptrs[2]
    cdef int dtypes[2]
    cdef double weights[2]
    cdef vp.smb_vecjob_t job
    if q.nsrc != 2 or blen < fixed or (blen - fixed) % sizeof(vec_segment_t) != 0:
        server_reply_error(st, ci, req_id, ucp.UCS_ERR_INVALID_PARAM,
                           b"segment op: malformed request (two sources, then whole segments)")
        return
    nseg = (blen - fixed) // sizeof(vec_segment_t)
    if nseg > MAX_VEC_SEGMENTS:
        server_reply_error(st, ci, req_id, ucp.UCS_ERR_INVALID_PARAM,
                           b"segment op: too many segments in one request (at most 16384)")
        return
    segs = body + fixed
    err = segment_pair(st, q, srcs, &a, &b, &a_dtype, &b_dtype, &a_size, &b_size, &status)
    if err != NULL:
        server_reply_error(st, ci, req_id, status, err)
        return
    for i in range(nseg):
        memcpy(&seg, segs + i * sizeof(vec_segment_t), sizeof(seg))
        if seg.start < q.start or seg.count > q.count or seg.start - q.start > q.count - seg.count:
            server_reply_error(st, ci, req_id, ucp.UCS_ERR_OUT_OF_RANGE,
                               b"segment op: a segment lies outside the request's range")
            return
    if q.kind == VEC_DOT_NORMS:
        dots = <double*>malloc(max(nseg, 1) * 3 * sizeof(double))
        if dots == NULL:
            server_reply_error(st, ci, req_id, ucp.UCS_ERR_NO_MEMORY, b"dot_norms: out of memory")
            return
        for i in range(nseg):
            memcpy(&seg, segs + i * sizeof(vec_segment_t), sizeof(seg))
            rc = vec.smb_dot_norms(a + seg.start * a_size, a_dtype, b + seg.start * b_size, b_dtype,
                                   seg.count, dots + 3 * i)
            if rc != 0:
                break
        if rc != 0:
            server_reply_error(st, ci, req_id, ucp.UCS_ERR_INVALID_PARAM, vec.smb_vecops_strerror(rc))
        else:
            server_send_reply(st, ci, req_id, 0, dots, nseg * 3 * sizeof(double))
        free(dots)
        return
    dst = get_region(st, q.dst_region)
    if dst == NULL:
        server_reply_error(st, ci, req_id, ucp.UCS_ERR_NO_ELEM, b"pair_sum: unknown destination region")
        return
    if dst.dtype > 3:
        server_reply_error(st, ci, req_id, ucp.UCS_ERR_INVALID_PARAM,
                           b"pair_sum: destination is not a float region")
        return
    if check_range(dst, q.dst_slot, q.start, q.count) != 0:
        server_reply_error(st, ci, req_id, ucp.UCS_ERR_OUT_OF_RANGE,
                           b"pair_sum: destination slot/range outside the region")
        return
    d = st.arena + dst.offset + q.dst_slot * dst.length * dst.itemsize
    dtypes[0] = a_dtype
    dtypes[1] = b_dtype
    job.kind = vp.SMB_VECJOB_WEIGHTED_SUM
    job.dst_dtype = dst.dtype
    job.srcs = ptrs
    job.src_dtypes = dtypes
    job.weights = weights
    job.nsrc = 2
    job.alpha = 0.0
    for i in range(nseg):
        memcpy(&seg, segs + i * sizeof(vec_segment_t), sizeof(seg))
        ptrs[0] = a + seg.start * a_size
        ptrs[1] = b + seg.start * b_size
        weights[0] = seg.weight_a
        weights[1] = seg.weight_b
        job.dst = d + seg.start * dst.itemsize
        job.count = seg.count
        rc = vp.smb_vecpool_run(st.vecpool, &job, &threads_used)
        if rc != 0:
            server_reply_error(st, ci, req_id, ucp.UCS_ERR_INVALID_PARAM, b"pair_sum: kernel refused the dtype")
            return
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
    elif h.op == OP_GET:
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
    st.get_bytes += q.nbytes
    # the arena itself is the reply's tail: no copy
    sk.smb_txq_push(&st.conns[ci].txq, head, sizeof(smb_hdr_t), st.arena + r.offset + q.offset, q.nbytes)


cdef bint loop_failed(server_t *st, const char *call) noexcept nogil:
    """After a failed call of the request loop: whether it must end (not an interruption).
    Spinning on a call that keeps failing would leave a server that looks alive and
    answers nothing; ended, the loop is named by ServerCore.loop_failure()."""
    cdef int err = errno
    if err == EINTR or err == EAGAIN:
        return False
    st.failed_errno = err
    st.failed_call = call
    return True


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
    while read(st.adopt_fds[0], &fd, sizeof(fd)) == sizeof(fd):
        slot = -1
        for i in range(MAX_CONNS):
            if st.conns[i].state == CONN_FREE:
                slot = i
                break
        if slot < 0 or st.stop or sk.smb_sock_prepare(fd, st.unsent) != 0:
            close(fd)
            st.refused += 1
            continue
        c = &st.conns[slot]
        memset(&c.rx, 0, sizeof(c.rx))
        c.txq.first = NULL
        c.txq.last = NULL
        c.fd = fd
        c.index = slot
        c.opened = smb_now()
        c.state = CONN_AUTH
        if slot + 1 > st.conn_hi:
            st.conn_hi = slot + 1


cdef void count_landed_put(server_t *st, uint32_t rid, int *status, const char **error) noexcept nogil:
    """A put's count: add 1 to the counter ``rid`` after the put's data landed (the same CPU
    atomic a same-node reader loads, so that who sees the count sees the data)."""
    cdef region_t *r = get_region(st, rid)
    cdef int64_t old
    if r == NULL:
        status[0] = ucp.UCS_ERR_NO_ELEM
        error[0] = b"the write landed, but its count did not: unknown counter (freed?)"
    elif r.dtype != 4:
        status[0] = ucp.UCS_ERR_INVALID_PARAM
        error[0] = b"the write landed, but its count did not: the region named for it is no counter"
    elif checked_fetch_add64(<int64_t*>(st.arena + r.offset), 1, &old) != 0:
        status[0] = ucp.UCS_ERR_INVALID_PARAM
        error[0] = b"the write landed, but its count did not: the counter is at the int64 maximum"


cdef void sock_finish_put(server_t *st, int ci) noexcept nogil:
    cdef sock_rx_t *rx = &st.conns[ci].rx
    if rx.status == 0 and rx.desc.count_region != 0:
        count_landed_put(st, rx.desc.count_region, &rx.status, &rx.error)
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
                st.put_bytes += n
            if rx.remaining == 0:
                sock_finish_put(st, ci)
    return total


cdef int worker_progress(server_t *st) noexcept nogil:
    """rdma: let UCX run what needs this side (connection set-up; the software RMA of the
    test-only tcp transport), then arm its event descriptor. 1 when UCX did something or
    must be polled again at once, 0 when the loop may sleep, -1 when arming failed."""
    cdef int busy = 0
    cdef int rounds
    cdef ucs_status_t s
    for rounds in range(64):
        if ucp.ucp_worker_progress(st.worker) == 0:
            break
        busy = 1
    s = ucp.ucp_worker_arm(st.worker)
    if s == ucp.UCS_OK:
        return busy
    if s == ucp.UCS_ERR_BUSY:
        return 1
    st.failed_ucs = s
    st.failed_call = b"ucp_worker_arm()"
    return -1


cdef void server_loop_sock(server_t *st) noexcept nogil:
    cdef double now, last_busy = 0
    cdef int i, k, n, ci, timeout, first
    cdef long moved
    cdef int busy, ucx_busy = 0
    cdef server_conn_t *c
    while not st.stop:
        st.pfds[0].fd = st.adopt_fds[0]
        st.pfds[0].events = sk.POLLIN
        st.pfds[0].revents = 0
        k = 1
        if st.worker != NULL:
            ucx_busy = worker_progress(st)
            if ucx_busy < 0:
                return
            st.pfds[1].fd = st.efd
            st.pfds[1].events = sk.POLLIN
            st.pfds[1].revents = 0
            k = 2
        first = k
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
        # SMB_SERVER_SPIN_US: poll without sleeping a little longer after something moved,
        # which saves a wakeup per request of a burst where the server has a core of its own
        timeout = 0 if ucx_busy or now - last_busy < st.spin else 100
        n = sk.poll(st.pfds, k, timeout)
        if n < 0 and loop_failed(st, b"poll()"):
            return
        if ucx_busy:
            last_busy = now
        if n <= 0:
            continue
        busy = 0
        if st.pfds[0].revents:
            sock_adopt(st)
            busy = 1
        for i in range(first, k):
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
    """One smb-server's native state: arena, region table, request loop over proven
    sockets and, with the rdma transport, the UCX context and worker."""
    cdef server_t *st
    cdef int shm_fd
    cdef object handler
    cdef object thread
    cdef public int port
    cdef public bytes gen_key          # rdma: the key of the arena's generation table (read only)
    cdef int started
    cdef uint64_t touched_end

    def __cinit__(self):
        self.st = <server_t*>calloc(1, sizeof(server_t))
        if self.st == NULL:
            raise _no_memory("the SMB server's state")
        self.st.regions = <region_t*>calloc(MAX_REGIONS, sizeof(region_t))
        if self.st.regions == NULL:
            raise _no_memory("the SMB server's region table")
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
                "vector_ops_split": split_ops, "put_bytes": self.st.put_bytes,
                "get_bytes": self.st.get_bytes, "rdma": self.st.worker != NULL,
                "registrations": self.st.registrations}

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
                err = errno
                raise _errors.from_errno(err, f"memfd_create(MFD_HUGETLB) failed: {_os.strerror(err)}")
        else:
            fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0o600)
            if fd < 0:
                err = errno
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
            err = errno
            self.destroy_arena()
            raise _errors.from_errno(err, f"cannot size shared memory to {mapped} bytes: {_os.strerror(err)}")
        cdef void *p = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if p == MAP_FAILED:
            err = errno
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
            raise _no_memory("the SMB server's hello reply")
        memcpy(self.st.hello_reply, <const char*>hello_reply, len(hello_reply))
        self.st.hello_reply_len = len(hello_reply)
        self.handler = handler
        self.st.py_handler = <void*>handler

    def start_sockets(self, bytes hello_reply, handler, int reduce_threads=1, size_t unsent=0,
                      double spin_us=0):
        """Serve requests over proven sockets: the caller proves each peer's token
        (eddis.smb.handshake) and hands the socket over with adopt_socket().
        No port but the caller's own listens. `unsent`: see smb_sock_prepare; `spin_us`: how
        long the loop polls without sleeping after something moved."""
        self._prepare(hello_reply, handler, reduce_threads)
        self.st.unsent = unsent
        self.st.spin = spin_us * 1e-6
        # the hand-over pipe, the UCX worker's event descriptor, one per connection
        self.st.pfds = <sk.pollfd*>calloc(MAX_CONNS + 2, sizeof(sk.pollfd))
        self.st.pfd_conns = <int*>calloc(MAX_CONNS + 2, sizeof(int))
        self.st.scratch = <char*>malloc(SOCK_SCRATCH)
        if self.st.pfds == NULL or self.st.pfd_conns == NULL or self.st.scratch == NULL:
            raise _no_memory("the SMB server's socket tables")
        if sk.smb_pipe_nonblocking(self.st.adopt_fds) != 0:
            err = errno
            raise _errors.from_errno(err, f"cannot create the socket hand-over pipe: {_os.strerror(err)}")
        self.started = 1

    def start_rdma(self, str tls):
        """Add one-sided access (the rdma transport) before the request loop runs: a UCX
        context restricted to the transports ``tls`` names, and a worker that the loop
        progresses. No listener: peers reach it through worker_address, which the server
        gives only over proven sockets, and regions only through the keys it hands out."""
        cdef ucp.ucp_worker_params_t wparams
        if not self.started or self.thread is not None or self.st.context != NULL:
            raise _errors.UsageError("start_rdma() comes after start_sockets() and before the loop runs")
        # no AM: nothing but one-sided access into registered memory reaches this worker
        self.st.context = _new_context(tls, ucp.UCP_FEATURE_RMA | ucp.UCP_FEATURE_WAKEUP)
        wparams.field_mask = ucp.UCP_WORKER_PARAM_FIELD_THREAD_MODE
        wparams.thread_mode = ucp.UCS_THREAD_MODE_SERIALIZED
        CHKERR(ucp.ucp_worker_create(self.st.context, &wparams, &self.st.worker), "ucp_worker_create")
        CHKERR(ucp.ucp_worker_get_efd(self.st.worker, &self.st.efd), "ucp_worker_get_efd")
        if self.st.arena != NULL and self.st.arena_size >= GEN_TABLE_BYTES:
            self.gen_key = self._register(self.st.arena, GEN_TABLE_BYTES, &self.st.gen_memh, False)

    cdef bytes _register(self, void *address, size_t length, ucp.ucp_mem_h *memh, bint writable):
        """Register [address, address+length) with UCX; the packed key of that memory alone.
        ``writable`` False: remote peers may read it, an HCA refuses their writes."""
        cdef ucp.ucp_mem_map_params_t mp
        cdef void *rkey_buf = NULL
        cdef size_t rkey_len = 0
        mp.field_mask = (ucp.UCP_MEM_MAP_PARAM_FIELD_ADDRESS | ucp.UCP_MEM_MAP_PARAM_FIELD_LENGTH
                         | ucp.UCP_MEM_MAP_PARAM_FIELD_PROT)
        mp.address = address
        mp.length = length
        mp.prot = (ucp.UCP_MEM_MAP_PROT_LOCAL_READ | ucp.UCP_MEM_MAP_PROT_LOCAL_WRITE
                   | ucp.UCP_MEM_MAP_PROT_REMOTE_READ | (ucp.UCP_MEM_MAP_PROT_REMOTE_WRITE if writable else 0))
        CHKERR(ucp.ucp_mem_map(self.st.context, &mp, memh), "ucp_mem_map")
        status = ucp.ucp_rkey_pack(self.st.context, memh[0], &rkey_buf, &rkey_len)
        if status != ucp.UCS_OK:
            CHKERR(ucp.ucp_mem_unmap(self.st.context, memh[0]), "ucp_mem_unmap after a failed ucp_rkey_pack",
                   warn_only=True)
            CHKERR(status, "ucp_rkey_pack")
        key = PyBytes_FromStringAndSize(<char*>rkey_buf, rkey_len)
        ucp.ucp_rkey_buffer_release(rkey_buf)
        return key

    @property
    def worker_address(self):
        """This server's UCX worker address (bytes), or None without the rdma transport."""
        cdef ucp.ucp_address_t *address = NULL
        cdef size_t length = 0
        if self.st.worker == NULL:
            return None
        CHKERR(ucp.ucp_worker_get_address(self.st.worker, &address, &length), "ucp_worker_get_address")
        try:
            return PyBytes_FromStringAndSize(<char*>address, length)
        finally:
            ucp.ucp_worker_release_address(self.st.worker, address)

    def adopt_socket(self, int fd):
        """Give a proven connection's socket to the request loop, which owns it from now on."""
        if self.st.adopt_fds[1] < 0 or self.st.stop:
            close(fd)
            raise _errors.UsageError("the SMB server core is not serving sockets")
        if write(self.st.adopt_fds[1], &fd, sizeof(fd)) != sizeof(fd):
            close(fd)
            raise _errors.SMBConnectionError("cannot hand a connection to the request loop")

    def _run(self):
        with nogil:
            server_loop_sock(self.st)

    def run_in_thread(self):
        self.thread = _threading.Thread(target=self._run, name="smb-server-progress", daemon=True)
        self.thread.start()

    def loop_failure(self):
        """None while the request loop runs (or after stop()); else why it ended on its own."""
        thread = self.thread
        if thread is None or thread.is_alive() or self.st.stop:
            return None
        if self.st.failed_call == NULL:
            return "it returned without being asked to stop"
        call = (<bytes>self.st.failed_call).decode()
        if self.st.failed_ucs:
            return f"{call} failed: {_status_text(self.st.failed_ucs)}"
        err = self.st.failed_errno
        why = f"{call} failed: {_os.strerror(err)} (errno {err})"
        if err == EINVAL:
            why += (": it polls one descriptor per connection, more than its open-files limit "
                    "(ulimit -n) allows")
        return why

    def stop(self):
        """Stop the loop, close every connection and release UCX state."""
        if not self.started:
            self._stop_reduce_threads()
            self.destroy_arena()
            return
        self.st.stop = 1
        # unwoken, the loop sees the stop flag within its 100 ms poll
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
        for i in range(MAX_REGIONS):
            if self.st.regions[i].valid:
                if self.st.context != NULL:
                    CHKERR(ucp.ucp_mem_unmap(self.st.context, self.st.regions[i].memh),
                           f"ucp_mem_unmap of region slot {i} (server stop)", warn_only=True)
                self.st.regions[i].valid = 0
        if self.st.gen_memh != NULL:
            CHKERR(ucp.ucp_mem_unmap(self.st.context, self.st.gen_memh),
                   "ucp_mem_unmap of the generation table (server stop)", warn_only=True)
            self.st.gen_memh = NULL
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
            # rdma: remote peers reach this region, and only it, one-sidedly through its key
            rkey = self._register(self.st.arena + offset, nbytes if nbytes else 1, &r.memh, True)
            self.st.registrations += 1
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
            # Unregistered, the region's key no longer opens its memory on an HCA (a stale
            # key faults there instead of reaching the region placed here next). Raising
            # would lose the arena range and slot in the Python allocator (server._release):
            # the region is gone for every client already.
            CHKERR(ucp.ucp_mem_unmap(self.st.context, r.memh), f"ucp_mem_unmap of region {rid}",
                   warn_only=True)
            self.st.registrations -= 1

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
            raise _no_memory(f"weighted_sum's {n} source descriptors")
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
