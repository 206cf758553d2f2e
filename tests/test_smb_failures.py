"""SMB refusals and failures: bad token, bad requests, dead servers.

Each refusal must give the documented error and leave the server serving
others; a SIGKILLed server must give clients an error, never a hang. Both
transports between fake nodes (proven sockets; one-sided rdma over UCX's shared memory and,
test-only, its tcp), and the same-node path.
"""
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import python_env
from launch_helpers import stop_every_thread
from test_liveness_local import SMB_TRAINER, assert_nothing_left, finish, server_record, start, started_ranks

from eddis.errors import (SMBBoundsError, SMBConnectionError, SMBError, SMBKeyError, SMBMemoryError,
                          SMBPermissionError, SMBTimeoutError, SMBValueError, UsageError)
from eddis.smb import Client, _core
from eddis.smb.client import Request
from eddis.smb.protocol import COUNTER_REQUEST, VEC_REQUEST, VEC_SOURCE
from eddis.smb.testing import LocalServers

TRANSPORTS = {
    "socket": ({"SMB_TRANSPORT": "socket", "SMB_LOCAL_MAP": "0"}, ["smb-node0", "smb-node1"], "client-node"),
    "rdma-shm": ({"SMB_TRANSPORT": "rdma", "SMB_LOCAL_MAP": "0"}, ["smb-node0", "smb-node1"], "client-node"),
    "rdma-tcp": ({"SMB_TRANSPORT": "rdma", "SMB_UCX_ALLOW_TCP": "1", "UCX_TLS": "tcp", "SMB_LOCAL_MAP": "0"},
                 ["smb-node0", "smb-node1"], "client-node"),
    "same-node": ({"SMB_LOCAL_MAP": "1"}, None, None),
}


@pytest.fixture(params=list(TRANSPORTS))
def transport(request, monkeypatch):
    env, hostnames, client_host = TRANSPORTS[request.param]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if client_host:
        monkeypatch.setenv("EDDIS_HOSTNAME", client_host)
    else:
        monkeypatch.delenv("EDDIS_HOSTNAME", raising=False)
    return env, hostnames


def raw_request(client, server, op, payload, what="raw request"):
    pending = client._pending()
    client._post(pending, server, op, payload)
    return Request(client, pending, what, lambda replies: replies[0], [server]).wait(10)


@pytest.mark.timeout(120)
def test_refusals_keep_the_server_serving(transport):
    env, hostnames = transport
    with LocalServers(2, memory="8M", env=env, hostnames=hostnames) as servers:
        # wrong token: refused with a permission error
        with pytest.raises(SMBPermissionError, match="token"):
            Client(addresses=[f"127.0.0.1:{r['port']}" for r in servers.records], token="not-the-token",
                   timeout=10)
        client = Client(servers.run_dir, expected_servers=2, timeout=10)
        pool = client.pool("p", 1000, dtype="float32", slots=2)
        rid = pool.segments[0].rid
        # out-of-bounds: caught by the client, and by the server for crafted requests
        with pytest.raises(SMBBoundsError):
            pool.write(np.zeros(10, np.float32), start=995)
        with pytest.raises(SMBBoundsError):
            pool.read(slot=2)
        with pytest.raises(SMBBoundsError):
            raw_request(client, 0, _core.OP_VECOP,
                        VEC_REQUEST.pack(_core.VEC_SCALE, 0, rid, 0, 400, 200, 2.0))
        with pytest.raises(SMBBoundsError):
            raw_request(client, 0, _core.OP_VECOP,
                        VEC_REQUEST.pack(_core.VEC_COPY, 1, rid, 0, 0, 10, 0.0) + VEC_SOURCE.pack(rid, 7, 1.0))
        counter = client.counter("c")
        with pytest.raises(SMBBoundsError):
            raw_request(client, counter.server, _core.OP_COUNTER,
                        COUNTER_REQUEST.pack(counter._rid, _core.COUNTER_FETCH_ADD, 1, 1, 0))
        # a float op on an integer region, malformed payloads
        with pytest.raises(SMBValueError):
            raw_request(client, counter.server, _core.OP_VECOP,
                        VEC_REQUEST.pack(_core.VEC_SCALE, 0, counter._rid, 0, 0, 1, 2.0))
        with pytest.raises(SMBValueError):
            raw_request(client, 0, _core.OP_VECOP, b"\x01\x02")
        with pytest.raises(SMBValueError):
            raw_request(client, 0, _core.OP_CONTROL, b"{not json")
        with pytest.raises(SMBValueError):
            raw_request(client, 0, 99, b"")
        # unknown keys: region names, region ids
        with pytest.raises(SMBKeyError):
            client.pool("missing", 10, create=False)
        with pytest.raises(SMBKeyError):
            raw_request(client, 0, _core.OP_COUNTER,
                        COUNTER_REQUEST.pack(0xFFFF0FFF, _core.COUNTER_READ, 0, 0, 0))
        # oversized allocation
        with pytest.raises(SMBMemoryError):
            client.pool("huge", 8 << 20, dtype="float32")
        # inconsistent use
        with pytest.raises(SMBValueError):
            client.pool("p", 1000, dtype="float16", slots=2)
        client.barrier("b2", 2)  # creating the object sends nothing
        # still serving: this client and a new one
        pool.write(np.arange(1000, dtype=np.float32), slot=1)
        other = Client(servers.run_dir, expected_servers=2, timeout=10)
        np.testing.assert_array_equal(other.pool("p", 1000, slots=2).read(slot=1),
                                      np.arange(1000, dtype=np.float32))
        assert other.counter("c").fetch_add(3) == 0
        assert client.stats(0)["refused"] >= 6
        other.close()
        client.close()
    assert not servers.leftovers
    assert not servers.hung and not servers.unpublished


