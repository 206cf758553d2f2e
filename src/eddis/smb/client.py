"""SMB client: connections to all servers of a job, requests, synchronization objects.

A :class:`Client` holds one connection per server: a socket on which both
sides proved the job token, for every request; with the rdma transport
(:mod:`.transport`) also a UCX endpoint per server, to the worker address that
server gave over the proven socket, for one-sided put/get with the keys it
gives per region. Every wait is bounded by ``timeout`` (default
``SMB_TIMEOUT``); a server that dies turns into
:class:`~eddis.errors.SMBConnectionError` for the waits on it, never a hang.
"""
import contextlib
import json
import logging
import threading
import zlib

from .. import identity, settings
from ..errors import (SMBConnectionError, SMBTimeoutError, SMBValueError, UsageError,
                      from_ucs_status)
from . import handshake, rundir, transport as transports
from .counter import Counter
from .protocol import decode_control, encode_control
from .requests import Completed, Request

log = logging.getLogger("eddis.smb.client")


GENERATIONS = "generations"   # the key name of a server's generation table (rdma)


class Client:
    """Connects to every SMB server of the job. Usable as a context manager."""

    def __init__(self, run_dir=None, addresses=None, token=None, timeout=None, expected_servers=None):
        from . import _core

        self.timeout = float(settings.get("SMB_TIMEOUT") if timeout is None else timeout)
        self.run_dir = None
        if addresses is None:
            self.run_dir = rundir.default_run_dir() if run_dir is None else run_dir
            if expected_servers is not None:
                records = rundir.wait_for_servers(self.run_dir, int(expected_servers))
            else:
                records = rundir.read_servers(self.run_dir) or rundir.wait_for_servers(self.run_dir, 1)
                records = [r for i, r in enumerate(records) if r["index"] == i]
            addresses = [(r["host"], int(r["port"])) for r in records]
        else:
            addresses = [_parse_address(a) for a in addresses]
            if expected_servers is not None and len(addresses) != int(expected_servers):
                raise SMBValueError(f"{len(addresses)} addresses given but expected_servers={expected_servers}")
        if not addresses:
            raise SMBValueError("no SMB servers to connect to; start smb-server or pass addresses")
        if token is None:
            if self.run_dir is None and run_dir is None:
                raise SMBValueError("explicit addresses need token= or run_dir= (to read the job token)")
            token = rundir.read_token(self.run_dir or run_dir)
        self._lock = threading.Lock()
        # Same-node accesses in progress (memcpy, atomics on the mapped arenas): close()
        # marks the client closed, waits for them, and only then lets the core unmap.
        self._maps_idle = threading.Condition(threading.Lock())
        self._mapped_users = 0
        self._requested = transports.requested(settings.get("SMB_TRANSPORT"))
        self.transport = None       # the job's: decided from what the servers offer (_connect)
        self.transport_reason = None
        self.ucx_tls = None
        self.gpu_direct = False
        self._core = _core.ClientCore()
        self._closed = False
        self.lost_servers = set()   # given up for good (note_lost): mirrored objects work around them
        self._addresses = addresses
        self.servers = []
        try:
            self._connect(token)
        except BaseException:
            self._core.close()
            self._closed = True
            raise

    # ------------------------------------------------------------ connection
    def _connect(self, token):
        from . import _core

        unsent = settings.get("SMB_SOCKET_UNSENT")
        conns = [self._core.adopt_socket(handshake.connect(host, port, token, self.timeout), unsent)
                 for host, port in self._addresses]
        pending = _core.Pending(self._core)
        for conn in conns:
            self._core.post_request(pending, conn, _core.OP_HELLO, b"")
        if pending.wait(self.timeout) != 0 or pending.error_status:
            failed = [c for c in conns if self._core.conn_failed(c)]
            if failed:
                c = failed[0]
                raise SMBConnectionError(
                    f"cannot reach smb-server {c} at {self.address(c)}: "
                    f"{self._status_text(self._core.conn_status(c))}; is it running (see the run directory)?",
                    self._core.conn_status(c) or -6)
            raise SMBTimeoutError(f"smb-servers did not answer HELLO within {self.timeout:g} s")
        local_map = settings.get("SMB_LOCAL_MAP")
        me = identity.node_name()
        for conn, (status, data) in zip(conns, pending.replies()):
            if status != 0:
                raise from_ucs_status(status, f"smb-server {conn} at {self.address(conn)}: {data.decode(errors='replace')}")
            info = json.loads(data)
            info["conn"] = conn
            info["base"] = 0
            if local_map and info["hostname"] == me:
                info["base"] = self._core.map_arena(info["arena"], int(info["arena_size"]))
            self.servers.append(info)
        self.transport, self.transport_reason = transports.job_transport(
            self._requested, [(s, info.get("transport", "socket"), info.get("transport_reason", "an older server"))
                              for s, info in enumerate(self.servers)])
        if self.transport == "rdma":
            self._connect_rdma()

    def _connect_rdma(self):
        """One-sided endpoints to the servers this process does not map, at the worker
        addresses they give over the proven connections (they give them to no one else)."""
        from . import _core

        remote = [s for s in range(self.num_servers) if not self.is_local(s)]
        if not remote:
            return
        available = [entry["transport"] for entry in _core.ucx_transports()]
        gpu = settings.get("SMB_GPU_DIRECT")
        tls = transports.ucx_tls(available, allow_tcp=settings.get("SMB_UCX_ALLOW_TCP"), gpu_direct=gpu)
        if not tls:
            raise SMBValueError(f"the job's transport is rdma ({self.transport_reason}), but UCX offers this "
                                f"process none of the transports SMB may use (it lists {', '.join(available)}); "
                                "use SMB_TRANSPORT=socket")
        self._core.start_rdma(tls)
        self.ucx_tls = tls
        # GPUDirect: transfers from CUDA memory, where asked for and UCX can move it
        self.gpu_direct = gpu and "cuda" in self._core.memory_types
        replies = self._control_nb([(s, {"op": "rdma_address"}) for s in remote], "rdma connect",
                                   lambda rs: [decode_control(r) for r in rs]).wait()
        peer_errors = transports.reports_lost_peers(tls)
        for server, (info, tail) in zip(remote, replies):
            conn = self.servers[server]["conn"]
            split = int(info["address_bytes"])
            self._core.connect_rdma(conn, tail[:split], peer_errors)
            self.servers[server]["generations"] = (int(info["generations"]),
                                                   self._core.rkey(conn, GENERATIONS, tail[split:]))

    @property
    def num_servers(self):
        return len(self.servers)

    def address(self, conn):
        host, port = self._addresses[conn]
        return f"{host}:{port}"

    def is_local(self, server):
        """True when server's memory is mapped into this process (same node)."""
        return bool(self.servers[server]["base"])

    def mapped_servers(self):
        """Indices of the servers whose memory is mapped into this process (this node's)."""
        return [s for s in range(self.num_servers) if self.is_local(s)]

    def check_alive(self, servers, what):
        """Raise SMBConnectionError if any of these servers' connections failed.

        Same-node transfers are plain memory copies and would not notice a dead
        server otherwise; one worker progress lets UCX report the lost peer."""
        self._core.progress()
        for server in servers:
            conn = self.servers[server]["conn"]
            if self._core.conn_failed(conn):
                code = self._core.conn_status(conn)
                raise SMBConnectionError(
                    f"{what}: lost SMB server {server} ({self.address(conn)}): "
                    f"{self._status_text(code)}; the server died or was stopped", code or -25)

    def servers_on_hosts(self, hosts):
        """Indices of the servers that run on any of ``hosts`` (by host name, whether or not
        their memory is mapped here), in server order."""
        return servers_on_hosts([info["hostname"] for info in self.servers], hosts)

    def servers_of(self, conns):
        """The server indices of these connections, sorted."""
        conns = set(conns)
        return sorted(s for s, info in enumerate(self.servers) if info["conn"] in conns)

    def note_lost(self, give_up=()):
        """Take the servers whose connection failed, and ``give_up`` (servers that left a
        request unanswered for its whole timeout), as lost for good; returns the newly lost.
        What a mirrored pool or counter (eddis.smb.mirror) calls when an operation fails."""
        for server in give_up:
            self._core.fail_conn(self.servers[server]["conn"])
        self._core.progress()
        new = [s for s, info in enumerate(self.servers)
               if s not in self.lost_servers and self._core.conn_failed(info["conn"])]
        for server in new:
            log.warning("lost smb-server %d at %s (%s): mirrored pools and counters go on with "
                        "its other copies", server, self.address(self.servers[server]["conn"]),
                        self.servers[server].get("hostname", "?"))
        self.lost_servers.update(new)
        return new

    def _status_text(self, code):
        from . import _core

        return _core.status_text(code) if code else "unknown error"

    def close(self):
        """Disconnect and unmap; every later use of this client or its objects raises UsageError."""
        with self._maps_idle:
            self._closed = True
            busy = not self._maps_idle.wait_for(lambda: not self._mapped_users, self.timeout)
        if busy:
            # unmapping now would crash the copies still running into that memory
            raise UsageError(f"close(): same-node transfers of this SMB client still run after "
                             f"{self.timeout:g} s; the client is closed to new use, call close() "
                             "again to release its memory")
        self._core.close()

    @contextlib.contextmanager
    def _mapped_access(self, kind, name):
        """A same-node access of object `kind` `name`: UsageError once the client is closed;
        while it lasts, close() leaves the mapped memory in place."""
        with self._maps_idle:
            if self._closed:
                raise UsageError(f"{kind} {name!r}: this SMB client is closed")
            self._mapped_users += 1
        try:
            yield
        finally:
            with self._maps_idle:
                self._mapped_users -= 1
                if not self._mapped_users:
                    self._maps_idle.notify_all()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check(self):
        if self._closed:
            raise UsageError("this SMB client is closed")

    # ------------------------------------------------------------ requests
    def _pending(self):
        from . import _core

        self._check()
        return _core.Pending(self._core)

    def _post(self, pending, server, op, payload):
        self._core.post_request(pending, self.servers[server]["conn"], op, payload)

    def _control_nb(self, calls, description, finish=None):
        """Post [(server, obj)] control requests together; returns a Request."""
        from . import _core

        pending = self._pending()
        for server, obj in calls:
            self._post(pending, server, _core.OP_CONTROL, encode_control(obj))
        return Request(self, pending, description, finish, [s for s, _ in calls])

    def _control(self, server, obj, description, timeout=None):
        return self._control_nb([(server, obj)], description,
                                lambda replies: decode_control(replies[0])).wait(timeout)

    def region_keys_nb(self, regions, what):
        """rdma: ask the servers for the remote keys of ``regions`` [(server, region id)];
        wait() gives a key handle for post_put/post_get per region (0 on the socket transport,
        where the server checks each request against its region table)."""
        if self.transport != "rdma":
            return Completed([0] * len(regions))
        calls = [(server, {"op": "region_key", "id": int(rid)}) for server, rid in regions]

        def unpack(replies):
            with self._lock:
                return [self._core.rkey(self.servers[server]["conn"], rid, decode_control(reply)[1])
                        for (server, rid), reply in zip(regions, replies)]

        return self._control_nb(calls, f"{what}: region keys", unpack)

    def server_for(self, name):
        """The server that holds a named counter, barrier or event."""
        return zlib.crc32(name.encode()) % self.num_servers

    def stats(self, server=0):
        return self._control(server, {"op": "stats"}, "stats")[0]

    # ------------------------------------------------------------ objects
    def pool(self, name, length, dtype="float32", slots=1, create=True, servers=None, mirrored=False):
        """A :class:`~eddis.smb.pool.Pool`; ``mirrored``: a
        :class:`~eddis.smb.mirror.MirroredPool`, every element on two servers (all of them)."""
        if mirrored:
            if servers is not None:
                raise SMBValueError(f"pool {name!r}: a mirrored pool spans every server; drop servers=")
            from .mirror import MirroredPool

            return MirroredPool(self, name, length, dtype=dtype, slots=slots, create=create)
        from .pool import Pool

        return Pool(self, name, length, dtype=dtype, slots=slots, create=create, servers=servers)

    def counter(self, name, initial=0, server=None, mirrored=False):
        """A :class:`Counter`; ``mirrored``: a :class:`~eddis.smb.mirror.MirroredCounter`, on
        its server and the next one."""
        if mirrored:
            from .mirror import MirroredCounter

            return MirroredCounter(self, name, initial, server)
        return Counter(self, name, initial, server)

    def barrier(self, name, parties):
        return Barrier(self, name, parties)

    def free_when_all_arrive(self, barrier_name, parties, pools, timeout, what):
        """Free ``pools`` (those this caller frees; the other parties pass none) once
        ``parties`` callers have reached the SMB barrier ``barrier_name``, so memory that
        another party may still be reading goes only when every one is done. Never raises:
        a missing party costs ``timeout`` and a warning naming ``what``, and the servers
        free everything when they stop anyway."""
        try:
            self.barrier(barrier_name, parties).wait(timeout=timeout)
            for pool in pools:
                if pool is not None:
                    pool.free()
        except Exception as exc:
            log.warning("could not free %s: %s", what, exc)

    def event(self, name):
        return Event(self, name)


