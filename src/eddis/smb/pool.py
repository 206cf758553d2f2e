"""Pool: one logical buffer of `slots` rows x `length` columns spread over all servers.

Columns are split into contiguous ranges by :func:`protocol.partition`, a
function of (length, number of servers) alone, so pools of equal length are
co-partitioned and server-side operations between them stay on each server.
Each server holds its column range for every slot, slot-major. A transfer is
cut into one contiguous piece per server; the pieces are issued together and
waited on together, so every server's bandwidth is used.
"""
import ctypes

import numpy as np

from ..errors import SMBBoundsError, SMBKeyError, SMBValueError, UsageError
from . import _core
from .counter import Counter
from .requests import Completed, CountedAfter, Request
from .protocol import (DOT_NORMS_REPLY, DTYPES, FLOAT_DTYPES, ITEMSIZE, MAX_VEC_SEGMENTS, VEC_REQUEST,
                       VEC_SEGMENT, VEC_SOURCE, decode_control, partition)

try:  # numpy has no bfloat16; ml_dtypes (a torch/jax dependency) adds one
    from ml_dtypes import bfloat16 as _np_bfloat16
except ImportError:  # pragma: no cover - depends on the environment
    _np_bfloat16 = None


def numpy_dtype(name):
    """The numpy dtype that holds a pool dtype (bfloat16: ml_dtypes, else uint16 bits)."""
    if name == "bfloat16":
        return np.dtype(_np_bfloat16) if _np_bfloat16 is not None else np.dtype(np.uint16)
    return np.dtype(name)


# Converters for buffers that neither the buffer protocol nor numpy's DLPack import can
# take (a framework's bfloat16 tensor: numpy has no bfloat16). A framework adapter
# registers its own (eddis.torch does for torch), so this layer names no framework.
_EXPORTERS = []

_DLPACK_CPU = 1  # kDLCPU in DLPack's DLDeviceType


def register_exporter(accepts, to_numpy):
    """Teach :func:`as_array` a buffer type: ``accepts(buf)`` says whether it is one,
    ``to_numpy(buf, writable)`` returns a numpy view of its memory (no copy)."""
    _EXPORTERS.append((accepts, to_numpy))


def _dlpack_array(buf):
    """A numpy view of a DLPack exporter's CPU memory (numpy imports it without a copy)."""
    device = buf.__dlpack_device__() if hasattr(buf, "__dlpack_device__") else (_DLPACK_CPU, 0)
    if int(device[0]) != _DLPACK_CPU:
        raise SMBValueError(f"{type(buf).__name__} lives on device {tuple(device)} (DLPack); SMB "
                            "transfers take host memory: copy it to the CPU first (e.g. .cpu())")
    try:
        return np.from_dlpack(buf)
    except BufferError as exc:
        raise SMBValueError(f"{type(buf).__name__} cannot be viewed without a copy ({exc}); pass "
                            "it contiguous (e.g. .contiguous()) or as a numpy array") from None
    except (TypeError, RuntimeError) as exc:
        raise SMBValueError(f"numpy cannot import this {type(buf).__name__} through DLPack ({exc}); "
                            "for bfloat16 pass its bits (a 16-bit integer view) or import the "
                            "framework's EDDIS adapter, which registers a converter") from None


