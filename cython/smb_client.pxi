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
    int fd                  # the proven socket: every request and reply
    ucp.ucp_ep_h ep         # rdma: the endpoint for one-sided put/get (NULL: none)
    int ep_closed
    int failed
    int status
    sock_rx_t rx
    sk.smb_txq_t txq

cdef struct client_t:
    ucp.ucp_context_h context
    ucp.ucp_worker_h worker     # rdma only (NULL: socket transport)
    reply_slot_t slots[REPLY_SLOTS]
    # posting threads and the progressing thread share the socket queues
    sk.pthread_mutex_t io_lock
    # bumped when a pass over the sockets completed replies: what a waiting thread sleeps on
    # while another thread holds io_lock and moves its requests too
    sk.smb_waker_t completions
    unsigned long replies_done      # replies completed by the sockets (under io_lock)
    int64_t shared_waits            # how often a waiting thread slept on another's pass
    sk.pollfd pfds[MAX_CONNS]
    int pfd_conns[MAX_CONNS]
    char scratch[SOCK_SCRATCH]


cdef void _client_ep_error(void *arg, ucp.ucp_ep_h ep, ucs_status_t status) noexcept nogil:
    cdef client_conn_t *c = <client_conn_t*>arg
    c.status = status
    smb_store_int(&c.failed, 1)


# ------------------------------------------------------ client: sockets
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
                cl.replies_done += 1
            rx.slot = -1
            rx.dest = NULL
            rx.phase = RX_HEADER
    return total


cdef long client_sock_progress(client_t *cl, client_conn_t *conns, int nconns,
                               int timeout_ms) noexcept nogil:
    """One pass over the sockets. While another thread makes its pass (this thread's requests
    included), this one sleeps until that pass completes replies or ``timeout_ms`` is up: 1 if
    replies completed meanwhile, else 0. Two threads wait on one client all the time (a
    reducer's relay thread on its writes, its finish thread on its reads); spinning on the lock
    instead kept the one that lost it on the CPU, in sched_yield and context switches, beside
    trainers that need those cores."""
    cdef int i, k = 0
    cdef long moved, total = 0
    cdef client_conn_t *c
    cdef short revents
    cdef unsigned long seen = sk.smb_waker_count(&cl.completions)
    cdef unsigned long done_before
    cdef bint completed
    if sk.pthread_mutex_trylock(&cl.io_lock) != 0:
        if timeout_ms <= 0:
            return 0
        smb_fetch_add64(&cl.shared_waits, 1)
        return sk.smb_waker_wait(&cl.completions, seen, timeout_ms)
    done_before = cl.replies_done
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
    completed = cl.replies_done != done_before
    sk.pthread_mutex_unlock(&cl.io_lock)
    if completed:
        sk.smb_waker_bump(&cl.completions)
    return total


# what ClientCore._post_transfer does
cdef enum transfer_t:
    TRANSFER_PUT
    TRANSFER_GET
    TRANSFER_FLUSH


# wait results
DEF WAIT_DONE = 0
DEF WAIT_TIMEOUT = 1
DEF WAIT_CONN_FAILED = 2
DEF WAIT_CLOSED = 3
# A waiter polls the sockets without sleeping only this many times after anything moved,
# then blocks in poll(): that wakes as soon as a socket is ready, so it costs no latency,
# while polling without a timeout through a transfer of many segments kept a core busy
# (4 ranks on 4 nodes of 2 cores: 2.7 CPU s a step against DDP's 1.1 for the same bytes)
DEF SPIN_POLLS = 2