def _parse_address(address):
    if isinstance(address, dict):
        return address["host"], int(address["port"])
    if isinstance(address, (tuple, list)):
        return str(address[0]), int(address[1])
    host, sep, port = str(address).rpartition(":")
    if not sep:
        raise SMBValueError(f"server address {address!r} must be HOST:PORT")
    return host, int(port)


def servers_on_hosts(server_hosts, hosts):
    """Indices of the servers (by their host names, in server order) on any of ``hosts``."""
    hosts = set(hosts)
    return [s for s, host in enumerate(server_hosts) if host in hosts]


class Barrier:
    """A reusable barrier for `parties` participants."""

    def __init__(self, client, name, parties):
        if int(parties) < 1:
            raise SMBValueError("barrier parties must be >= 1")
        self._client = client
        self.name = name
        self.parties = int(parties)
        self.server = client.server_for("barrier:" + name)

    def wait(self, timeout=None):
        """Block until all parties arrived; returns the barrier's generation number."""
        reply, _ = self._client._control(
            self.server, {"op": "barrier", "name": self.name, "parties": self.parties},
            f"barrier {self.name!r} ({self.parties} parties)", timeout)
        return reply["generation"]


class Event:
    """A versioned event: notify() bumps the version, wait(v) returns once version >= v."""

    def __init__(self, client, name):
        self._client = client
        self.name = name
        self.server = client.server_for("event:" + name)

    def notify(self):
        return self._client._control(self.server, {"op": "event_notify", "name": self.name},
                                     f"event {self.name!r} notify")[0]["version"]

    def wait(self, version, timeout=None):
        return self._client._control(self.server, {"op": "event_wait", "name": self.name,
                                                   "version": int(version)},
                                     f"event {self.name!r} wait for version {version}", timeout)[0]["version"]

    def version(self):
        return self._client._control(self.server, {"op": "event_version", "name": self.name},
                                     f"event {self.name!r} version")[0]["version"]