def as_array(buf, pool_dtype, writable, np_dtype=None):
    """A numpy view (no copy) of a numpy array, a DLPack exporter on the CPU (a torch
    tensor, ...), or any object with the buffer protocol."""
    if (type(buf) is np.ndarray and buf.dtype == np_dtype and buf.flags.c_contiguous
            and (buf.flags.writeable or not writable)):
        return buf  # the common case, checked cheaply
    if isinstance(buf, np.ndarray):
        arr = buf
    else:
        for accepts, to_numpy in _EXPORTERS:
            if accepts(buf):
                arr = to_numpy(buf, writable)
                break
        else:
            if hasattr(buf, "__dlpack__"):
                arr = _dlpack_array(buf)
            else:
                try:
                    arr = np.asarray(memoryview(buf))
                except TypeError:
                    raise SMBValueError(f"{type(buf).__name__} does not expose a buffer; pass a numpy "
                                        "array, a CPU tensor (DLPack) or a memoryview") from None
    if not arr.flags.c_contiguous:
        raise SMBValueError("buffer is not C-contiguous; pass np.ascontiguousarray(buf)")
    if writable and not arr.flags.writeable:
        raise SMBValueError("read needs a writable buffer; this one is read-only")
    arr = arr.reshape(-1)
    itemsize = ITEMSIZE[pool_dtype]
    if arr.dtype == np.uint8 and pool_dtype != "uint8":
        if arr.nbytes % itemsize:
            raise SMBValueError(f"raw byte buffer of {arr.nbytes} bytes is not a whole number of "
                                f"{pool_dtype} elements ({itemsize} bytes each)")
        return arr.view(numpy_dtype(pool_dtype) if pool_dtype != "bfloat16" or _np_bfloat16 else np.uint16)
    ok = arr.dtype.name == pool_dtype or (
        pool_dtype == "bfloat16" and arr.dtype.name in ("bfloat16", "uint16", "int16"))
    if not ok:
        raise SMBValueError(f"the pool holds {pool_dtype} but the buffer is {arr.dtype.name}; "
                            f"convert it first (e.g. arr.astype('{pool_dtype}'))")
    return arr


def device_view(buf, pool_dtype, writable):
    """(address, elements) of a CUDA buffer (one with ``__cuda_array_interface__``: a torch
    CUDA tensor, a CuPy array, ...) for GPUDirect transfers, checked like :func:`as_array`;
    None for host memory."""
    if type(buf) is np.ndarray:
        return None
    try:
        iface = getattr(buf, "__cuda_array_interface__", None)
    except (TypeError, ValueError) as exc:   # e.g. torch's bfloat16, which the interface lacks
        raise SMBValueError(f"{type(buf).__name__} on the GPU gives no __cuda_array_interface__ ({exc}); "
                            "pass its bits (a 16-bit integer view) for bfloat16") from None
    if iface is None:
        return None
    address, readonly = iface["data"]
    if writable and readonly:
        raise SMBValueError("read needs a writable buffer; this GPU buffer is read-only")
    dtype = np.dtype(iface["typestr"])
    shape = tuple(int(n) for n in iface["shape"])
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    strides = iface.get("strides")
    if strides is not None and count > 1:
        expected, step = [], dtype.itemsize
        for n in reversed(shape):
            expected.insert(0, step)
            step *= n
        if tuple(strides) != tuple(expected):
            raise SMBValueError("GPU buffer is not C-contiguous; pass it .contiguous()")
    itemsize = ITEMSIZE[pool_dtype]
    if dtype == np.uint8 and pool_dtype != "uint8":
        if count % itemsize:
            raise SMBValueError(f"raw byte buffer of {count} bytes is not a whole number of {pool_dtype} "
                                f"elements ({itemsize} bytes each)")
        return int(address), count // itemsize
    if not (dtype.name == pool_dtype or (pool_dtype == "bfloat16" and dtype.name in ("uint16", "int16"))):
        raise SMBValueError(f"the pool holds {pool_dtype} but the GPU buffer is {dtype.name}; convert it first")
    return int(address), count


MAX_SOURCES = 1024  # per server-side weighted sum (the server's limit)


def _server_list(client, servers, name):
    if servers is None:
        return list(range(client.num_servers))
    chosen = [int(s) for s in servers]
    if not chosen or len(set(chosen)) != len(chosen) or not all(0 <= s < client.num_servers for s in chosen):
        raise SMBValueError(f"pool {name!r}: servers={list(servers)} must be distinct indices in "
                            f"0..{client.num_servers - 1}, at least one")
    return chosen


class _Segment:
    """One server's part of the pool."""

    __slots__ = ("index", "server", "conn", "start", "stop", "rid", "addr", "rkey", "local", "table")