@pytest.mark.timeout(120)
def test_server_sigkill_gives_errors_not_hangs(transport):
    env, hostnames = transport
    with LocalServers(2, memory="8M", env=env, hostnames=hostnames) as servers:
        client = Client(servers.run_dir, expected_servers=2, timeout=8)
        pool = client.pool("p", 1000, slots=1)
        pool.write(np.ones(1000, np.float32))
        names = [n for n in (f"k{i}" for i in range(50)) if client.server_for("counter:" + n) == 1]
        counter = client.counter(names[0])
        barrier_name = next(n for n in (f"b{i}" for i in range(50)) if client.server_for("barrier:" + n) == 1)
        pending = client.barrier(barrier_name, 2)
        servers.kill(1, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises((SMBConnectionError, SMBTimeoutError)):
            pool.read()
        with pytest.raises((SMBConnectionError, SMBTimeoutError)):
            pool.write(np.zeros(1000, np.float32))
        with pytest.raises((SMBConnectionError, SMBTimeoutError)):
            counter.fetch_add(1)
        with pytest.raises((SMBConnectionError, SMBTimeoutError)):
            pending.wait(timeout=8)
        with pytest.raises((SMBConnectionError, SMBTimeoutError)):
            client.pool("other", 10)
        elapsed = time.monotonic() - start
        # the part on the surviving server still works (the failed write landed there)
        np.testing.assert_array_equal(pool.read(start=0, count=500), np.zeros(500, np.float32))
        pool.write(np.full(500, 2, np.float32))
        np.testing.assert_array_equal(pool.read(count=500), np.full(500, 2, np.float32))
        client.close()
        print(f"errors after SIGKILL took {elapsed:.2f} s in all")
    # the arena was unlinked at creation: even a SIGKILLed server leaves nothing behind
    assert servers.leftovers == []
    assert not servers.hung and not servers.unpublished  # the survivor stopped cleanly


def give_up_by_a_transfer(client, pool, counter):
    with pytest.raises((SMBTimeoutError, SMBConnectionError)):
        pool.read()


def give_up_by_a_request(client, pool, counter):
    """As a mirrored counter does (eddis.smb.mirror): a request left unanswered, then note_lost."""
    with pytest.raises(SMBTimeoutError):
        counter.fetch_add(1)
    assert client.note_lost(give_up=[1]) == [1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport, give_up", [
    ("socket", give_up_by_a_transfer), ("rdma-tcp", give_up_by_a_transfer), ("socket", give_up_by_a_request),
    ("rdma-shm", give_up_by_a_request), ("rdma-tcp", give_up_by_a_request)], indirect=["transport"],
    ids=["socket-transfer", "rdma-tcp-transfer", "socket-request", "rdma-shm-request", "rdma-tcp-request"])
