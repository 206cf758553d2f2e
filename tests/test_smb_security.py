"""A peer without the job's token gets nothing from an smb-server, and cannot stop it serving.

Real smb-server processes on loopback; the attacks are what issue 16 tried:
tokenless reads and writes, garbage on the listening port, connections that
hold places and say nothing, a second Unix user. The probes of the gate run with
the socket transport and with rdma on (one-sided UCX, here over shared memory:
this machine has no HCA). Every loop is bounded in count and time.
"""
import os
import pwd
import random
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import python_env
from eddis.errors import SMBKeyError, SMBPermissionError
from eddis.smb import Client, _core, handshake, protocol
from eddis.smb.testing import LocalServers

PATTERN = np.frombuffer(b"EDDIS-SECRET-PARAMETERS!" * 4096, dtype=np.float32).copy()


def _server_alive(servers):
    return all(proc.poll() is None for proc in servers.procs)


def _read_all(sock, limit=1 << 20, timeout=2.0):
    sock.settimeout(timeout)
    data = b""
    try:
        while len(data) < limit:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return data


def _secret_pool(servers):
    client = Client(servers.run_dir, expected_servers=len(servers.records), timeout=10)
    pool = client.pool("weights", PATTERN.size)
    pool.write(PATTERN)
    return client, pool


def _frame(op, payload, req_id=1):
    return protocol.HEADER.pack(protocol.MAGIC, op, 0, len(payload), 0, req_id) + payload


@pytest.fixture(params=["socket", "rdma"])
def kind(request, monkeypatch):
    """The transport the servers offer and the clients use (SMB_LOCAL_MAP=0: no mapping)."""
    monkeypatch.setenv("SMB_TRANSPORT", request.param)
    monkeypatch.setenv("SMB_LOCAL_MAP", "0")
    return request.param


@pytest.mark.timeout(120)
def test_tokenless_get_and_put_get_nothing_and_the_server_keeps_serving(kind):
    with LocalServers(1, memory="16M", env={"SMB_LOCAL_MAP": "0", "SMB_TRANSPORT": kind}) as servers:
        client, pool = _secret_pool(servers)
        assert client.transport == kind
        seg = pool.segments[0]
        port = servers.records[0]["port"]
        get = _frame(_core.OP_GET, protocol.GET_DESC.pack(seg.rid, 0, 0, PATTERN.nbytes))
        put = _frame(_core.OP_PUT, protocol.PUT_DESC.pack(seg.rid, 0, 0) + b"\0" * 4096)
        tiny = _frame(_core.OP_GET, protocol.GET_DESC.pack(0, 0, 16, 4096))  # "a get at a small address"
        answers = []
        for attack in (get, put, tiny, get + put + tiny):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(attack)
                answers.append(_read_all(s))
        # each attacker saw the challenge and at most the refusal: not one byte of the pool
        secret = PATTERN.tobytes()[:64]
        for answer in answers:
            assert secret not in answer
            assert answer.startswith(handshake.PROTOCOL)
            assert len(answer) <= handshake.CHALLENGE_BYTES + 3 + len(handshake.REFUSAL_TEXT)
        # the pool is unchanged and the server serves on
        np.testing.assert_array_equal(pool.read(), PATTERN)
        stats = client.stats(0)
        gate = stats["handshake"]
        assert gate["proven"] == 1 and gate["refused"] + gate["left_unproven"] == 4
        assert _server_alive(servers)
        client.close()