class Pool:
    def __init__(self, client, name, length, dtype="float32", slots=1, create=True, servers=None):
        """``servers``: the server indices that hold the pool (default every server), e.g. only
        the server of this node for memory that the node's ranks share among themselves."""
        if dtype not in DTYPES:
            raise SMBValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        length, slots = int(length), int(slots)
        if length < 1 or slots < 1:
            raise SMBValueError(f"pool {name!r}: length and slots must be >= 1 (got {length}, {slots})")
        self.client = client
        self.name = name
        self._freed = False
        self.length = length
        self.dtype = dtype
        self.slots = slots
        self.itemsize = ITEMSIZE[dtype]
        self.np_dtype = numpy_dtype(dtype)
        self.servers = _server_list(client, servers, name)
        meta = {"length": length, "dtype": dtype, "slots": slots}
        parts = partition(length, len(self.servers))
        calls = [(s, {"op": "region_create", "name": "pool:" + name, "slots": slots, "length": stop - start,
                      "dtype": dtype, "meta": meta, "create": bool(create)})
                 for s, (start, stop) in zip(self.servers, parts)]
        replies = client._control_nb(calls, f"pool {name!r}",
                                     lambda rs: [decode_control(r)[0] for r in rs]).wait()
        self.segments = []
        for i, (s, (start, stop), info) in enumerate(zip(self.servers, parts, replies)):
            seg = _Segment()
            seg.index, seg.server, seg.conn = i, s, client.servers[s]["conn"]
            seg.start, seg.stop, seg.rid, seg.addr = start, stop, info["id"], info["addr"]
            base = client.servers[s]["base"]
            seg.local = base + info["offset"] if base else 0
            seg.table = base    # the mapped arena's region generation table
            seg.rkey = 0
            if seg.local:
                # fault the region into this process once, not during the first transfers
                _core.prefault(seg.local, info["nbytes"])
            self.segments.append(seg)
        remote = [seg for seg in self.segments if not seg.local]
        # rdma: the keys of this pool's regions, one-sided access to them alone
        keys = client.region_keys_nb([(seg.server, seg.rid) for seg in remote], f"pool {name!r}").wait()
        for seg, key in zip(remote, keys):
            seg.rkey = key
        self._mapped = any(seg.local for seg in self.segments)

    def __repr__(self):
        return (f"Pool({self.name!r}, length={self.length}, dtype={self.dtype!r}, slots={self.slots}, "
                f"servers={self.servers})")

    # ------------------------------------------------------------ helpers
    def _live(self, what):
        """UsageError for a handle this process freed: it no longer names any memory."""
        if self._freed:
            raise UsageError(f"pool {self.name!r} {what}: this pool was freed (free()); attach to it "
                             "again with client.pool() if it was created anew")

    def _range(self, slot, start, count):
        slot, start = int(slot), int(start)
        if not 0 <= slot < self.slots:
            raise SMBBoundsError(f"pool {self.name!r}: slot {slot} outside 0..{self.slots - 1}")
        if count is None:
            count = self.length - start
        count = int(count)
        if start < 0 or count < 0 or start + count > self.length:
            raise SMBBoundsError(f"pool {self.name!r}: elements [{start}, {start + count}) outside "
                                 f"[0, {self.length})")
        return slot, start, count

    def _pieces(self, start, count):
        """(segment, local column, count, offset in the caller's buffer) per server touched."""
        end = start + count
        for seg in self.segments:
            lo, hi = max(start, seg.start), min(end, seg.stop)
            if lo < hi:
                yield seg, lo - seg.start, hi - lo, lo - start

    def _check_generation(self, seg, what):
        """SMBKeyError where the server freed this region (a stale handle): the memory may
        belong to another pool now, which a same-node copy must never touch."""
        if _core.local_generation(seg.table, seg.rid) != seg.rid >> 16:
            raise SMBKeyError(f"pool {self.name!r} {what}: server {seg.server} freed this pool (a stale "
                              "handle; another client called free()); look the pool up again")

    def _offset(self, seg, slot, col):
        """Byte offset of (slot, column col) in a server's segment: slot-major."""
        return (slot * (seg.stop - seg.start) + col) * self.itemsize

    def layout(self, start=0, count=None):
        """[(start, count, mapped)] of the elements [start, start+count): one entry per server
        piece, ``mapped`` when that server's memory is mapped into this process."""
        self._live("layout")
        _, start, count = self._range(0, start, count)
        return [(start + off, n, bool(seg.local)) for seg, _, n, off in self._pieces(start, count)]

    def mapped_views(self, slot=0, start=0, count=None):
        """numpy views of elements [start, start+count) of slot, one per server piece, straight
        into the memory of servers mapped into this process (same node); no copy, no request.
        The views are valid until this pool is freed or its client closed; never use them after."""
        self._live("mapped_views")
        self.client._check()
        slot, start, count = self._range(slot, start, count)
        views = []
        for seg, col, n, _ in self._pieces(start, count):
            if not seg.local:
                raise SMBValueError(f"pool {self.name!r}: server {seg.server} is not mapped into this "
                                    "process (another node, or SMB_LOCAL_MAP=0); use read/write")
            self._check_generation(seg, "mapped_views")
            memory = (ctypes.c_char * (n * self.itemsize)).from_address(seg.local + self._offset(seg, slot, col))
            views.append(np.frombuffer(memory, dtype=self.np_dtype))
        return views

    def _other(self, pool, what):
        if pool is None:
            return self
        if not isinstance(pool, Pool) or pool.client is not self.client:
            raise SMBValueError(f"{what} must be a Pool of the same client")
        pool._live(f"as {what}")
        if pool.length != self.length or pool.servers != self.servers:
            raise SMBValueError(f"{what} {pool.name!r} has length {pool.length} on servers {pool.servers}, "
                                f"not {self.length} on {self.servers}: server-side operations need "
                                "co-partitioned pools (equal length, the same servers)")
        if pool.dtype not in FLOAT_DTYPES:
            raise SMBValueError(f"{what} {pool.name!r} holds {pool.dtype}; vector ops need float pools")
        return pool

    # ------------------------------------------------------------ transfers
    def write_nb(self, buf, slot=0, start=0, count_in=None):
        """Start writing buf into [start, start+len(buf)) of slot; returns a Request.

        ``count_in``: a :class:`~eddis.smb.counter.Counter` on the server that holds the whole
        range; it gains 1 once the data has landed there, so that a reader that sees the count
        sees the data. On the socket transport the server counts on the write's last request
        (no request of its own, no second round trip); a mapped server is counted after the
        copy; a one-sided (rdma) write is counted after its flush."""
        self._live("write")
        device = device_view(buf, self.dtype, False)
        if device is not None:
            if count_in is not None:
                slot, start, count = self._range(slot, start, device[1])
                self._count_target(count_in, start, count)
                return CountedAfter(self._device_transfer(buf, device, slot, start, True), count_in)
            return self._device_transfer(buf, device, slot, start, True)
        arr = as_array(buf, self.dtype, False, self.np_dtype)
        slot, start, count = self._range(slot, start, arr.size)
        if count_in is not None:
            self._count_target(count_in, start, count)
            if count == 0:
                return CountedAfter(Completed(), count_in)
        return self._guarded_transfer(arr, slot, start, count, True, None, None, count_in)

    def _count_target(self, counter, start, count):
        """SMBValueError unless ``counter`` can count a write of [start, start+count) in: a
        counter of this pool's client, on the one server that holds the range."""
        if not isinstance(counter, Counter) or counter._client is not self.client:
            raise SMBValueError(f"pool {self.name!r} write: count_in must be a Counter of the same "
                                f"client, not {counter!r}")
        servers = sorted({seg.server for seg, _, _, _ in self._pieces(start, count)})
        if len(servers) > 1:
            raise SMBValueError(f"pool {self.name!r} write: elements [{start}, {start + count}) lie on "
                                f"servers {servers}; a counted write must lie on one server, its "
                                "counter's (write each server's part with its own counter)")
        if servers and servers != [counter.server]:
            raise SMBValueError(f"pool {self.name!r} write: counter {counter.name!r} is on server "
                                f"{counter.server}, but the range lies on server {servers[0]}; a count "
                                "can only follow data onto the server that holds both")

    def write(self, buf, slot=0, start=0, timeout=None):
        self.write_nb(buf, slot, start).wait(timeout)

    def read_nb(self, out=None, slot=0, start=0, count=None):
        """Start reading into out (allocated when None); returns a Request whose wait() gives it."""
        self._live("read")
        if out is None:
            slot, start, count = self._range(slot, start, count)
            out = arr = np.empty(count, dtype=self.np_dtype)
        else:
            device = device_view(out, self.dtype, True)
            if device is not None:
                if count is not None and int(count) != device[1]:
                    raise SMBValueError(f"count={count} but out holds {device[1]} elements")
                return self._device_transfer(out, device, slot, start, False)
            arr = as_array(out, self.dtype, True, self.np_dtype)
            if count is not None and int(count) != arr.size:
                raise SMBValueError(f"count={count} but out holds {arr.size} elements")
            slot, start, count = self._range(slot, start, arr.size)
        return self._guarded_transfer(arr, slot, start, count, False, out)

    def read(self, out=None, slot=0, start=0, count=None, timeout=None):
        return self.read_nb(out, slot, start, count).wait(timeout)

    def _device_transfer(self, buf, device, slot, start, put):
        """GPUDirect (SMB_GPU_DIRECT): one-sided put/get straight from or into CUDA memory,
        which UCX's CUDA transports move; never a copy through this process's host memory."""
        address, count = device
        what = "write" if put else "read"
        slot, start, count = self._range(slot, start, count)
        if not self.client.gpu_direct:
            raise SMBValueError(
                f"pool {self.name!r} {what}: the buffer is in GPU memory; SMB takes it only with "
                f"SMB_GPU_DIRECT=1 on the rdma transport where UCX has its CUDA transports "
                f"(eddis doctor: smb_transport), else copy it to host memory first (e.g. .cpu())")
        mapped = [seg.server for seg, _, _, _ in self._pieces(start, count) if not seg.rkey]
        if mapped:
            raise SMBValueError(f"pool {self.name!r} {what}: servers {mapped} are mapped into this process "
                                "(same node), which a GPU buffer cannot be copied into directly; stage it "
                                "through host memory, or set SMB_LOCAL_MAP=0")
        return self._transfer(buf, slot, start, count, put, None if put else buf, base=address)

    def _guarded_transfer(self, *args):
        """_transfer, holding the client's mappings when part of the pool is mapped: a close()
        from another thread waits for the copies instead of unmapping the memory under them."""
        if not self._mapped:
            return self._transfer(*args)
        with self.client._mapped_access("pool", self.name):
            return self._transfer(*args)

    def _generation_reads(self, pending, segments, gens):
        """rdma: post one-sided reads of the generation of each segment's region (from the
        server's table, which clients may read and never write) into ``gens``."""
        address = _core.buffer_address(gens, True)[0]
        for i, seg in enumerate(segments):
            table, key = self.client.servers[seg.server]["generations"]
            self.client._core.post_get(pending, seg.conn, address + 4 * i, 4, 0, 0,
                                       table + 4 * (seg.rid & 0xFFFF), key)

    def _check_generations(self, segments, gens, what):
        """SMBKeyError for the first segment whose region the server freed (a stale handle)."""
        for seg, gen in zip(segments, gens):
            if int(gen) != seg.rid >> 16:
                raise SMBKeyError(f"pool {self.name!r} {what}: server {seg.server} freed this pool (a "
                                  "stale handle; another client called free()); look the pool up again")

    def _rdma_writable(self, segments, what):
        """rdma: before a one-sided write, that no region of ``segments`` was freed, so that
        the write cannot land in the region the server placed there next (the check a
        same-node copy makes in the mapped table, one round trip for all servers). A server
        lost meanwhile is left to the write itself to report, so that the parts for the
        other servers land as they would without the check."""
        client = self.client
        gens = np.zeros(len(segments), dtype=np.uint32)
        pending = client._pending()
        pending.keep = gens
        self._generation_reads(pending, segments, gens)
        outcome = pending.wait(client.timeout)
        if outcome == 3:
            raise UsageError(f"pool {self.name!r} {what}: the SMB client was closed while waiting")
        if outcome != 0:
            for conn in pending.inflight_conns():   # a stuck server, given up as a transfer's would be
                client._core.fail_conn(conn)
        self._check_generations([seg for seg in segments if not client._core.conn_failed(seg.conn)],
                                [gen for seg, gen in zip(segments, gens) if not client._core.conn_failed(seg.conn)],
                                what)

    def _transfer(self, arr, slot, start, count, put, result=None, base=None, count_in=None):
        """One contiguous piece per server: memcpy for mapped servers, else put/get.
        ``arr`` stays alive until the transfers are done; ``base``: its address where it is
        no host buffer (GPUDirect); ``count_in``: write_nb's, checked."""
        client = self.client
        what = "write" if put else "read"
        core = client._core
        if base is None:
            base = _core.buffer_address(arr, not put)[0]
        itemsize = self.itemsize
        pending = None
        remote, local = [], []
        pieces = list(self._pieces(start, count))
        one_sided = [seg for seg, _, _, _ in pieces if seg.rkey]
        if put and one_sided:
            self._rdma_writable(one_sided, what)
        for seg, col, n, off in pieces:
            nbytes = n * itemsize
            mine = base + off * itemsize
            if seg.local:
                self._check_generation(seg, what)
                theirs = seg.local + self._offset(seg, slot, col)
                if put:
                    _core.memcpy_nogil(theirs, mine, nbytes)
                    if count_in is not None:
                        _core.local_fetch_add(count_in._local, 1, f"counter {count_in.name!r}")
                else:
                    _core.memcpy_nogil(mine, theirs, nbytes)
                local.append(seg.server)
                continue
            offset = self._offset(seg, slot, col)
            theirs = seg.addr + offset
            if pending is None:
                pending = client._pending()
                pending.keep = arr
            if put:
                counted = count_in._rid if count_in is not None and not seg.rkey else 0
                core.post_put(pending, seg.conn, mine, nbytes, seg.rid, offset, theirs, seg.rkey, counted)
            else:
                core.post_get(pending, seg.conn, mine, nbytes, seg.rid, offset, theirs, seg.rkey)
            remote.append(seg.conn)
        if local:
            client.check_alive(local, f"pool {self.name!r} {what}")
        if pending is None:
            return Completed(result)
        finish = lambda _: result  # noqa: E731
        if put:
            for conn in remote:
                # puts complete locally first; the flush makes them visible at the server
                core.post_flush(pending, conn)
            if count_in is not None and one_sided:
                return CountedAfter(Request(client, pending, f"pool {self.name!r} {what}", finish, remote),
                                    count_in)
        elif one_sided:
            # the generations, read after the data: unchanged, the data was the region's
            gens = np.zeros(len(one_sided), dtype=np.uint32)
            pending.keep = (arr, gens)
            core.fence()
            self._generation_reads(pending, one_sided, gens)

            def finish(_):
                self._check_generations(one_sided, gens, what)
                return result
        return Request(client, pending, f"pool {self.name!r} {what}", finish, remote)

    # ------------------------------------------------------------ server-side vector ops
    def _vecop_nb(self, kind, dst_slot, sources, alpha, start, count, what):
        """sources: [(pool, slot, weight)]; one request per server holding part of the range."""
        self._live(what)
        dst_slot, start, count = self._range(dst_slot, start, count)
        if self.dtype not in FLOAT_DTYPES:
            raise SMBValueError(f"pool {self.name!r} holds {self.dtype}; vector ops need float pools")
        for pool, slot, _ in sources:
            if not 0 <= int(slot) < pool.slots:
                raise SMBBoundsError(f"pool {pool.name!r}: slot {slot} outside 0..{pool.slots - 1}")
        client = self.client
        pending = client._pending()
        servers = []
        for seg, col, n, _ in self._pieces(start, count):
            payload = VEC_REQUEST.pack(kind, len(sources), seg.rid, dst_slot, col, n, float(alpha))
            payload += b"".join(VEC_SOURCE.pack(pool.segments[seg.index].rid, int(slot), float(w))
                                for pool, slot, w in sources)
            client._post(pending, seg.server, _core.OP_VECOP, payload)
            servers.append(seg.server)
        return Request(client, pending, f"pool {self.name!r} {what}", None, servers)

    def weighted_sum_nb(self, dst_slot, src_slots, weights, start=0, count=None, src_pool=None):
        src = self._other(src_pool, "src_pool")
        src_slots, weights = list(src_slots), list(weights)
        if len(src_slots) > MAX_SOURCES:
            raise SMBValueError(f"weighted_sum takes at most {MAX_SOURCES} sources, got {len(src_slots)}; "
                                "split it into partial sums")
        if len(src_slots) != len(weights) or not src_slots:
            raise SMBValueError(f"weighted_sum needs as many weights as source slots (got "
                                f"{len(src_slots)} slots, {len(weights)} weights), at least one")
        return self._vecop_nb(_core.VEC_WEIGHTED_SUM, dst_slot,
                              [(src, s, w) for s, w in zip(src_slots, weights)], 0.0, start, count,
                              "weighted_sum")

    def weighted_sum(self, dst_slot, src_slots, weights, start=0, count=None, src_pool=None):
        """dst = sum_i weights[i] * src[src_slots[i]], computed by the servers (fp32 accumulation)."""
        self.weighted_sum_nb(dst_slot, src_slots, weights, start, count, src_pool).wait()

    def axpy_nb(self, y_slot, x_slot, alpha, start=0, count=None, x_pool=None):
        x = self._other(x_pool, "x_pool")
        return self._vecop_nb(_core.VEC_AXPY, y_slot, [(x, x_slot, 1.0)], alpha, start, count, "axpy")

    def axpy(self, y_slot, x_slot, alpha, start=0, count=None, x_pool=None):
        """y += alpha * x on the servers."""
        self.axpy_nb(y_slot, x_slot, alpha, start, count, x_pool).wait()

    def scale_nb(self, slot, alpha, start=0, count=None):
        return self._vecop_nb(_core.VEC_SCALE, slot, [], alpha, start, count, "scale")

    def scale(self, slot, alpha, start=0, count=None):
        """x *= alpha on the servers."""
        self.scale_nb(slot, alpha, start, count).wait()

    def copy_nb(self, dst_slot, src_slot, start=0, count=None, src_pool=None):
        src = self._other(src_pool, "src_pool")
        return self._vecop_nb(_core.VEC_COPY, dst_slot, [(src, src_slot, 1.0)], 0.0, start, count, "copy")

    def copy(self, dst_slot, src_slot, start=0, count=None, src_pool=None):
        """dst = src on the servers (converting between float dtypes)."""
        self.copy_nb(dst_slot, src_slot, start, count, src_pool).wait()

    # ------------------------------------------------------------ Adasum's segment ops
    def _segment_op_nb(self, kind, dst_slot, a, b, segments, weights, what, finish=None):
        """One request per server and MAX_VEC_SEGMENTS segments: each server gets the parts of
        the segments that fall into its columns. Returns (Request, [segment index per part
        of each request, in posting order])."""
        self._live(what)
        (a_pool, a_slot), (b_pool, b_slot) = a, b
        a_pool = self._other(a_pool, "a_pool")
        b_pool = self._other(b_pool, "b_pool")
        for pool, slot in ((a_pool, a_slot), (b_pool, b_slot)):
            if not 0 <= int(slot) < pool.slots:
                raise SMBBoundsError(f"pool {pool.name!r}: slot {slot} outside 0..{pool.slots - 1}")
            if pool.dtype == "float64":
                raise SMBValueError(f"{what}: pool {pool.name!r} holds float64; Adasum's segment ops take "
                                    "float32, float16 or bfloat16 sources")
        dst_slot = int(dst_slot)
        if not 0 <= dst_slot < self.slots:
            raise SMBBoundsError(f"pool {self.name!r}: slot {dst_slot} outside 0..{self.slots - 1}")
        segments = [(int(start), int(count)) for start, count in segments]
        for start, count in segments:
            self._range(0, start, count)
        client = self.client
        pending = client._pending()
        servers, owners = [], []
        for seg in self.segments:
            parts = []
            for i, (start, count) in enumerate(segments):
                lo, hi = max(start, seg.start), min(start + count, seg.stop)
                if lo < hi:
                    parts.append((i, lo - seg.start, hi - lo))
            for first in range(0, len(parts), MAX_VEC_SEGMENTS):
                chunk = parts[first:first + MAX_VEC_SEGMENTS]
                lo = min(col for _, col, _ in chunk)
                hi = max(col + n for _, col, n in chunk)
                payload = VEC_REQUEST.pack(kind, 2, seg.rid, dst_slot, lo, hi - lo, 0.0)
                payload += VEC_SOURCE.pack(a_pool.segments[seg.index].rid, int(a_slot), 1.0)
                payload += VEC_SOURCE.pack(b_pool.segments[seg.index].rid, int(b_slot), 1.0)
                payload += b"".join(VEC_SEGMENT.pack(col, n, *weights[i]) for i, col, n in chunk)
                client._post(pending, seg.server, _core.OP_VECOP, payload)
                servers.append(seg.server)
                owners.append([i for i, _, _ in chunk])
        return Request(client, pending, f"pool {self.name!r} {what}",
                       None if finish is None else (lambda replies: finish(replies, owners)), servers)

    def dot_norms_nb(self, a_slot, b_slot, segments, a_pool=None, b_pool=None):
        """Start computing, on the servers, (a.b, a.a, b.b) of each segment (start, count) of
        columns, a = slot a_slot of a_pool and b = slot b_slot of b_pool (default: this pool);
        wait() gives a float64 array of shape (segments, 3), each server's partial sums added."""
        segments = list(segments)

        def total(replies, owners):
            out = np.zeros((len(segments), 3), dtype=np.float64)
            for data, index in zip(replies, owners):
                partial = np.frombuffer(data, dtype="<f8").reshape(-1, DOT_NORMS_REPLY.size // 8)
                np.add.at(out, index, partial)
            return out

        return self._segment_op_nb(_core.VEC_DOT_NORMS, 0, (a_pool, a_slot), (b_pool, b_slot), segments,
                                   [(0.0, 0.0)] * len(segments), "dot_norms", total)

    def dot_norms(self, a_slot, b_slot, segments, a_pool=None, b_pool=None, timeout=None):
        return self.dot_norms_nb(a_slot, b_slot, segments, a_pool, b_pool).wait(timeout)

    def pair_sum_nb(self, dst_slot, a_slot, b_slot, segments, weights, a_pool=None, b_pool=None):
        """Start dst = w_a * a + w_b * b on each segment (start, count), with its weights
        (w_a, w_b), on the servers (fp32 accumulation, written in this pool's dtype)."""
        segments, weights = list(segments), [(float(wa), float(wb)) for wa, wb in weights]
        if len(weights) != len(segments):
            raise SMBValueError(f"pair_sum: {len(weights)} weight pairs for {len(segments)} segments; "
                                "pass one (w_a, w_b) per segment")
        return self._segment_op_nb(_core.VEC_PAIR_SUM, dst_slot, (a_pool, a_slot), (b_pool, b_slot),
                                   segments, weights, "pair_sum")

    def pair_sum(self, dst_slot, a_slot, b_slot, segments, weights, a_pool=None, b_pool=None,
                 timeout=None):
        self.pair_sum_nb(dst_slot, a_slot, b_slot, segments, weights, a_pool, b_pool).wait(timeout)

    def reduce_nb(self, contrib_slot, weight, parties, dst_slot, generation, src_pool=None,
                  start=0, count=None, average=True):
        """Contribute src_pool[contrib_slot] with `weight` to reduction `generation`.

        Once `parties` contributions are in, each server writes
        dst = sum(w_i * slot_i) / sum(w_i) (plain sum with average=False) into
        dst_slot of this pool and completes every contributor's request."""
        src = self._other(src_pool, "src_pool")
        self._live("reduce")
        dst_slot, start, count = self._range(dst_slot, start, count)
        if not 0 <= int(contrib_slot) < src.slots:
            raise SMBBoundsError(f"pool {src.name!r}: slot {contrib_slot} outside 0..{src.slots - 1}")
        if int(parties) < 1:
            raise SMBValueError("reduce parties must be >= 1")
        calls = []
        for seg, col, n, _ in self._pieces(start, count):
            calls.append((seg.server, {
                "op": "reduce", "dst": seg.rid, "dst_slot": dst_slot, "start": col, "count": n,
                "src": src.segments[seg.index].rid, "src_slot": int(contrib_slot),
                "weight": float(weight), "parties": int(parties), "generation": int(generation),
                "average": bool(average)}))
        return self.client._control_nb(calls, f"pool {self.name!r} reduce generation {generation}")

    def free(self):
        """Release the pool's memory on every server; the handle is unusable afterwards."""
        self._live("free")
        client = self.client
        client._check()
        # Marked first: even if a server refuses (another client freed it already), the
        # others have released their part, so this handle names no memory any more.
        segments, self.segments = self.segments, []
        self._freed = True
        for seg in segments:
            if seg.rkey:
                with client._lock:
                    client._core.forget_rkey(seg.conn, seg.rid)
        client._control_nb([(seg.server, {"op": "region_free", "name": "pool:" + self.name})
                            for seg in segments], f"pool {self.name!r} free").wait()