def test_a_server_given_up_after_a_timeout_gives_errors_on_every_later_use(transport, give_up):
    """A transfer or request left unanswered gives its server up (its endpoint is closed);
    later transfers to it must fail with the loss, never use the closed endpoint. (Between
    fake nodes only: on the same node a stopped server's memory is still mapped, and copies
    work; so do one-sided gets over CMA, which leave nothing unanswered: rdma-shm's server
    is given up through a request.)"""
    env, hostnames = transport
    with LocalServers(2, memory="8M", env=env, hostnames=hostnames) as servers:
        client = Client(servers.run_dir, expected_servers=2, timeout=2)
        try:
            pool = client.pool("p", 1000, slots=1)
            pool.write(np.ones(1000, np.float32))
            counter = client.counter("c", server=1)
            stop_every_thread(servers.procs[1].pid)
            try:
                give_up(client, pool, counter)
                for _ in range(2):
                    with pytest.raises((SMBConnectionError, SMBTimeoutError)):
                        pool.write(np.zeros(1000, np.float32))
                    with pytest.raises((SMBConnectionError, SMBTimeoutError)):
                        pool.read()
                np.testing.assert_array_equal(pool.read(count=500), np.zeros(500, np.float32))
            finally:
                servers.procs[1].send_signal(signal.SIGCONT)
        finally:
            client.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_stops_cleanly_every_time(transport):
    """Repeated SIGTERMs at random moments: every server exits, unpublishes, frees its memory."""
    env, hostnames = transport
    for _ in range(3):
        servers = LocalServers(2, memory="4M", env=env, hostnames=hostnames).start()
        client = Client(servers.run_dir, expected_servers=2, timeout=10)
        client.pool("p", 100).write(np.ones(100, np.float32))
        servers.procs[0].send_signal(signal.SIGTERM)
        servers.procs[0].send_signal(signal.SIGTERM)   # a second one while stopping
        servers.stop()
        client.close()
        assert not servers.hung, "a server did not exit on SIGTERM"
        assert not servers.unpublished and not servers.leftovers


@pytest.mark.timeout(60)
def test_silent_connection_is_dropped(tmp_path, transport):
    """A connection that never proves the token is closed after the server's hello_timeout."""
    from eddis.smb import Server, create_run_dir

    run_dir = create_run_dir(tmp_path / "run")
    server = Server(run_dir, memory=1 << 20, host="127.0.0.1", hello_timeout=0.5).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=20) as silent:
            challenge = silent.recv(64)          # the challenge, then nothing until dropped
            assert challenge.startswith(b"EDDIS-SMB/")
            assert silent.recv(64) == b""
        assert server.gate.stats["dropped_silent"] == 1
        with Client(run_dir, expected_servers=1, timeout=10) as client:   # still serving
            assert client.counter("x").fetch_add(1) == 0
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_client_without_servers_times_out(tmp_path, transport):
    from eddis.smb import create_run_dir

    run_dir = create_run_dir(tmp_path / "run")
    os.environ["SMB_CONNECT_TIMEOUT"] = "0.5"
    try:
        with pytest.raises(SMBTimeoutError, match="servers"):
            Client(run_dir, expected_servers=2)
    finally:
        del os.environ["SMB_CONNECT_TIMEOUT"]
    # a published address nobody listens on: a connection error, not a hang
    with pytest.raises(SMBError):
        Client(addresses=["127.0.0.1:1"], token="x", timeout=5)


@pytest.mark.timeout(120)
def test_counter_values_outside_int64_are_refused(transport):
    """Out-of-range operands once raised a bare struct.error (remote) or OverflowError (mapped)."""
    env, hostnames = transport
    with LocalServers(1, memory="4M", env=env, hostnames=hostnames) as servers:
        with Client(servers.run_dir, expected_servers=1, timeout=10) as client:
            counter = client.counter("c", initial=-2**63)
            refused = [lambda: counter.fetch_add(2**63), lambda: counter.fetch_add(-2**63 - 1),
                       lambda: counter.compare_swap(2**63, 0), lambda: counter.compare_swap(0, -2**64),
                       lambda: client.counter("d", initial=2**63)]
            for call in refused:
                with pytest.raises(SMBValueError, match=r"signed 64-bit range -2\*\*63\.\.2\*\*63-1"):
                    call()
            # the edges of the range are taken, and nothing refused reached the counter
            assert counter.read() == -2**63
            assert counter.fetch_add(2**63 - 1) == -2**63
            assert counter.compare_swap(-1, 2**63 - 1) == -1
            assert counter.read() == 2**63 - 1