cdef void *realloc_or_raise(void *p, size_t n) except NULL:
    cdef void *q = realloc(p, n)
    if q == NULL:
        raise _no_memory("the table of requests in flight")
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
                n = self.core._progress(1 if idle >= SPIN_POLLS else 0)
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
    """One client's connections to its servers: a proven socket each for requests and
    replies and, with the rdma transport (start_rdma), a UCX endpoint each for one-sided
    put/get with the remote keys of regions."""
    cdef client_t *cl
    cdef client_conn_t *conns
    cdef int nconns
    cdef list free_slots
    cdef object slot_lock
    cdef dict rkeys                   # (conn, rid) -> [rkey handle as int, handles using it]
    cdef list maps                    # (addr, size) of mapped arenas
    # close() from one thread while another waits or posts must not free the
    # worker under it: operations count themselves in `active`, close() sets
    # `closing` (waits see it and stop) and waits for `active` to drain.
    cdef int active
    cdef int closing
    cdef int completions_made          # cl.completions was initialised (destroy it on close)

    def __cinit__(self):
        self.cl = <client_t*>calloc(1, sizeof(client_t))
        self.conns = <client_conn_t*>calloc(MAX_CONNS, sizeof(client_conn_t))
        if self.cl == NULL or self.conns == NULL:
            raise _no_memory("the SMB client's state")
        for i in range(MAX_CONNS):
            self.conns[i].fd = -1
        sk.pthread_mutex_init(&self.cl.io_lock, NULL)
        err = sk.smb_waker_init(&self.cl.completions)
        if err != 0:
            raise _errors.from_errno(err, f"cannot create the SMB client's completion waker: "
                                          f"{_os.strerror(err)}")
        self.completions_made = 1
        self.free_slots = list(range(REPLY_SLOTS - 1, -1, -1))
        self.slot_lock = _threading.Lock()
        self.rkeys = {}
        self.maps = []

    def start_rdma(self, str tls):
        """The rdma transport: a UCX context restricted to the transports ``tls`` names and a
        worker, for endpoints made with connect_rdma(). Before any endpoint, once."""
        cdef ucp.ucp_worker_params_t wparams
        self._check_open()
        if self.cl.context != NULL:
            raise _errors.UsageError("start_rdma(): this client core has a UCX worker already")
        self.cl.context = _new_context(tls, ucp.UCP_FEATURE_RMA)
        # MULTI: the runtime's communication thread and the main thread share it.
        wparams.field_mask = ucp.UCP_WORKER_PARAM_FIELD_THREAD_MODE
        wparams.thread_mode = ucp.UCS_THREAD_MODE_MULTI
        status = ucp.ucp_worker_create(self.cl.context, &wparams, &self.cl.worker)
        if status != ucp.UCS_OK:
            ucp.ucp_cleanup(self.cl.context)
            self.cl.context = NULL
            CHKERR(status, "ucp_worker_create")

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
        cdef unsigned n = 0
        if self.cl.worker != NULL:
            # one-sided transfers complete in the worker: never sleep on the sockets
            n = ucp.ucp_worker_progress(self.cl.worker)
            timeout_ms = 0
        return (client_sock_progress(self.cl, self.conns, self.nconns, timeout_ms) > 0) or n != 0

    @property
    def shared_waits(self):
        """How often a thread waiting for its requests slept while another thread moved the
        sockets (socket transport), instead of polling them itself."""
        return 0 if self.cl == NULL else smb_load64(&self.cl.shared_waits)

    @property
    def has_rdma(self):
        return self.cl != NULL and self.cl.worker != NULL

    @property
    def memory_types(self):
        """What this core's one-sided transfers may move data from ("host", "cuda", ...);
        empty without the rdma transport."""
        cdef ucp.ucp_context_attr_t attr
        if self.cl == NULL or self.cl.context == NULL:
            return []
        attr.field_mask = ucp.UCP_ATTR_FIELD_MEMORY_TYPES
        CHKERR(ucp.ucp_context_query(self.cl.context, &attr), "ucp_context_query")
        return [name for code, name in MEMORY_TYPES.items() if attr.memory_types & (1 << code)]

    def adopt_socket(self, int fd, size_t unsent=0):
        """Take a socket on which the handshake proved the token; returns its connection index.
        `unsent`: see smb_sock_prepare."""
        self._check_open()
        if self.nconns >= MAX_CONNS:
            close(fd)
            raise _errors.SMBValueError("too many SMB servers for one client (1024)")
        if sk.smb_sock_prepare(fd, unsent) != 0:
            err = errno
            close(fd)
            raise _errors.from_errno(err, f"cannot use the server connection: {_os.strerror(err)}")
        cdef int ci = self.nconns
        memset(&self.conns[ci], 0, sizeof(client_conn_t))
        self.conns[ci].fd = fd
        self.conns[ci].rx.slot = -1
        self.nconns += 1
        return ci

    def connect_rdma(self, int ci, bytes address, bint peer_errors=True):
        """An endpoint to the server of connection ci, at the worker address it gave over
        that proven connection; one-sided transfers to it use the keys of its regions.
        ``peer_errors``: UCX reports a lost server on the endpoint (False where the
        transports are shared memory only, which cannot)."""
        cdef ucp.ucp_ep_params_t params
        cdef client_conn_t *c
        self._check_open()
        if self.cl.worker == NULL:
            raise _errors.UsageError("this client core has no UCX worker (the socket transport)")
        if ci < 0 or ci >= self.nconns or self.conns[ci].ep != NULL:
            raise _errors.UsageError(f"connection {ci} has no socket or has an endpoint already")
        c = &self.conns[ci]
        params.field_mask = (ucp.UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | ucp.UCP_EP_PARAM_FIELD_ERR_HANDLER
                             | ucp.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE)
        params.address = <const ucp.ucp_address_t*><const char*>address
        params.err_mode = ucp.UCP_ERR_HANDLING_MODE_PEER
        params.err_handler.cb = _client_ep_error
        params.err_handler.arg = c
        if not peer_errors:
            # UCX's shared-memory transports cannot report a lost peer (and refuse an
            # endpoint that asks them to); the proven socket beside the endpoint does
            params.field_mask = ucp.UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
        status = ucp.ucp_ep_create(self.cl.worker, &params, &c.ep)
        if status != ucp.UCS_OK:
            c.ep = NULL
            CHKERR(status, f"ucp_ep_create to server connection {ci} (no UCX transport SMB may use "
                           f"reaches it: {_status_text(status)})")

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
            raise _no_memory("a request on the send queue")
        return 0

    cdef char *_data_head(self, int op, uint64_t slot_id, size_t length, const void *desc,
                          size_t desc_len) except NULL:
        cdef char *head = <char*>malloc(sizeof(smb_hdr_t) + desc_len)
        if head == NULL:
            raise _no_memory("a transfer's request header")
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
        """Destroy remote keys, close sockets and endpoints, release the worker and context."""
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
        for handle, _ in self.rkeys.values():
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
            if self.conns[i].ep == NULL or self.conns[i].ep_closed:
                continue
            self.conns[i].ep_closed = 1
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
        if self.completions_made:
            sk.smb_waker_destroy(&self.cl.completions)
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

    def progress(self):
        """Progress once (lets the transport report a dead peer)."""
        self._enter()
        with nogil:
            self._progress(0)
        self._leave()

    def conn_failed(self, int ci):
        return self.conns == NULL or bool(smb_load_int(&self.conns[ci].failed))

    def conn_status(self, int ci):
        return ucp.UCS_ERR_NOT_CONNECTED if self.conns == NULL else self.conns[ci].status

    def fail_conn(self, int ci, int status=ucp.UCS_ERR_TIMED_OUT):
        """Give up on a server (a transfer to it timed out, or a request on it failed with
        ``status`` before the transport reported the peer lost): purge its requests. The
        first status a connection failed with is the one it keeps."""
        cdef ucp.ucp_request_param_t param
        cdef client_conn_t *c
        if self.conns == NULL or self.cl == NULL:
            return
        c = &self.conns[ci]
        self._enter()
        try:
            if c.fd >= 0:
                with nogil:
                    sk.pthread_mutex_lock(&self.cl.io_lock)
                    client_sock_fail(c, status)
                    sk.pthread_mutex_unlock(&self.cl.io_lock)
            elif not smb_load_int(&c.failed):
                c.status = status
                smb_store_int(&c.failed, 1)
            if c.ep != NULL and not c.ep_closed:
                # the transfers in flight on it end now, so no late one lands in a caller's buffer
                c.ep_closed = 1
                param.op_attr_mask = ucp.UCP_OP_ATTR_FIELD_FLAGS
                param.flags = ucp.UCP_EP_CLOSE_FLAG_FORCE
                p = ucp.ucp_ep_close_nbx(c.ep, &param)
                if ucp.UCS_PTR_IS_PTR(p):
                    ucp.ucp_request_free(p)
        finally:
            self._leave()

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
            raise _no_memory(f"a {total}-byte request")
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
        self._sock_send(ci, buf, total, NULL, 0)

    def rkey(self, int ci, rid, bytes packed):
        """Unpack (once) the remote key of region rid (or of the generation table, rid
        "generations"), which the server of connection ci gave over that connection; a
        handle for post_put/post_get."""
        cdef ucp.ucp_rkey_h rkey = NULL
        key = (ci, rid)
        entry = self.rkeys.get(key)
        if entry is None:
            self._check_open()
            if self.conns[ci].ep == NULL or self.conns[ci].ep_closed:
                raise _errors.SMBConnectionError(f"no UCX endpoint to server connection {ci} (lost, or "
                                                 f"never connected); its keys cannot be used")
            CHKERR(ucp.ucp_ep_rkey_unpack(self.conns[ci].ep, <const char*>packed, &rkey),
                   f"ucp_ep_rkey_unpack of region {rid}'s key")
            entry = [<uintptr_t>rkey, 0]
            self.rkeys[key] = entry
        entry[1] += 1      # handles of one region share its key: destroyed with the last
        return entry[0]

    def forget_rkey(self, int ci, rid):
        """One handle of region rid is done with its key (rkey())."""
        entry = self.rkeys.get((ci, rid))
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self.rkeys[(ci, rid)]
            if self.cl != NULL:
                ucp.ucp_rkey_destroy(<ucp.ucp_rkey_h><uintptr_t>entry[0])

    def post_put(self, Pending pending, int ci, uintptr_t local, size_t nbytes,
                 uint32_t rid, uint64_t offset, uint64_t remote, uintptr_t rkey, uint32_t count_rid=0):
        """Write nbytes at `local` to region rid at byte `offset`: with a key (rkey != 0),
        a one-sided put to address `remote`; else requests of a MiB that the server checks.
        `count_rid`: a counter of that server that the server adds 1 to once the data landed
        (socket transport only; a one-sided put cannot carry a count)."""
        if count_rid and rkey:
            raise _errors.SMBValueError("a one-sided put cannot count itself in; count after its flush")
        self._post_transfer(pending, ci, TRANSFER_PUT, local, nbytes, rid, offset, remote, rkey, count_rid)

    def post_get(self, Pending pending, int ci, uintptr_t local, size_t nbytes,
                 uint32_t rid, uint64_t offset, uint64_t remote, uintptr_t rkey):
        """Read nbytes of region rid at byte `offset` into `local` (see post_put)."""
        self._post_transfer(pending, ci, TRANSFER_GET, local, nbytes, rid, offset, remote, rkey)

    def fence(self):
        """rdma: the one-sided transfers posted after this run after those posted before
        (a generation read after a get tells whether the get read the region it meant)."""
        if self.cl == NULL or self.cl.worker == NULL:
            return
        self._enter()
        try:
            CHKERR(ucp.ucp_worker_fence(self.cl.worker), "ucp_worker_fence")
        finally:
            self._leave()

    def post_flush(self, Pending pending, int ci):
        """Remote completion of earlier puts on ci (puts complete locally first;
        a socket put completes only when the server acknowledged it)."""
        self._post_transfer(pending, ci, TRANSFER_FLUSH, 0, 0, 0, 0, 0, 0)

    cdef int _post_transfer(self, Pending pending, int ci, transfer_t kind, uintptr_t local, size_t nbytes,
                            uint32_t rid, uint64_t offset, uint64_t remote, uintptr_t rkey,
                            uint32_t count_rid=0) except -1:
        """The one way data moves to or from a remote region; its outcome lands in `pending`."""
        cdef ucp.ucp_request_param_t param
        cdef ucs_status_ptr_t p
        cdef ucp.ucp_ep_h ep
        if rkey == 0 and kind != TRANSFER_FLUSH:
            self._check_open()
            self._sock_transfer(pending, ci, kind, local, nbytes, rid, offset, count_rid)
            return 0
        if self.conns[ci].ep == NULL:
            return 0      # a flush where every put went over the socket: each was acknowledged
        if smb_load_int(&self.conns[ci].failed) or self.conns[ci].ep_closed:
            # a failed connection's endpoint may be closed already (fail_conn): never touch it
            if pending.error_status == 0:
                pending.error_status = self.conns[ci].status or ucp.UCS_ERR_CONNECTION_RESET
                pending.error_conn = ci
            return 0
        self._enter()
        ep = self.conns[ci].ep
        param.op_attr_mask = 0
        with nogil:
            if kind == TRANSFER_PUT:
                p = ucp.ucp_put_nbx(ep, <void*>local, nbytes, remote, <ucp.ucp_rkey_h>rkey, &param)
            elif kind == TRANSFER_GET:
                p = ucp.ucp_get_nbx(ep, <void*>local, nbytes, remote, <ucp.ucp_rkey_h>rkey, &param)
            else:
                p = ucp.ucp_ep_flush_nbx(ep, &param)
        self._leave()
        pending.add_request(p, ci)
        return 0

    cdef int _sock_transfer(self, Pending pending, int ci, transfer_t kind, uintptr_t local, size_t nbytes,
                            uint32_t rid, uint64_t offset, uint32_t count_rid) except -1:
        """A put or get as requests the server checks against its region table, of SOCK_PIECE
        bytes each (at most SOCK_MAX_PIECES of them; a frame's length is 32-bit, so at most
        1 GiB); a get's reply lands straight in `local`. A put's count rides on its last
        request: the server runs a connection's requests in order, so all its data is in."""
        cdef put_desc_t put
        cdef get_desc_t get
        cdef size_t done = 0, piece
        cdef size_t size = max(<size_t>SOCK_PIECE, (nbytes + SOCK_MAX_PIECES - 1) // SOCK_MAX_PIECES)
        cdef uint64_t slot_id
        cdef reply_slot_t *s
        size = min(size, <size_t>(1 << 30))
        while True:
            piece = min(nbytes - done, size)
            slot_id = self._alloc_slot()
            if kind == TRANSFER_GET:
                s = &self.cl.slots[slot_id & 0xFFFF]
                s.dest = <char*>(local + done)
                s.dest_len = piece
            pending.add_slot(slot_id, ci, True)
            if kind == TRANSFER_PUT:   # the data follows the descriptor
                put.region = rid
                put.count_region = count_rid if done + piece >= nbytes else 0
                put.offset = offset + done
                self._sock_send(ci, self._data_head(OP_PUT, slot_id, sizeof(put) + piece, &put, sizeof(put)),
                                sizeof(smb_hdr_t) + sizeof(put), <const char*>(local + done), piece)
            else:
                get.region = rid
                get.reserved = 0
                get.offset = offset + done
                get.nbytes = piece
                self._sock_send(ci, self._data_head(OP_GET, slot_id, sizeof(get), &get, sizeof(get)),
                                sizeof(smb_hdr_t) + sizeof(get), NULL, 0)
            done += piece
            if done >= nbytes:
                return 0

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


def local_fetch_add(uintptr_t addr, int64_t value, str what="counter"):
    """fetch_add on a mapped counter, refused (SMBValueError naming ``what``) where the sum
    would leave the int64 range: the server's own check, for the same-node path."""
    cdef int64_t old
    if checked_fetch_add64(<int64_t*>addr, value, &old) != 0:
        text = (<bytes>FETCH_ADD_OVERFLOW).replace(b"%lld", b"%d") % (value, old, INT64_MIN, INT64_MAX, old)
        raise _errors.SMBValueError(f"{what}: {text.decode()}")
    return old


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
