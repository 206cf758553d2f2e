"""smb-server: lends this node's memory to the job.

Peers connect to the gate of :mod:`.handshake`, its only port, and prove the job
token; the native core (eddis.smb._core) runs the request loop over the proven
sockets in a GIL-free progress thread. It answers HELLO, counters, vector ops and
the socket transport's put/get itself and hands the named, stateful requests
(regions, barriers, events, reductions, the rdma transport's worker address and
region keys) to :meth:`Server._handle` here, on that same thread. With the rdma
transport the core also holds a UCX worker, without a listener, through which the
job's clients put and get one-sidedly into registered regions (:mod:`.transport`).

A server whose handshake or request thread ended on its own cannot serve the job
any more, though its process would live on: ``smb-server`` then exits with
SERVER_FAILED_STATUS and an SMBServerError naming the thread and why, so that the
job ends with this server as its root cause rather than with the clients that
time out on it.
"""
import atexit
import hashlib
import json
import logging
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path

from .. import identity, settings
from ..errors import (ConfigError, EddisError, SMBBoundsError, SMBKeyError, SMBMemoryError, SMBPermissionError,
                      SMBServerError, SMBValueError)
from .. import timeline
from . import arena_limits, handshake, rundir, transport as transports
from .hugepages import arena_pages, describe as describe_pages, plan as hugepage_plan
from .protocol import (CONTROL_SEPARATOR, DTYPES, ITEMSIZE, STATUS_BOUNDS, STATUS_INVALID,
                       STATUS_NO_ELEM, STATUS_NO_MEMORY, STATUS_REJECTED, decode_control)

log = logging.getLogger("eddis.smb.server")

MAX_REGIONS = 65536
SMALL_ALIGN = 64
PAGE_ALIGN = 4096
MAX_REDUCE_THREADS = 256   # SMB_VECPOOL_MAX_THREADS of the native core
SERVER_FAILED_STATUS = 70   # EX_SOFTWARE: a thread of the server died (see Server.failure)
WATCH_SECONDS = 0.2         # how often the CLI checks its threads and the stop signals


class ArenaAllocator:
    """First-fit allocator with coalescing free list over [base, base + size)."""

    def __init__(self, size, base=0):
        self.size = size
        self.free = [(base, size)]  # sorted (offset, length)

    @staticmethod
    def _align(nbytes):
        return PAGE_ALIGN if nbytes >= PAGE_ALIGN else SMALL_ALIGN

    def alloc(self, nbytes):
        align = self._align(nbytes)
        want = max(nbytes, 1)
        for i, (off, length) in enumerate(self.free):
            start = (off + align - 1) // align * align
            end = start + want
            end = (end + SMALL_ALIGN - 1) // SMALL_ALIGN * SMALL_ALIGN
            if end <= off + length:
                pieces = []
                if start > off:
                    pieces.append((off, start - off))
                if end < off + length:
                    pieces.append((end, off + length - end))
                self.free[i:i + 1] = pieces
                return start, end - start
        return None

    def release(self, off, length):
        self.free.append((off, length))
        self.free.sort()
        merged = []
        for o, n in self.free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self.free = merged

    def largest_free(self):
        return max((n for _, n in self.free), default=0)


class Region:
    __slots__ = ("name", "index", "rid", "offset", "span", "nbytes", "slots", "length", "dtype",
                 "meta", "addr", "rkey")   # rkey: the packed key of its UCX registration (rdma), else b""

    def describe(self):
        return {"name": self.name, "id": self.rid, "offset": self.offset, "nbytes": self.nbytes,
                "slots": self.slots, "length": self.length, "dtype": self.dtype,
                "meta": self.meta, "addr": self.addr}