@pytest.mark.timeout(120)
def test_failed_region_create_leaves_no_region(transport):
    """A region_create that fails after the region was allocated once left it behind: its
    memory was lost, and the next create of that name attached to it (ignoring `initial`)."""
    env, hostnames = transport
    with LocalServers(1, memory="4M", env=env, hostnames=hostnames) as servers:
        with Client(servers.run_dir, expected_servers=1, timeout=10) as client:
            before = client.stats(0)
            counter_request = {"op": "region_create", "name": "counter:c", "slots": 1, "length": 1,
                               "dtype": "int64", "meta": {"kind": "counter"}, "initial": 2**63}
            with pytest.raises(SMBValueError, match="signed 64-bit"):
                client._control(0, counter_request, "crafted counter create")
            # `initial` on a float region: refused by the write after the region exists
            pool_request = {"op": "region_create", "name": "pool:f", "slots": 1, "length": 1024,
                            "dtype": "float32", "meta": {"length": 1024, "dtype": "float32", "slots": 1},
                            "initial": 7}
            with pytest.raises(SMBBoundsError):
                client._control(0, pool_request, "crafted pool create")
            after = client.stats(0)
            assert (after["regions"], after["free_bytes"]) == (before["regions"], before["free_bytes"])
            assert client.counter("c", initial=5).read() == 5
            with pytest.raises(SMBKeyError):
                client.pool("f", 1024, create=False)


@pytest.mark.timeout(120)
def test_freed_pool_handle_raises_usage_error(transport):
    """After free() writes were silent no-ops, reads returned uninitialised memory and a second
    free() succeeded; a handle to a pool that another handle freed gets the server's SMBKeyError."""
    env, hostnames = transport
    with LocalServers(2, memory="8M", env=env, hostnames=hostnames) as servers:
        with Client(servers.run_dir, expected_servers=2, timeout=10) as client:
            pool = client.pool("a", 1000, slots=2)
            other = client.pool("other", 1000, slots=2)
            pool.write(np.ones(1000, np.float32))
            pool.free()
            uses = {
                "write": lambda: pool.write(np.zeros(1000, np.float32)),
                "read": lambda: pool.read(),
                "read into": lambda: pool.read(np.empty(1000, np.float32)),
                "write_nb": lambda: pool.write_nb(np.zeros(10, np.float32)),
                "scale": lambda: pool.scale(0, 2.0),
                "weighted_sum": lambda: pool.weighted_sum(1, [0], [1.0]),
                "as a source": lambda: other.weighted_sum(1, [0], [1.0], src_pool=pool),
                "reduce_nb": lambda: pool.reduce_nb(0, 1.0, 1, 1, generation=0),
                "layout": lambda: pool.layout(),
                "free": lambda: pool.free(),
            }
            if client.is_local(0):
                uses["mapped_views"] = lambda: pool.mapped_views()
            for what, use in uses.items():
                with pytest.raises(UsageError, match="pool 'a' .*was freed"):
                    use()
                    pytest.fail(f"{what} after free() raised nothing")
            assert client.stats(0)["regions"] == 1 and client.stats(1)["regions"] == 1  # 'other' only
            # a second handle of this process, or another client's, learns it from the servers
            with Client(servers.run_dir, expected_servers=2, timeout=10) as second:
                second_handle = second.pool("other", 1000, slots=2, create=False)
                other.free()
                with pytest.raises(SMBKeyError, match="no region named 'pool:other'"):
                    second_handle.free()