def _listening_ports(pid):
    """The TCP ports process ``pid`` listens on (its sockets in state LISTEN)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:   # 0A: TCP_LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.timeout(120)
def test_an_rdma_server_listens_on_its_gate_alone():
    """The attack of issue 16 was a UCX client doing one-sided gets without HELLO through
    UCX's own listener. The rdma transport has none: UCX is reached only at the worker
    address a proven peer is given, over shared memory or an HCA. Only the test setting
    SMB_UCX_ALLOW_TCP=1 opens a port of UCX's (its tcp transport's), which is why it is
    unsafe."""
    for env, expected_extra in (({"SMB_TRANSPORT": "rdma"}, False),
                                ({"SMB_TRANSPORT": "rdma", "SMB_UCX_ALLOW_TCP": "1", "UCX_TLS": "tcp"}, True)):
        with LocalServers(1, memory="16M", env=dict(env, SMB_LOCAL_MAP="0")) as servers:
            record = servers.records[0]
            assert record["transport"] == "rdma"
            ports = _listening_ports(servers.procs[0].pid)
            assert record["port"] in ports
            assert (ports != {record["port"]}) == expected_extra, (env, ports)
            errors = servers.stop()
        assert ("UNSAFE" in errors[0]) == expected_extra, errors[0]


@pytest.mark.timeout(120)
def test_an_unproven_peer_gets_no_worker_address_and_no_key(monkeypatch):
    """What only a proven connection is given: the server's UCX worker address and a
    region's key. A peer that skips the proof (or proves another job's token) and asks for
    them gets the challenge and at most the refusal; a client of another job is refused by
    name and never reaches the request loop."""
    monkeypatch.setenv("SMB_TRANSPORT", "rdma")
    monkeypatch.setenv("SMB_LOCAL_MAP", "0")
    with LocalServers(1, memory="16M", env={"SMB_TRANSPORT": "rdma", "SMB_LOCAL_MAP": "0"}) as servers:
        client, pool = _secret_pool(servers)
        assert client.transport == "rdma"
        rid = pool.segments[0].rid
        port = servers.records[0]["port"]
        address = client._control(0, {"op": "rdma_address"}, "address")[1]
        key = client._control(0, {"op": "region_key", "id": rid}, "key")[1]
        assert len(address) > 16 and len(key) > 0
        asks = [_frame(_core.OP_CONTROL, protocol.encode_control({"op": "rdma_address"})),
                _frame(_core.OP_CONTROL, protocol.encode_control({"op": "region_key", "id": rid}))]
        answers = []
        for attack in asks + [b"\0" * handshake.ANSWER_BYTES + asks[0] + asks[1]]:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(attack)
                answers.append(_read_all(s))
        for answer in answers:
            assert answer.startswith(handshake.PROTOCOL)
            assert len(answer) <= handshake.CHALLENGE_BYTES + 3 + len(handshake.REFUSAL_TEXT)
            assert address[:32] not in answer and key not in answer
        with pytest.raises(SMBPermissionError, match="wrong job token"):
            Client(addresses=[f"127.0.0.1:{port}"], token="another-jobs-token", timeout=10)
        stats = client.stats(0)
        assert stats["keys_given"] == 2 and stats["handshake"]["proven"] == 1
        np.testing.assert_array_equal(pool.read(), PATTERN)
        client.close()


@pytest.mark.timeout(120)
def test_the_key_of_a_freed_region_is_refused_and_unmapped(monkeypatch):
    """A freed region's id gets no key (another job's region id is no better: ids name this
    server's regions only), and its UCX registration is gone with it: the server holds one
    registration per live region."""
    monkeypatch.setenv("SMB_TRANSPORT", "rdma")
    monkeypatch.setenv("SMB_LOCAL_MAP", "0")
    with LocalServers(1, memory="16M", env={"SMB_TRANSPORT": "rdma", "SMB_LOCAL_MAP": "0"}) as servers:
        with Client(servers.run_dir, expected_servers=1, timeout=10) as client:
            pool = client.pool("gone", 1000)
            rid = pool.segments[0].rid
            pool.free()
            with pytest.raises(SMBKeyError, match="freed"):
                client._control(0, {"op": "region_key", "id": rid}, "key")
            again = client.pool("gone", 1000)     # the same slot, the next generation
            assert again.segments[0].rid & 0xFFFF == rid & 0xFFFF and again.segments[0].rid != rid
            with pytest.raises(SMBKeyError, match="freed"):
                client._control(0, {"op": "region_key", "id": rid}, "key")
            assert client.stats(0)["registrations"] == 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bounded_fuzz_of_the_listening_port_leaves_the_server_serving(kind):
    rng = random.Random(16)
    connections, budget_s = 2000, 120
    env = {"SMB_LOCAL_MAP": "0", "SMB_HANDSHAKE_TIMEOUT": "2", "SMB_TRANSPORT": kind}
    with LocalServers(1, memory="16M", env=env) as servers:
        client, pool = _secret_pool(servers)
        assert client.transport == kind
        port = servers.records[0]["port"]
        started, sent, leaked = time.monotonic(), 0, 0
        secret = PATTERN.tobytes()[:64]
        for i in range(connections):
            if time.monotonic() - started > budget_s:
                break
            kind = rng.choice(("random", "0xff", "zeros", "frames", "answer-then-frames"))
            if kind == "random":
                data = rng.randbytes(rng.randint(0, 8192))
            elif kind == "0xff":
                data = b"\xff" * rng.choice((1, 16, 64, 4096))
            elif kind == "zeros":
                data = b"\0" * rng.choice((16, 4096))
            elif kind == "frames":
                data = b"".join(_frame(rng.randint(0, 8), rng.randbytes(rng.randint(0, 64)))
                                for _ in range(rng.randint(1, 8)))
            else:
                data = rng.randbytes(handshake.ANSWER_BYTES) + _frame(_core.OP_GET, rng.randbytes(24))
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    if rng.random() < 0.5:
                        s.settimeout(1)
                        s.recv(handshake.CHALLENGE_BYTES)
                    s.sendall(data)
                    if rng.random() < 0.2:
                        leaked += secret in _read_all(s, timeout=0.2)
                    sent += 1
            except OSError:
                pass       # the server may drop a garbage peer mid-send: that is the point
        elapsed = time.monotonic() - started
        print(f"fuzz: {sent} connections in {elapsed:.1f} s, server alive: {_server_alive(servers)}")
        assert sent >= 1000, f"only {sent} fuzz connections went through in {budget_s} s"
        assert leaked == 0
        assert _server_alive(servers)
        np.testing.assert_array_equal(pool.read(), PATTERN)
        with Client(servers.run_dir, expected_servers=1, timeout=10) as fresh:
            assert fresh.counter("after-fuzz").fetch_add(1) == 0
        stats = client.stats(0)["handshake"]
        assert stats["proven"] == 2
        assert stats["accepted"] >= sent
        client.close()


@pytest.mark.timeout(120)
def test_unproven_connections_cannot_lock_out_the_jobs_clients():
    hold = handshake.DEFAULT_MAX_PENDING + 100
    with LocalServers(1, memory="16M", env={"SMB_LOCAL_MAP": "0", "SMB_HANDSHAKE_TIMEOUT": "60"}) as servers:
        port = servers.records[0]["port"]
        silent = []
        try:
            for _ in range(hold):
                silent.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            time.sleep(0.5)
            # the job's own client gets in at once, while hundreds of silent peers wait
            with Client(servers.run_dir, expected_servers=1, timeout=10) as client:
                assert client.counter("in").fetch_add(1) == 0
                stats = client.stats(0)["handshake"]
            assert stats["dropped_crowded"] >= hold - handshake.DEFAULT_MAX_PENDING
        finally:
            for s in silent:
                s.close()
        assert _server_alive(servers)


@pytest.mark.timeout(60)
def test_a_client_with_another_token_is_refused_by_name():
    with LocalServers(1, memory="8M") as servers:
        port = servers.records[0]["port"]
        with pytest.raises(SMBPermissionError, match="wrong job token"):
            Client(addresses=[f"127.0.0.1:{port}"], token="another-jobs-token", timeout=10)


def _other_user():
    for name in ("nobody", "daemon"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    return None


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second Unix user")
def test_a_second_unix_user_cannot_read_the_token_the_addresses_or_the_memory():
    other = _other_user()
    assert other is not None, "this machine has neither user nobody nor daemon"
    # an interpreter every user may run (root's own Python may sit under /root)
    python = "/usr/bin/python3"
    assert os.access(python, os.X_OK), "the second-user probe needs /usr/bin/python3 (apt python3)"
    with LocalServers(1, memory="8M") as servers:
        record = servers.records[0]
        client = Client(servers.run_dir, expected_servers=1, timeout=10)
        arena = client.servers[0]["arena"]
        token = servers.run_dir / "token"
        address = next((servers.run_dir / "servers").iterdir())
        probe = (
            "import sys, socket\n"
            "out = []\n"
            "for path in sys.argv[1:4]:\n"
            "    try:\n"
            "        open(path, 'rb').read(1); out.append('read')\n"
            "    except OSError as e:\n"
            "        out.append(type(e).__name__)\n"
            "s = socket.create_connection(('127.0.0.1', int(sys.argv[4])), timeout=5)\n"
            "s.recv(44); s.sendall(b'x' * 64); s.settimeout(3)\n"
            "reply = s.recv(4096)\n"
            "out.append('refused' if reply[:1] == b'\\x01' else 'answered:%r' % reply[:8])\n"
            "print(' '.join(out))\n")
        result = subprocess.run(
            ["setpriv", f"--reuid={other.pw_uid}", f"--regid={other.pw_gid}", "--clear-groups",
             python, "-c", probe, str(token), str(address), arena, str(record["port"])],
            capture_output=True, text=True, timeout=60, cwd="/")
        client.close()
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["PermissionError"] * 3 + ["refused"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local_map, kind", [("0", "socket"), ("0", "rdma"), ("1", "socket")],
                         ids=["remote", "rdma", "same-node"])
def test_a_stale_handle_never_writes_into_the_pool_created_after_it(local_map, kind, monkeypatch):
    """rdma: the client reads the region's generation one-sidedly before a write and after
    a read (on an HCA the unmapped key would fault as well; no HCA here)."""
    monkeypatch.setenv("SMB_LOCAL_MAP", local_map)
    monkeypatch.setenv("SMB_TRANSPORT", kind)
    with LocalServers(1, memory="16M", env={"SMB_LOCAL_MAP": local_map, "SMB_TRANSPORT": kind}) as servers:
        first = Client(servers.run_dir, expected_servers=1, timeout=10)
        second = Client(servers.run_dir, expected_servers=1, timeout=10)
        stale = second.pool("a", 1000)
        first.pool("a", 1000).free()
        fresh = first.pool("b", 1000)
        fresh.write(np.full(1000, 7, np.float32))
        with pytest.raises(SMBKeyError, match="freed"):
            stale.write(np.ones(1000, np.float32))
        with pytest.raises(SMBKeyError, match="freed"):
            stale.read()
        np.testing.assert_array_equal(fresh.read(), np.full(1000, 7, np.float32))
        first.close()
        second.close()


@pytest.mark.timeout(180)
def test_a_finished_local_run_leaves_no_token_behind(tmp_path):
    run_dir = tmp_path / "run"
    script = tmp_path / "train.py"
    script.write_text("import sys; print('trained'); sys.exit(0)\n")
    result = subprocess.run([sys.executable, "-m", "eddis.launch.train", "--local", "-n", "1", str(script)],
                            env=python_env({"EDDIS_RUN_DIR": str(run_dir), "SMB_MEMORY": "8M"}),
                            capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained" in result.stdout + result.stderr and (run_dir / "launch").is_dir()   # it ran here
    assert not (run_dir / "token").exists()
    assert not list(run_dir.glob("servers/*.json"))


@pytest.mark.timeout(60)
def test_an_rdma_server_allowed_tcp_restricts_ucx_to_its_address_and_says_unsafe(tmp_path, monkeypatch):
    from eddis.smb import Server, create_run_dir
    from eddis.smb.server import interface_of

    assert interface_of("127.0.0.1") == "lo" and interface_of("0.0.0.0") is None
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.setenv("SMB_UCX_ALLOW_TCP", "1")
    monkeypatch.setenv("UCX_TLS", "tcp")
    run_dir = create_run_dir(tmp_path / "run")
    server = Server(run_dir, memory=1 << 20, host="127.0.0.1", transport="rdma").start()
    try:
        # UCX's own TCP ports follow its devices, so they listen on lo only, like the gate
        assert os.environ["UCX_NET_DEVICES"] == "lo"
        assert server.info["host"] == "127.0.0.1" and server.info["transport"] == "rdma"
        assert server.info["ucx_tls"] == "tcp" and "UNSAFE" in server.describe_transport()
    finally:
        server.stop()
        os.environ.pop("UCX_NET_DEVICES", None)


def _still_open(sockets):
    """The sockets the server has not closed: their challenge is read, no EOF follows."""
    open_ones = []
    for s in sockets:
        s.setblocking(False)
        closed = False
        try:
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    closed = True
                    break
        except BlockingIOError:
            pass
        except ConnectionResetError:
            closed = True
        if closed:
            s.close()
        else:
            open_ones.append(s)
    return open_ones


@pytest.mark.timeout(180)
def test_crowding_out_a_peer_whose_byte_is_in_the_same_batch_leaves_the_gate_serving():
    """Issue 44: 256 silent peers, then 64 new ones and one byte on the oldest. The accept
    of the new ones drops the oldest while its read event is still in the same select
    batch; the gate's thread died of the KeyError, and no client could connect any more.
    The server is stopped (SIGSTOP) while the round is set up, so that the listener's
    event and the oldest's byte always reach the gate in one batch, in that order."""
    rounds, crowd = 5, 64
    env = {"SMB_LOCAL_MAP": "0", "SMB_HANDSHAKE_TIMEOUT": "120"}
    with LocalServers(1, memory="16M", env=env) as servers:
        port, proc = servers.records[0]["port"], servers.procs[0]
        held = []
        try:
            for _ in range(handshake.DEFAULT_MAX_PENDING):
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            with Client(servers.run_dir, expected_servers=1, timeout=10) as watcher:
                for done in range(rounds):
                    held = _still_open(held)
                    oldest = held[0]
                    proc.send_signal(signal.SIGSTOP)
                    try:
                        held += [socket.create_connection(("127.0.0.1", port), timeout=5)
                                 for _ in range(crowd)]
                        oldest.sendall(b"x")
                    finally:
                        proc.send_signal(signal.SIGCONT)
                    # the job's own client gets in, and is served, every round
                    with Client(servers.run_dir, expected_servers=1, timeout=10) as client:
                        assert client.counter("rounds").fetch_add(1) == done
                    assert _server_alive(servers)
                held = _still_open(held)
                gate = watcher.stats(0)["handshake"]
            dropped = handshake.DEFAULT_MAX_PENDING + rounds * crowd - len(held)
            assert dropped >= rounds * crowd - rounds     # the oldest of every round among them
            assert gate["dropped_crowded"] == dropped and gate["dropped_silent"] == 0
            assert gate["dropped_failed"] == 0            # no peer's trouble was caught either
            assert gate["proven"] == rounds + 1
        finally:
            for s in held:
                s.close()
        with Client(servers.run_dir, expected_servers=1, timeout=10) as last:
            assert last.counter("rounds").read() == rounds
        assert _server_alive(servers)


