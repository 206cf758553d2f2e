# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Native SMB core: the server's request loop and the client's transfers. Python
policy (names, allocation, barriers, reductions, the token proof) lives in
eddis.smb; this module moves bytes and runs the hot requests without the GIL.

Wire format: every request and reply is one frame on a socket whose peer proved
the job token first (eddis.smb.handshake): a ``smb_hdr_t`` followed by an
op-specific payload. With the rdma transport, bulk data moves one-sidedly
instead (``ucp_put_nbx``/``ucp_get_nbx`` into regions registered with UCX, with
the keys the server hands out over the proven socket); UCX carries no request.
"""
from libc.stdint cimport (uint8_t, uint16_t, int16_t, uint32_t, int32_t, uint64_t, int64_t, uintptr_t,
                          INT64_MIN, INT64_MAX)
from libc.stdlib cimport malloc, free, calloc, realloc
from libc.string cimport memcpy, memset, strlen, memcmp
from libc.errno cimport errno, EINTR, EAGAIN, EINVAL
from libc.stdio cimport FILE, fclose, snprintf
from posix.mman cimport (mmap, munmap, shm_open, shm_unlink, madvise, PROT_READ, PROT_WRITE,
                         MAP_SHARED, MAP_FAILED, MADV_HUGEPAGE)
from posix.fcntl cimport O_RDWR, O_CREAT, O_EXCL, open as open_fd
from posix.stdio cimport open_memstream
from posix.unistd cimport ftruncate, close, read, write
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE, PyBUF_ANY_CONTIGUOUS
cimport libucp as ucp
from libucp cimport ucs_status_t, ucs_status_ptr_t
cimport smb_vecops as vec
cimport smb_vecpool as vp
cimport smb_sock as sk

import errno as _errno
import logging as _logging
import os as _os
import threading as _threading

from eddis import errors as _errors

# ------------------------------------------------------------------ C helpers
from smb_helpers cimport *

# ------------------------------------------------------------------ protocol
DEF SMB_MAGIC = 0x534D4231        # "SMB1"
DEF MAX_CONNS = 1024
DEF MAX_REGIONS = 65536
DEF REPLY_SLOTS = 8192
DEF MAX_VEC_SOURCES = 1024
DEF MAX_VEC_SEGMENTS = 16384      # per segment op: its dot reply stays under 400 KB
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
    VEC_DOT_NORMS = 4      # Adasum: (a.b, a.a, b.b) per segment of two sources
    VEC_PAIR_SUM = 5       # Adasum: dst = w_a * a + w_b * b per segment

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
    uint32_t count_region  # a counter of this server that gains 1 once the data landed (0: none)
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
# a socket put or get is cut into requests of this size (more for transfers above 1024 of
# them: 8 transfers of any size fit the 8192 requests in flight), so that a request queued
# behind it waits for one piece, not for the whole transfer
DEF SOCK_PIECE = 1 << 20
DEF SOCK_MAX_PIECES = 1024
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

cdef packed struct vec_segment_t:  # after the two sources of VEC_DOT_NORMS / VEC_PAIR_SUM
    uint64_t start         # columns of this server's part, inside the request's range
    uint64_t count
    double weight_a        # VEC_PAIR_SUM's coefficients (VEC_DOT_NORMS: unused)
    double weight_b


# what eddis.smb.protocol must agree with (tests/test_smb_protocol.py checks it)
WIRE_MAGIC = SMB_MAGIC
WIRE_SIZES = {"header": sizeof(smb_hdr_t), "counter_request": sizeof(counter_req_t),
              "vec_request": sizeof(vec_req_t), "vec_source": sizeof(vec_src_t),
              "vec_segment": sizeof(vec_segment_t),
              "put_desc": sizeof(put_desc_t), "get_desc": sizeof(get_desc_t)}
WIRE_MAX_VEC_SEGMENTS = MAX_VEC_SEGMENTS
SOCK_PIECE_BYTES = SOCK_PIECE   # the size of a socket put's or get's requests
WIRE_STATUS = {"no_memory": ucp.UCS_ERR_EXCEEDS_LIMIT, "invalid": ucp.UCS_ERR_INVALID_PARAM,
               "no_elem": ucp.UCS_ERR_NO_ELEM, "bounds": ucp.UCS_ERR_OUT_OF_RANGE,
               "rejected": ucp.UCS_ERR_REJECTED}


cdef inline int checked_fetch_add64(int64_t *p, int64_t n, int64_t *old) noexcept nogil:
    """Atomically add n to *p unless the sum leaves the int64 range; *old is the value
    before (or the one that refused the add). Returns 0, or -1 (and *p keeps its value)."""
    cdef int64_t seen = smb_load64(p)
    cdef int64_t before
    while True:
        if (n > 0 and seen > INT64_MAX - n) or (n < 0 and seen < INT64_MIN - n):
            old[0] = seen
            return -1
        before = smb_cas64(p, seen, seen + n)
        if before == seen:
            old[0] = seen
            return 0
        seen = before


# what a refused fetch_add says, on the server (C, no GIL) and on a same-node client alike
cdef const char *FETCH_ADD_OVERFLOW = (
    b"fetch_add of %lld to %lld would leave the signed 64-bit range %lld..%lld; refused, the counter "
    b"keeps %lld (start it lower, or count in larger units)")


cdef inline ucs_status_t _ptr_status(ucs_status_ptr_t p) noexcept nogil:
    if p == NULL:
        return ucp.UCS_OK
    if ucp.UCS_PTR_IS_ERR(p):
        return ucp.UCS_PTR_STATUS(p)
    return ucp.UCS_INPROGRESS


cdef str _status_text(ucs_status_t status):
    return (<bytes>ucp.ucs_status_string(status)).decode()


_log = _logging.getLogger("eddis.smb.core")


cdef int CHKERR(ucs_status_t status, str what, bint warn_only=False) except -1:
    """Raise the eddis.errors exception for a failed UCX call.

    ``warn_only``: log it and return 1 instead, where raising cannot help: a teardown
    call (what it releases is gone for its users either way, and raising would skip
    the rest of the teardown and leak more than the failed call did) and a UCX
    callback (nobody to raise to)."""
    if status == ucp.UCS_OK or status == ucp.UCS_INPROGRESS:
        return 0
    error = _errors.from_ucs_status(status, f"{what}: {_status_text(status)}")
    if warn_only:
        _log.warning("%s; carrying on", error)
        return 1
    raise error


cdef object _no_memory(str what):
    """The error for an allocation of the process's own heap that failed."""
    return _errors.from_errno(_errno.ENOMEM, f"out of memory for {what}: this process cannot allocate "
                                             f"it; free memory on this node")