CLOSE_RACE = """
import sys, threading, time
import numpy as np
from eddis.errors import UsageError
from eddis.smb import Client

client = Client(sys.argv[1], expected_servers=2, timeout=10)
pool = client.pool("p", 1 << 20, slots=1)
counter = client.counter("k")
data = np.ones(1 << 20, np.float32)
outcomes = {}

def hammer(name, use):
    try:
        for _ in range(200000):
            use()
        outcomes[name] = "never closed"
    except UsageError as exc:
        outcomes[name] = "UsageError" if "closed" in str(exc) else repr(exc)
    except BaseException as exc:
        outcomes[name] = repr(exc)

threads = [threading.Thread(target=hammer, args=(name, use)) for name, use in (
    ("write", lambda: pool.write(data)), ("read", lambda: pool.read()),
    ("fetch_add", lambda: counter.fetch_add(1)))]
for thread in threads:
    thread.start()
time.sleep(0.5)
client.close()
for thread in threads:
    thread.join(30)
after = {}
for name, use in (("write", lambda: pool.write(data)), ("read", lambda: pool.read()),
                  ("fetch_add", lambda: counter.fetch_add(1)), ("free", lambda: pool.free()),
                  ("pool", lambda: client.pool("q", 10)), ("close again", client.close)):
    try:
        use()
        after[name] = "no error"
    except UsageError:
        after[name] = "UsageError"
    except BaseException as exc:
        after[name] = repr(exc)
print(sorted(outcomes.items()), sorted(after.items()))
"""


@pytest.mark.timeout(120)
def test_use_of_a_closed_client_raises_usage_error_never_crashes(transport):
    """A write through a same-node pool after Client.close() segfaulted the process (the arena
    was unmapped under the pool). Threads that keep using the pool and a counter while another
    closes the client, then uses after close: UsageError every time. In a child process, so a
    crash is a failed test, not a dead test run."""
    env, hostnames = transport
    with LocalServers(2, memory="16M", env=env, hostnames=hostnames) as servers:
        proc = subprocess.run([sys.executable, "-c", CLOSE_RACE, str(servers.run_dir)], env=python_env(),
                              capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    names = ["fetch_add", "read", "write"]
    closed = [(name, "UsageError") for name in names]
    later = sorted(closed + [("close again", "no error"), ("free", "UsageError"), ("pool", "UsageError")])
    assert proc.stdout.strip() == f"{closed} {later}", proc.stdout


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_a_server_whose_request_loop_ends_is_the_root_cause_not_a_rank(tmp_path):
    """Issue 44: a thread of the server died, the process lived on, and the job failed
    later with a rank's handshake timeout as its root cause. Here the request loop's poll()
    fails for real: the server's open-files limit is lowered below its connections (the
    loop used to spin on that error, answering nothing). The server must exit naming the
    thread, and the job's report must name the server and quote why it stopped."""
    from eddis.smb.server import SERVER_FAILED_STATUS

    proc = start(tmp_path, "-n", "2", SMB_TRAINER, "--steps", "3000")
    started_ranks(tmp_path, 2)
    server = server_record(tmp_path)
    time.sleep(3)       # into the training: both ranks hold a connection to the server
    hard = resource.prlimit(server["pid"], resource.RLIMIT_NOFILE)[1]
    resource.prlimit(server["pid"], resource.RLIMIT_NOFILE, (2, hard))
    code, out, err, took = finish(proc)
    assert code == SERVER_FAILED_STATUS, err
    assert re.search(r"smb-server: SMBServerError: smb-server 0 stops: its request loop \(thread "
                     r"smb-server-progress\) ended: poll\(\) failed: Invalid argument", err), err
    report = err[err.index("ROOT CAUSE"):]
    assert re.search(rf"ROOT CAUSE: smb-server 0 on host \S+ \(pid {server['pid']}\) exited with code "
                     rf"{SERVER_FAILED_STATUS}", report), report
    # and quotes why: its supervisor keeps the last lines of the server's stderr
    block = report[:report.index("\n  records: ")]
    assert re.search(r"\n  last lines of smb-server 0's stderr:\n(    .*\n)*    smb-server: SMBServerError: "
                     r"smb-server 0 stops: its request loop \(thread smb-server-progress\) ended: poll\(\) failed",
                     block), report
    assert "ROOT CAUSE: rank" not in err
    assert_nothing_left(tmp_path)