@pytest.mark.timeout(60)
def test_a_gate_whose_thread_ends_is_named_by_the_server(tmp_path):
    """Should the gate's thread end after all (here its select() fails: the epoll descriptor
    is replaced under it, as a stray close elsewhere in the process would), the server says
    which thread and why; smb-server exits on it (test_smb_failures: the job's report)."""
    from eddis.smb import Server, create_run_dir

    server = Server(create_run_dir(tmp_path / "run"), memory=1 << 20, host="127.0.0.1",
                    transport="socket").start()
    try:
        assert server.failure() is None
        with open(os.devnull, "rb") as null:
            os.dup2(null.fileno(), server.gate._selector.fileno())
        deadline = time.monotonic() + 10
        while server.failure() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert re.match(r"its handshake thread \(smb-server-gate\) died: select\(\) failed: .*; no new "
                        r"client could connect", server.failure() or ""), server.failure()
    finally:
        server.stop()
    assert server.failure() is None   # stopped as asked: nothing to name


@pytest.mark.timeout(60)
def test_a_server_out_of_descriptors_lets_new_peers_wait_and_serves_them_later():
    """accept() failing (EMFILE) used to leave the listener readable and the gate spinning
    on it, a warning per turn; now the listener rests between tries and warns once."""
    import resource

    hold = 2.0
    with LocalServers(1, memory="8M", env={"SMB_LOCAL_MAP": "0"}) as servers:
        pid, port = servers.procs[0].pid, servers.records[0]["port"]
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        highest = max(int(fd) for fd in os.listdir(f"/proc/{pid}/fd"))
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (highest, hard))   # no descriptor left to accept
        try:
            waiting = socket.create_connection(("127.0.0.1", port), timeout=5)
            time.sleep(hold)
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        with Client(servers.run_dir, expected_servers=1, timeout=10) as client:
            assert client.counter("after").fetch_add(1) == 0
            gate = client.stats(0)["handshake"]
        # the peer that waited got its challenge once the limit was back
        waiting.settimeout(5)
        assert waiting.recv(handshake.CHALLENGE_BYTES).startswith(handshake.PROTOCOL)
        waiting.close()
        assert 1 <= gate["accept_failed"] <= hold / handshake.ACCEPT_PAUSE + 2
        assert _server_alive(servers)
        err = servers.stop()[0]
    assert err.count("accept failed") == 1, err