def resolve_reduce_threads(value=None):
    """Threads for the server's vector operations: `value`, else SMB_REDUCE_THREADS; 0 is auto.

    Auto takes half the CPUs this process may run on, at most 8: the trainers of
    the node need the other half, and a streaming reduction saturates a
    socket's memory bandwidth with a few threads."""
    if value is None:
        value = settings.get("SMB_REDUCE_THREADS")
    if isinstance(value, str):
        text = value.strip()
        threads = int(text) if text.isdigit() else -1
    elif isinstance(value, int) and not isinstance(value, bool):
        threads = value
    else:
        threads = -1
    if not 0 <= threads <= MAX_REDUCE_THREADS:
        raise ConfigError(
            f"SMB_REDUCE_THREADS={value!r} is not a thread count: set it (or smb-server "
            f"--reduce-threads) to 0 for auto or to 1..{MAX_REDUCE_THREADS}")
    if threads == 0:
        threads = min(8, max(1, _usable_cpus() // 2))
    return threads


def _usable_cpus():
    """CPUs this process may run on (its affinity: a Slurm step's, a taskset's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def arena_name(run_dir, index):
    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return f"/eddis-smb-{digest}-{int(index)}"


def interface_of(address):
    """The network interface that holds IPv4 `address` (None if none does, or for 0.0.0.0)."""
    import fcntl
    import struct

    if address in ("0.0.0.0", ""):
        return None
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue      # no IPv4 address on this interface
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def _published_host():
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Server:
    """One SMB server. ``start()`` returns once its address file is published."""

    def __init__(self, run_dir, index=0, memory=None, host=None, port=0, token=None,
                 hugepages=None, hello_timeout=None, reduce_threads=None, transport=None):
        from . import _core

        self.run_dir = Path(run_dir)
        self.index = int(index)
        self.memory = int(settings.get("SMB_MEMORY") if memory is None else _parse_size(memory))
        if self.memory <= 0:
            raise SMBValueError("server memory must be positive (--memory / SMB_MEMORY, e.g. 1G)")
        self.host = host
        self.port = int(port or 0)
        self.token = token
        # a connection that does not prove the token within this many seconds is closed
        self.hello_timeout = float(settings.get("SMB_HANDSHAKE_TIMEOUT") if hello_timeout is None
                                   else hello_timeout)
        self.requested = transports.requested(settings.get("SMB_TRANSPORT") if transport is None
                                              else transport)
        self.transport = None       # what it offers: decided at start(), from this node's facts
        self.transport_reason = None
        self.ucx_tls = None
        self.allow_tcp = settings.get("SMB_UCX_ALLOW_TCP")
        self.gate = None
        self.hugepages = settings.get("SMB_HUGEPAGES") if hugepages is None else str(hugepages)
        # checked now, so a node without the huge pages asked for fails before it listens
        (self.page_kind, self.page_size), self._page_warning = hugepage_plan(self.hugepages, self.memory)
        self.reduce_threads = resolve_reduce_threads(reduce_threads)
        self.core = _core.ServerCore()
        # the arena's head is the region generation table (see the native core)
        self.gen_table_bytes = _core.GEN_TABLE_SIZE
        self.allocator = ArenaAllocator(self.memory, base=self.gen_table_bytes)
        self.regions = {}
        self.by_id = {}             # region id -> Region (key requests name regions by id)
        self.keys_given = 0
        self.free_indices = list(range(MAX_REGIONS - 1, -1, -1))
        self.barriers = {}
        self.events = {}
        self.reductions = {}
        self.started = False
        self.info = None
        self.timeline = timeline.NULL_TIMELINE

    # ------------------------------------------------------------ lifecycle
    def start(self):
        token = self.token if self.token is not None else rundir.read_token(self.run_dir)
        self.timeline = timeline.for_server(self.index, metadata={
            "memory": self.memory, "reduce_threads": self.reduce_threads})
        shm = f"{arena_name(self.run_dir, self.index)}-{os.getpid()}"
        self._create_arena(shm)
        atexit.register(self._stop_at_exit)
        try:
            # the node's own address, never every interface: peers off the cluster
            # network must not even reach the handshake
            listen = self.host or _published_host()
            published = listen if listen != "0.0.0.0" else _published_host()
            if listen == "0.0.0.0":
                log.warning("smb-server %d listens on every interface (--host 0.0.0.0); give the "
                            "node's cluster address instead", self.index)
            self.transport, self.transport_reason = self._offer()
            hello = {"index": self.index, "hostname": identity.node_name(),
                     "arena": f"/proc/{os.getpid()}/fd/{self.core.arena_fd}",
                     "arena_size": self.core.arena_size, "pid": os.getpid(),
                     "transport": self.transport, "transport_reason": self.transport_reason}
            self.core.start_sockets(json.dumps(hello).encode(), self._handle, self.reduce_threads,
                                    settings.get("SMB_SOCKET_UNSENT"), settings.get("SMB_SERVER_SPIN_US"))
            if self.transport == "rdma":
                self._start_rdma(listen)
            self.gate = handshake.Gate(listen, self.port, token, self.core.adopt_socket,
                                       deadline=self.hello_timeout)
            self.port = self.gate.port
            self.core.run_in_thread()
            self.gate.start()
            self.started = True
            self.info = {"index": self.index, "hostname": identity.node_name(), "host": published,
                         "port": self.port, "pid": os.getpid(), "memory": self.memory,
                         "reduce_threads": self.reduce_threads, "pages": self.page_kind,
                         "transport": self.transport, "transport_reason": self.transport_reason,
                         "ucx_tls": self.ucx_tls}
            rundir.publish_server(self.run_dir, self.index, self.info)
        except BaseException:
            self._stop_gate()
            self.core.stop()
            raise
        log.info("smb-server %d serving %d bytes on %s:%d, %d reduction thread(s), transport %s",
                 self.index, self.memory, published, self.port, self.reduce_threads, self.describe_transport())
        usable = _usable_cpus()
        if self.reduce_threads > usable:
            # a Slurm step's tasks are bound to their own CPUs (one by default)
            log.warning("%d reduction threads share %d usable CPU(s) of this process; give the "
                        "server more (e.g. srun --cpus-per-task) or set SMB_REDUCE_THREADS lower",
                        self.reduce_threads, usable)
        return self

    def _offer(self):
        """(transport, why) this server offers: what SMB_TRANSPORT forces, or with auto what
        this node's facts allow (:func:`transport.offer`)."""
        if self.requested != "auto":
            return self.requested, f"SMB_TRANSPORT={self.requested}"
        return transports.offer(transports.node_facts(identity.node_name()))

    def _start_rdma(self, listen):
        """One-sided access through UCX, restricted to the HCA's transports and shared memory
        (and tcp only where SMB_UCX_ALLOW_TCP, a test setting, lets it)."""
        from . import _core

        available = [entry["transport"] for entry in _core.ucx_transports()]
        self.ucx_tls = transports.ucx_tls(available, allow_tcp=self.allow_tcp)
        if not self.ucx_tls:
            raise SMBValueError(
                f"smb-server {self.index}: SMB_TRANSPORT={self.requested}, but UCX offers none of the "
                f"transports SMB's one-sided access may use here (it lists {', '.join(available) or 'none'}; "
                f"SMB uses the HCA's and shared memory, never tcp); use SMB_TRANSPORT=socket or auto")
        if "tcp" in self.ucx_tls.split(","):
            log.warning("smb-server %d: UNSAFE: SMB_UCX_ALLOW_TCP=1 lets UCX's tcp transport serve "
                        "one-sided access, which checks no key: any peer that reaches its port can "
                        "write anywhere in this server. For tests only.", self.index)
            device = interface_of(listen)
            if device and "UCX_NET_DEVICES" not in os.environ:
                # UCX's own TCP ports follow its devices: the node's address only, as the gate
                os.environ["UCX_NET_DEVICES"] = device
        self.core.start_rdma(self.ucx_tls)

    def describe_transport(self):
        """The transport in words, for the start line and the log; UNSAFE where tcp RMA is on."""
        if self.transport != "rdma":
            return f"socket ({self.transport_reason})"
        text = f"rdma over UCX {self.ucx_tls} ({self.transport_reason})"
        if "tcp" in (self.ucx_tls or "").split(","):
            text += " -- UNSAFE: UCX tcp serves unchecked one-sided access (SMB_UCX_ALLOW_TCP=1, tests only)"
        return text

    def _create_arena(self, shm):
        if self._page_warning:
            log.warning(self._page_warning)
        if self.page_kind != "hugetlb":
            arena_limits.check_fits(self.memory)
        try:
            madvised = self.core.create_arena(shm, self.memory + self.gen_table_bytes, self.page_size,
                                              self.page_kind == "transparent")
        except MemoryError as exc:
            if self.page_kind != "hugetlb" or self.hugepages == "hugetlb":
                raise
            # another process took the free pages between the plan and the mmap
            log.warning("SMB_HUGEPAGES=auto: the hugetlb pages ran out (%s); using normal pages", exc)
            self.page_kind, self.page_size = "off", 0
            arena_limits.check_fits(self.memory)
            madvised = self.core.create_arena(shm, self.memory + self.gen_table_bytes)
        if self.page_kind != "hugetlb":
            try:
                arena_limits.reserve(self.core.arena_fd, self.core.arena_address, self.core.arena_size,
                                     transparent=self.page_kind == "transparent")
            except BaseException:
                self.core.destroy_arena()
                raise
        if not madvised:
            log.warning("SMB_HUGEPAGES=%s: madvise(MADV_HUGEPAGE) was refused; the arena uses "
                        "normal pages", self.hugepages)
            self.page_kind = "off"
        log.info("smb-server %d arena: %s", self.index,
                 describe_pages(self.page_kind, self.page_size, self.pages()))

    def pages(self):
        """What backs the arena now, read back from the kernel: kernel page size, resident
        bytes and bytes in huge pages (None before start or where smaps is unreadable)."""
        if self.core.arena_size == 0:
            return None
        return arena_pages(self.core.arena_address)

    def _stop_at_exit(self):
        try:
            self.stop()
        except Exception:  # interpreter shutdown: best effort, never mask the real exit
            pass

    def stop(self):
        """Unpublish, stop the request loop, free the shared memory."""
        atexit.unregister(self._stop_at_exit)
        if self.info is not None:
            rundir.unpublish_server(self.run_dir, self.index)
            self.info = None
        self._stop_gate()
        self.core.stop()
        self.started = False
        self.timeline.close()

    def _stop_gate(self):
        if self.gate is not None:
            self.gate.stop()
            self.gate = None

    def failure(self):
        """None while the server serves; else which of its threads ended on its own, and why.

        The reduction threads are not watched here: they end only when the core stops them,
        and a fault in one ends the whole process (the supervisor names its signal)."""
        if not self.started:
            return None
        why = self.gate.failure() if self.gate is not None else None
        if why is not None:
            return (f"its handshake thread (smb-server-gate) died: {why}; no new client could "
                    f"connect any more")
        why = self.core.loop_failure()
        if why is not None:
            return (f"its request loop (thread smb-server-progress) ended: {why}; no request "
                    f"would be answered any more")
        return None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def address(self):
        return f"{self.info['host']}:{self.port}" if self.info else None

    # ------------------------------------------------------------ requests
    def _handle(self, conn, req_id, payload):
        """Control requests; returns (status, reply) or None when the reply is deferred."""
        try:
            request, _ = decode_control(payload)
            op = request.get("op")
            method = getattr(self, "_op_" + str(op), None)
            if method is None:
                raise SMBValueError(f"unknown control op {op!r}")
            self.timeline.instant("smb_request", args={"op": op, "name": request.get("name")})
            return method(conn, req_id, request)
        except EddisError as exc:
            return _error_reply(exc)
        except (KeyError, TypeError, ValueError) as exc:
            return STATUS_INVALID, f"malformed request: {exc!r}".encode()

    def _op_region_create(self, conn, req_id, q):
        name = str(q["name"])
        slots, length, dtype = int(q["slots"]), int(q["length"]), str(q["dtype"])
        meta = q.get("meta")
        if dtype not in DTYPES:
            raise SMBValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        if slots < 1 or length < 0:
            raise SMBValueError(f"region {name!r}: slots must be >= 1 and length >= 0")
        region = self.regions.get(name)
        created = False
        if region is None:
            if not q.get("create", True):
                raise SMBKeyError(f"no region named {name!r} on server {self.index}")
            initial = _int64(q["initial"], f"region {name!r}: initial") if "initial" in q else None
            region = self._create(name, slots, length, dtype, meta)
            created = True
            try:
                if initial is not None:
                    self.core.write_int64(region.rid, 0, initial)
                return 0, json.dumps(dict(region.describe(), created=created)).encode()
            except BaseException:
                # the client gets an error, so no one would ever free this region
                self._release(region)
                raise
        elif (region.slots, region.length, region.dtype, region.meta) != (slots, length, dtype, meta):
            raise SMBValueError(
                f"region {name!r} exists with slots={region.slots} length={region.length} "
                f"dtype={region.dtype} meta={region.meta}, not slots={slots} length={length} "
                f"dtype={dtype} meta={meta}; attach with the same parameters or free it first")
        return 0, json.dumps(dict(region.describe(), created=created)).encode()

    def _op_region_lookup(self, conn, req_id, q):
        region = self.regions.get(str(q["name"]))
        if region is None:
            raise SMBKeyError(f"no region named {q['name']!r} on server {self.index}")
        return 0, json.dumps(region.describe()).encode()

    # rdma: what a proven connection may ask for, and nothing reaches UCX without it
    def _op_rdma_address(self, conn, req_id, q):
        """This server's UCX worker address, for a one-sided endpoint to it."""
        address = self.core.worker_address
        if address is None:
            raise SMBValueError(f"smb-server {self.index} offers the socket transport only "
                                f"({self.transport_reason}); use SMB_TRANSPORT=socket or auto")
        # and the key of the arena's generation table, which clients read (never write) to
        # tell a region from the one placed where it was freed
        reply = {"address_bytes": len(address), "generations": self.core.arena_address}
        return 0, json.dumps(reply).encode() + CONTROL_SEPARATOR + address + self.core.gen_key

    def _op_region_key(self, conn, req_id, q):
        """The remote key of one live region of this server (by id: index and generation),
        for one-sided put/get into that region alone."""
        rid = int(q["id"])
        region = self.by_id.get(rid)
        if region is None:
            raise SMBKeyError(f"no region with id {rid} on server {self.index}: it was freed (a stale "
                              f"pool handle?) or never was one of this job's; look the pool up again")
        if not region.rkey:
            raise SMBValueError(f"smb-server {self.index} offers the socket transport only "
                                f"({self.transport_reason}): it hands out no keys")
        self.keys_given += 1
        return 0, json.dumps({"id": rid}).encode() + CONTROL_SEPARATOR + region.rkey

    def _op_region_free(self, conn, req_id, q):
        region = self.regions.get(str(q["name"]))
        if region is None:
            raise SMBKeyError(f"no region named {q['name']!r} on server {self.index}")
        self._release(region)
        return 0, b"{}"

    def _release(self, region):
        """Give a region's memory, UCX registration and index back."""
        del self.regions[region.name]
        del self.by_id[region.rid]
        self.core.region_unregister(region.rid)
        self.allocator.release(region.offset, region.span)
        self.free_indices.append(region.index)

    def _create(self, name, slots, length, dtype, meta):
        nbytes = slots * length * ITEMSIZE[dtype]
        if not self.free_indices:
            raise SMBMemoryError(f"server {self.index} holds {MAX_REGIONS} regions already; free some")
        got = self.allocator.alloc(nbytes) if nbytes <= self.memory else None
        if got is None:
            raise SMBMemoryError(
                f"region {name!r} needs {nbytes} bytes but server {self.index} has at most "
                f"{self.allocator.largest_free()} contiguous bytes free of {self.memory}; "
                "start smb-server with more --memory (SMB_MEMORY) or use more servers")
        offset, span = got
        index = self.free_indices.pop()
        try:
            rid, addr, rkey = self.core.region_register(index, offset, max(nbytes, 1), slots, length,
                                                        DTYPES[dtype])
        except BaseException:
            self.free_indices.append(index)
            self.allocator.release(offset, span)
            raise
        region = Region()
        region.name, region.index, region.rid = name, index, rid
        region.offset, region.span, region.nbytes = offset, span, nbytes
        region.slots, region.length, region.dtype, region.meta = slots, length, dtype, meta
        region.addr, region.rkey = addr, rkey
        self.regions[name] = region
        self.by_id[rid] = region
        return region

    # barriers: every arrival is deferred until `parties` are in, then all are released
    def _op_barrier(self, conn, req_id, q):
        name, parties = str(q["name"]), int(q["parties"])
        if parties < 1:
            raise SMBValueError("barrier parties must be >= 1")
        state = self.barriers.setdefault(name, {"parties": parties, "waiting": [], "generation": 0})
        if state["parties"] != parties:
            raise SMBValueError(f"barrier {name!r} has {state['parties']} parties, not {parties}; "
                                "every participant must pass the same count")
        state["waiting"] = [(c, r) for c, r in state["waiting"] if self.core.conn_alive(c)]
        state["waiting"].append((conn, req_id))
        if len(state["waiting"]) < parties:
            return None
        generation = state["generation"]
        state["generation"] += 1
        reply = json.dumps({"generation": generation}).encode()
        for c, r in state["waiting"]:
            if (c, r) != (conn, req_id):
                self.core.reply(c, r, 0, reply)
        state["waiting"] = []
        return 0, reply

    # events: a version number; waits are deferred until it reaches the asked version
    def _event(self, name):
        return self.events.setdefault(name, {"version": 0, "waiting": []})

    def _op_event_notify(self, conn, req_id, q):
        state = self._event(str(q["name"]))
        state["version"] += 1
        version = state["version"]
        keep = []
        for c, r, want in state["waiting"]:
            if want <= version:
                self.core.reply(c, r, 0, json.dumps({"version": version}).encode())
            elif self.core.conn_alive(c):
                keep.append((c, r, want))
        state["waiting"] = keep
        return 0, json.dumps({"version": version}).encode()

    def _op_event_wait(self, conn, req_id, q):
        state = self._event(str(q["name"]))
        want = int(q["version"])
        if state["version"] >= want:
            return 0, json.dumps({"version": state["version"]}).encode()
        state["waiting"].append((conn, req_id, want))
        return None

    def _op_event_version(self, conn, req_id, q):
        return 0, json.dumps({"version": self._event(str(q["name"]))["version"]}).encode()

    # reductions: contributions collected per (destination, range, generation)
    def _op_reduce(self, conn, req_id, q):
        key = (int(q["dst"]), int(q["dst_slot"]), int(q["start"]), int(q["count"]), int(q["generation"]))
        parties, average = int(q["parties"]), bool(q.get("average", True))
        if parties < 1:
            raise SMBValueError("reduce parties must be >= 1")
        state = self.reductions.setdefault(key, {"parties": parties, "average": average, "items": []})
        if state["parties"] != parties or state["average"] != average:
            raise SMBValueError(
                f"reduce generation {key[4]}: contributors disagree (parties {state['parties']} vs "
                f"{parties}, average {state['average']} vs {average}); pass the same values everywhere")
        state["items"].append((conn, req_id, int(q["src"]), int(q["src_slot"]), float(q["weight"])))
        if len(state["items"]) < parties:
            return None
        del self.reductions[key]
        items = state["items"]
        total = sum(w for *_, w in items)
        scale = 1.0
        if average:
            if total == 0:
                return self._reply_all(items, conn, req_id, STATUS_INVALID,
                                       b"reduce: the contributions' weights sum to 0; cannot average")
            scale = 1.0 / total
        started = timeline.now_ns()
        try:
            threads = self.core.weighted_sum(key[0], key[1], key[2], key[3],
                                             [(src, slot, w * scale) for _, _, src, slot, w in items])
        except EddisError as exc:
            status, message = _error_reply(exc)
            return self._reply_all(items, conn, req_id, status, message)
        self.timeline.complete(timeline.REDUCE, started, args={
            "generation": key[4], "parties": parties, "start": key[2], "count": key[3],
            "threads": threads})
        return self._reply_all(items, conn, req_id, 0, json.dumps({"weight": total}).encode())

    def _reply_all(self, items, conn, req_id, status, payload):
        for c, r, *_ in items:
            if (c, r) != (conn, req_id):
                self.core.reply(c, r, status, payload)
        return status, payload

    def _op_stats(self, conn, req_id, q):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        stats = dict(self.core.stats, regions=len(self.regions), transport=self.transport,
                     handshake=dict(self.gate.stats) if self.gate is not None else None,
                     free_bytes=sum(n for _, n in self.allocator.free), keys_given=self.keys_given,
                     # the server's CPU (all its threads): what a transfer costs it (bench/smb_bandwidth.py)
                     cpu_seconds=usage.ru_utime + usage.ru_stime)
        if self.gate is not None:
            # a connection refused at the handshake is a refused request of the other transport
            stats["refused"] += self.gate.stats["refused"]
        return 0, json.dumps(stats).encode()


def _error_reply(exc):
    if isinstance(exc, SMBKeyError):
        status = STATUS_NO_ELEM
    elif isinstance(exc, SMBBoundsError):
        status = STATUS_BOUNDS
    elif isinstance(exc, SMBMemoryError):
        status = STATUS_NO_MEMORY
    elif isinstance(exc, SMBPermissionError):
        status = STATUS_REJECTED
    else:
        status = STATUS_INVALID
    return status, exc.message.encode()


def _int64(value, what):
    """A request's integer that must fit a signed 64-bit counter, else SMBValueError."""
    number = int(value)
    if not -(1 << 63) <= number < (1 << 63):
        raise SMBValueError(f"{what}={number} is outside the signed 64-bit range -2**63..2**63-1")
    return number


def _parse_size(value):
    if isinstance(value, int):
        return value
    return settings.REGISTRY["SMB_MEMORY"].parse(str(value))


# ---------------------------------------------------------------- CLI
def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(
        prog="smb-server",
        description="Serve this node's memory to the EDDIS job (SMB). "
                    "Runs until SIGTERM/SIGINT.")
    parser.add_argument("--run-dir", help="job run directory (default: EDDIS_RUN_DIR or ~/.eddis/run/<job>)")
    parser.add_argument("--index", type=int, default=None, help="server index (default: SLURM_NODEID or 0)")
    parser.add_argument("--memory", default=None, type=settings.REGISTRY["SMB_MEMORY"].flag_type(keep_text=True),
                        help="bytes to lend, suffix K/M/G (default SMB_MEMORY)")
    parser.add_argument("--host", default=None, help="IPv4 address to listen on (default: all, publishes this host's address)")
    parser.add_argument("--port", type=settings.REGISTRY["SMB_PORT"].flag_type(), default=None,
                        help="TCP port (default SMB_PORT, 0: any)")
    parser.add_argument("--reduce-threads", default=None, type=settings.REGISTRY["SMB_REDUCE_THREADS"].flag_type(),
                        help="threads per large vector operation, the request thread included "
                             "(default SMB_REDUCE_THREADS; 0: auto, half the usable CPUs, at most 8)")
    parser.add_argument("--hugepages", default=None, type=settings.REGISTRY["SMB_HUGEPAGES"].flag_type(),
                        help="huge pages for the memory (default SMB_HUGEPAGES): hugetlb, "
                             "transparent, auto (either, else normal pages) or off")
    parser.add_argument("--expect-token-file", default=None, help="token file (default: <run dir>/token)")
    parser.add_argument("--create-run-dir", action="store_true", help="create the run directory and token if absent")
    parser.add_argument("--log-level", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level or settings.get("EDDIS_LOG_LEVEL"),
                        format="smb-server %(levelname)s %(message)s")
    run_dir = Path(args.run_dir) if args.run_dir else rundir.default_run_dir()
    if args.create_run_dir:
        rundir.create_run_dir(run_dir)
    index = args.index if args.index is not None else int(os.environ.get("SLURM_NODEID", "0"))
    token = rundir.read_token(args.expect_token_file or run_dir)
    port = args.port if args.port is not None else settings.get("SMB_PORT")
    # A plain list, not a threading.Event: Event.set() in a signal handler can
    # deadlock on the lock that the interrupted Event.wait() holds.
    stop = []

    def on_signal(signum, frame):
        stop.append(signum)

    # SIGUSR2 too (not SIGHUP, which UCX takes for its debug signal): started with SIGINT or
    # SIGTERM ignored (eddis-train --smb-server in a job), it keeps ignoring them: an interrupt of
    # the job is the trainers', as is the SIGTERM of a preemption they answer with a checkpoint
    # that reads this server; its supervisor stops it after them with SIGUSR2.
    signal.signal(signal.SIGUSR2, on_signal)
    for signum in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, on_signal)
    try:
        server = Server(run_dir, index=index, memory=args.memory, host=args.host, port=port,
                        token=token, reduce_threads=args.reduce_threads,
                        hugepages=args.hugepages).start()
    except EddisError as exc:
        print(f"smb-server: {exc}", file=sys.stderr)
        return 1
    print(f"smb-server {index} ready on {server.address} ({server.memory} bytes, "
          f"{server.reduce_threads} reduction thread(s), "
          f"{describe_pages(server.page_kind, server.page_size, None)}, "
          f"transport {server.describe_transport()})", flush=True)
    failure = None
    try:
        while not stop and failure is None:
            time.sleep(WATCH_SECONDS)
            failure = server.failure()
    finally:
        if failure is not None:
            # said first: the stop below may itself fail on what broke the thread
            error = SMBServerError(f"smb-server {index} stops: {failure}. Its job cannot go on "
                                   f"without it: remove the cause named here and start the job "
                                   f"again (a cause that names no limit of this node is a bug of "
                                   f"EDDIS: report it with the lines above)")
            print(f"smb-server: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        try:
            server.stop()
        except Exception as exc:
            if failure is None:
                raise
            print(f"smb-server {index}: stopping after the failure failed too: {exc!r}", file=sys.stderr,
                  flush=True)
    return 0 if failure is None else SERVER_FAILED_STATUS


if __name__ == "__main__":
    sys.exit(main())