def status_text(int status):
    """UCX's text for a status code."""
    return _status_text(status)


def ucx_version():
    """The version string of the UCX library this process runs with."""
    return (<bytes>ucp.ucp_get_version_string()).decode()


cdef dict _ucp_settings(ucp.ucp_config_t *config):
    """The UCP settings ``config`` holds, by name without UCX_: what the loaded UCX knows
    (ucp_config_modify of an unknown key succeeds in UCX 1.13, whose workers then warn)."""
    cdef char *text = NULL
    cdef size_t length = 0
    cdef FILE *stream = open_memstream(&text, &length)
    if stream == NULL:
        raise _errors.from_errno(errno, "open_memstream failed")
    ucp.ucp_config_print(config, stream, NULL, ucp.UCS_CONFIG_PRINT_CONFIG)
    fclose(stream)
    printed = PyBytes_FromStringAndSize(text, length).decode(errors="replace")
    free(text)
    settings = {}
    for line in printed.splitlines():
        name, equals, value = line.partition("=")
        if equals and name.startswith("UCX_"):
            settings[name[4:]] = value
    return settings


cdef int _order_only_fence(ucp.ucp_config_t *config) except -1:
    """Ask for a fence that only orders (FENCE_MODE=ep_based) where UCX has the choice and
    the user made none. UCX 1.22's default fence waits, GIL held, until every transfer has
    completed, so a stopped server hung its clients beyond every timeout; SMB needs only the
    order of the transfers to one server. UCX 1.13's fence (no such setting) only orders."""
    if "UCX_FENCE_MODE" in _os.environ or "FENCE_MODE" not in _ucp_settings(config):
        return 0
    CHKERR(ucp.ucp_config_modify(config, b"FENCE_MODE", b"ep_based"), "ucp_config_modify(FENCE_MODE=ep_based)")
    return 0


def ucx_fence_mode():
    """The fence mode SMB's UCX contexts get (UCX's FENCE_MODE), or None where the loaded UCX
    has no such setting (its fence only orders)."""
    cdef ucp.ucp_config_t *config = NULL
    CHKERR(ucp.ucp_config_read(NULL, NULL, &config), "ucp_config_read")
    try:
        _order_only_fence(config)
        return _ucp_settings(config).get("FENCE_MODE")
    finally:
        ucp.ucp_config_release(config)


cdef ucp.ucp_context_h _new_context(str tls, uint64_t features) except NULL:
    """A UCX context with ``features``, restricted to the transports ``tls`` names (UCX_TLS
    syntax; None: what the environment's UCX_TLS says)."""
    cdef ucp.ucp_config_t *config = NULL
    cdef ucp.ucp_params_t params
    cdef ucp.ucp_context_h context = NULL
    cdef ucs_status_t status
    CHKERR(ucp.ucp_config_read(NULL, NULL, &config), "ucp_config_read")
    if tls is not None:
        status = ucp.ucp_config_modify(config, b"TLS", tls.encode())
        if status != ucp.UCS_OK:
            ucp.ucp_config_release(config)
            CHKERR(status, f"ucp_config_modify(TLS={tls!r})")
    try:
        _order_only_fence(config)
    except BaseException:
        ucp.ucp_config_release(config)
        raise
    params.field_mask = ucp.UCP_PARAM_FIELD_FEATURES
    params.features = features
    status = ucp.ucp_init(&params, config, &context)
    ucp.ucp_config_release(config)
    CHKERR(status, f"ucp_init (UCX transports {tls or 'of UCX_TLS'})")
    return context


# ucs_memory_type_t -> name, for what a context can transfer from
MEMORY_TYPES = {ucp.UCS_MEMORY_TYPE_HOST: "host", ucp.UCS_MEMORY_TYPE_CUDA: "cuda",
                ucp.UCS_MEMORY_TYPE_CUDA_MANAGED: "cuda-managed", ucp.UCS_MEMORY_TYPE_ROCM: "rocm",
                ucp.UCS_MEMORY_TYPE_ROCM_MANAGED: "rocm-managed"}


def ucx_memory_types(str tls=None):
    """The memory types a UCX context (restricted to ``tls``) can move data from: "host",
    and "cuda" where UCX has its CUDA transports (GPUDirect)."""
    cdef ucp.ucp_context_attr_t attr
    cdef ucp.ucp_context_h context = _new_context(tls, ucp.UCP_FEATURE_RMA)
    attr.field_mask = ucp.UCP_ATTR_FIELD_MEMORY_TYPES
    status = ucp.ucp_context_query(context, &attr)
    ucp.ucp_cleanup(context)
    CHKERR(status, "ucp_context_query")
    return [name for code, name in MEMORY_TYPES.items() if attr.memory_types & (1 << code)]


def ucx_transports(str tls=None):
    """Transports and devices UCX can use here (within ``tls``, UCX_TLS syntax): list of
    {"transport", "device"}."""
    cdef ucp.ucp_context_h context = NULL
    cdef char *text = NULL
    cdef size_t length = 0
    cdef FILE *stream
    context = _new_context(tls, ucp.UCP_FEATURE_RMA)
    stream = open_memstream(&text, &length)
    if stream == NULL:
        ucp.ucp_cleanup(context)
        raise _errors.from_errno(errno, "open_memstream failed")
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


include "smb_server.pxi"

include "smb_client.pxi"
