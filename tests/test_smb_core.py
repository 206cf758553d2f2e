"""SMB core against real smb-server processes, over both transports.

Every test runs four times: with ``SMB_LOCAL_MAP=0`` and distinct fake node names
(standing in for separate nodes) over the proven sockets (``socket``) and over
one-sided UCX (``rdma``: here UCX's shared memory and CMA, this machine having no
HCA; and UCX's tcp with the test-only ``SMB_UCX_ALLOW_TCP=1``), and on the
same-node path (the clients map the servers' shared memory).
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import python_env

from eddis.errors import SMBBoundsError, SMBKeyError, SMBValueError
from eddis.smb import Client, _core
from eddis.smb.pool import numpy_dtype
from eddis.smb.testing import LocalServers

TRANSPORTS = {
    "socket": {"env": {"SMB_TRANSPORT": "socket", "SMB_LOCAL_MAP": "0"},
               "hostnames": ["smb-node0", "smb-node1", "smb-node2"], "client_host": "client-node"},
    "rdma-shm": {"env": {"SMB_TRANSPORT": "rdma", "SMB_LOCAL_MAP": "0"},
                 "hostnames": ["smb-node0", "smb-node1", "smb-node2"], "client_host": "client-node"},
    "rdma-tcp": {"env": {"SMB_TRANSPORT": "rdma", "SMB_UCX_ALLOW_TCP": "1", "UCX_TLS": "tcp",
                         "SMB_LOCAL_MAP": "0"},
                 "hostnames": ["smb-node0", "smb-node1", "smb-node2"], "client_host": "client-node"},
    "same-node": {"env": {"SMB_LOCAL_MAP": "1"}, "hostnames": None, "client_host": None},
}


@pytest.fixture(params=list(TRANSPORTS), scope="module")
def cluster(request):
    spec = TRANSPORTS[request.param]
    with LocalServers(3, memory="64M", env=spec["env"], hostnames=spec["hostnames"]) as servers:
        servers.transport = request.param
        servers.client_env = dict(spec["env"])
        if spec["client_host"]:
            servers.client_env["EDDIS_HOSTNAME"] = spec["client_host"]
        yield servers
    assert not servers.leftovers, f"servers left shared memory behind: {servers.leftovers}"
    assert not servers.hung, f"servers {servers.hung} did not exit on SIGTERM"
    assert not servers.unpublished, f"servers {servers.unpublished} left their address file"


@pytest.fixture
def client(cluster, monkeypatch):
    for key, value in cluster.client_env.items():
        monkeypatch.setenv(key, value)
    if "EDDIS_HOSTNAME" not in cluster.client_env:
        monkeypatch.delenv("EDDIS_HOSTNAME", raising=False)
    with Client(cluster.run_dir, expected_servers=3, timeout=20) as c:
        local = [c.is_local(i) for i in range(c.num_servers)]
        assert local == [cluster.transport == "same-node"] * 3
        assert c.transport == ("rdma" if cluster.transport.startswith("rdma") else "socket")
        yield c


def run_clients(cluster, n, code, args, timeout=90):
    """Run n client processes concurrently; each prints one JSON line."""
    env = python_env(cluster.client_env)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(cluster.run_dir), str(i), str(n), *args],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("client process timed out")
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.timeout(120)
def test_pool_write_read_across_servers(client):
    pool = client.pool("rw", 1001, dtype="float32", slots=3)
    data = np.arange(1001, dtype=np.float32)
    pool.write(data, slot=1)
    np.testing.assert_array_equal(pool.read(slot=1), data)
    # pieces that straddle server boundaries (1001 columns over 3 servers: 333/334/334)
    pool.write(np.full(400, -1, np.float32), slot=1, start=300)
    got = pool.read(slot=1)
    want = data.copy()
    want[300:700] = -1
    np.testing.assert_array_equal(got, want)
    out = np.zeros(10, np.float32)
    assert pool.read(out, slot=1, start=695) is out
    np.testing.assert_array_equal(out, want[695:705])
    # other slots untouched, zero-initialized
    np.testing.assert_array_equal(pool.read(slot=0), np.zeros(1001, np.float32))
    # non-blocking: several transfers in flight at once
    reqs = [pool.write_nb(np.full(1001, s + 10, np.float32), slot=s) for s in range(3)]
    for r in reqs:
        r.wait()
    outs = [np.empty(1001, np.float32) for _ in range(3)]
    reads = [pool.read_nb(outs[s], slot=s) for s in range(3)]
    for s, r in enumerate(reads):
        assert r.wait() is outs[s]
        np.testing.assert_array_equal(outs[s], np.full(1001, s + 10, np.float32))
    # attach by name from a second client sees the same data
    same = client.pool("rw", 1001, dtype="float32", slots=3, create=False)
    np.testing.assert_array_equal(same.read(slot=2), np.full(1001, 12, np.float32))
    with pytest.raises(SMBValueError):
        client.pool("rw", 1000, dtype="float32", slots=3)
    pool.free()
    with pytest.raises(SMBKeyError):
        client.pool("rw", 1001, dtype="float32", slots=3, create=False)
    # a new pool in the freed memory starts zeroed
    again = client.pool("rw-again", 1001, dtype="float32", slots=3)
    np.testing.assert_array_equal(again.read(slot=2), np.zeros(1001, np.float32))
    again.free()


@pytest.mark.timeout(120)
def test_put_and_get_bytes_pass_the_servers_request_loop_only_on_the_socket_transport(client, cluster):
    """One-sidedness: with rdma (and on the same node) the servers' request loops see no byte
    and no request of a put or get, however large; on the socket transport they receive and
    send every byte, in requests of a MiB (so that a request queued behind a large transfer
    waits for one of them, not for all). (UCX 1.13.1 has no RMA lane into memory it
    did not allocate over shared memory or tcp: it emulates these puts and gets in software in
    the server's UCX worker, UCX_PROTO_INFO says. Only on an HCA does no CPU of the server
    touch them; bench/smb_bandwidth.py measures the server's CPU per GB.)"""
    for per_server in (1 << 10, 1 << 18, 1 << 20):       # 4 KiB, 1 MiB and 4 MiB of float32 per server
        pool = client.pool(f"one-sided-{per_server}", 3 * per_server, dtype="float32")
        try:
            data = np.arange(3 * per_server, dtype=np.float32)
            before = [client.stats(s) for s in range(3)]
            pool.write(data)
            np.testing.assert_array_equal(pool.read(), data)
            after = [client.stats(s) for s in range(3)]
        finally:
            pool.free()
        moved = [(a["put_bytes"] - b["put_bytes"], a["get_bytes"] - b["get_bytes"],
                  a["requests"] - b["requests"]) for b, a in zip(before, after)]
        if cluster.transport == "socket":   # the put's and the get's pieces, the second stats request
            pieces = -(-4 * per_server // _core.SOCK_PIECE_BYTES)
            assert moved == [(4 * per_server, 4 * per_server, 2 * pieces + 1)] * 3, moved
        else:   # only the second stats request itself
            assert moved == [(0, 0, 1)] * 3, moved


@pytest.mark.timeout(120)
def test_a_request_overtakes_queued_puts_but_not_one_that_started(monkeypatch):
    """On the socket transport a get (or any request) posted behind large puts goes out after
    the piece on the wire, not after every byte queued: the read is answered while the second
    write's bytes are still on their way, and both writes land whole."""
    env = {"SMB_TRANSPORT": "socket", "SMB_LOCAL_MAP": "0"}
    with LocalServers(1, memory="160M", env=env, hostnames=["smb-node0"]) as servers:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("EDDIS_HOSTNAME", "client-node")
        with Client(servers.run_dir, expected_servers=1, timeout=30) as c:
            count = 16 * _core.SOCK_PIECE_BYTES // 4        # 16 pieces a write
            big = c.pool("queued-puts", count, dtype="float32", slots=2)
            small = c.pool("queued-get", 1024, dtype="float32")
            small.write(np.arange(1024, dtype=np.float32))
            first = np.full(count, 1, np.float32)
            second = np.full(count, 2, np.float32)
            writes = [big.write_nb(first, slot=0), big.write_nb(second, slot=1)]
            read = small.read_nb()
            np.testing.assert_array_equal(read.wait(), np.arange(1024, dtype=np.float32))
            assert not writes[1].done(), "the read waited behind the whole second write"
            for request in writes:
                request.wait()
            np.testing.assert_array_equal(big.read(slot=0), first)
            np.testing.assert_array_equal(big.read(slot=1), second)


@pytest.mark.timeout(60)
def test_a_gpu_buffer_is_refused_without_gpudirect(client):
    """SMB_GPU_DIRECT is off (and this machine has no CUDA transport): a buffer in GPU memory
    is refused before anything moves, naming the setting and the way out."""
    from test_smb_buffers import CudaInterface

    pool = client.pool("gpu", 100)
    try:
        assert not client.gpu_direct
        for attempt in (lambda: pool.write(CudaInterface("<f4", (100,))),
                        lambda: pool.read(CudaInterface("<f4", (100,)))):
            with pytest.raises(SMBValueError, match="SMB_GPU_DIRECT=1 on the rdma transport"):
                attempt()
    finally:
        pool.free()


@pytest.mark.timeout(120)
def test_pool_mapped_views_are_the_servers_memory(client, cluster):
    pool = client.pool("mapped", 1000, dtype="float32", slots=2)
    try:
        if cluster.transport != "same-node":
            with pytest.raises(SMBValueError, match="not mapped into this process"):
                pool.mapped_views(1, 300, 500)
            return
        views = pool.mapped_views(1, 300, 500)
        assert [v.size for v in views] == [33, 333, 134]  # 3 servers hold columns 0/333/666 on
        data = np.arange(500, dtype=np.float32)
        pool.write(data, slot=1, start=300)
        assert np.array_equal(np.concatenate(views), data)
        views[1][:] = -1  # writing a view writes the pool
        expected = data.copy()
        expected[33:366] = -1
        assert np.array_equal(pool.read(slot=1, start=300, count=500), expected)
        with pytest.raises(SMBBoundsError):
            pool.mapped_views(2, 0, 1)
    finally:
        pool.free()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float64", "int64", "uint8", "float16", "bfloat16"])
def test_pool_dtypes_and_buffers(client, dtype):
    import torch

    import eddis.torch  # noqa: F401  (registers the converter for bfloat16 tensors)

    n = 777
    pool = client.pool("dt-" + dtype, n, dtype=dtype, slots=2)
    np_dtype = numpy_dtype(dtype)
    data = (np.arange(n) % 100).astype(np_dtype)
    pool.write(data, slot=1)
    np.testing.assert_array_equal(pool.read(slot=1).view(np.uint8), data.view(np.uint8))
    # a memoryview and a torch tensor, written and read without copies
    head = data[:50] if dtype != "bfloat16" else data[:50].view(np.uint16)  # no PEP 3118 code for bf16
    pool.write(memoryview(head), slot=0, start=10)
    tdtype = {"float64": torch.float64, "int64": torch.int64, "uint8": torch.uint8,
              "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    tensor = torch.zeros(50, dtype=tdtype)
    pool.read(tensor, slot=0, start=10)
    assert torch.equal(tensor, torch.arange(50).to(tdtype))
    with pytest.raises(SMBValueError):
        pool.write(np.zeros(5, np.float32 if dtype != "float32" else np.float64))
    with pytest.raises(SMBBoundsError):
        pool.write(data, slot=0, start=1)
    with pytest.raises(SMBBoundsError):
        pool.read(slot=2)
    pool.free()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_vector_ops_against_numpy(client, dtype):
    n = 1000
    rng = np.random.default_rng(1)
    pool = client.pool("vec-" + dtype, n, dtype=dtype, slots=5)
    grads = client.pool("grad-" + dtype, n, dtype="float32", slots=2)
    np_dtype = numpy_dtype(dtype)
    rows = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    for s, row in enumerate(rows):
        pool.write(row.astype(np_dtype), slot=s)
    stored = [pool.read(slot=s).astype(np.float32) for s in range(4)]
    tol = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]

    def check(slot, want):
        got = pool.read(slot=slot).astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 4)

    weights = [0.5, -1.25, 2.0, 0.125]
    pool.weighted_sum(4, [0, 1, 2, 3], weights)
    check(4, sum(w * r for w, r in zip(weights, stored)))
    # a sub-range only: the rest of slot 4 keeps its value
    pool.weighted_sum(4, [0], [3.0], start=100, count=500)
    want = sum(w * r for w, r in zip(weights, stored))
    want[100:600] = 3.0 * stored[0][100:600]
    check(4, want)
    pool.axpy(0, 1, 0.5)
    check(0, stored[0] + 0.5 * stored[1])
    pool.scale(1, -2.0)
    check(1, -2.0 * stored[1])
    pool.copy(2, 3)
    check(2, stored[3])
    # mixed dtypes: a float32 pool as source of a conversion and an axpy
    g = rng.standard_normal(n).astype(np.float32)
    grads.write(g, slot=1)
    pool.copy(3, 1, src_pool=grads)
    check(3, g)
    pool.axpy(3, 1, 1.0, x_pool=grads)
    check(3, 2 * g)
    # the most sources one request takes, then one too many
    now = [pool.read(slot=s).astype(np.float32) for s in (0, 1)]
    pool.weighted_sum(4, [0, 1] * 512, [0.001, 0.002] * 512)
    got = pool.read(slot=4).astype(np.float32)  # 1024 fp32 additions: looser bound
    np.testing.assert_allclose(got, 0.512 * now[0] + 1.024 * now[1], rtol=max(tol, 2e-4), atol=max(tol, 2e-4))
    with pytest.raises(SMBValueError):
        pool.weighted_sum(4, [0] * 1025, [1.0] * 1025)
    with pytest.raises(SMBValueError):
        pool.weighted_sum(4, [0, 1], [1.0])
    with pytest.raises(SMBBoundsError):
        pool.axpy(0, 9, 1.0)
    pool.free()
    grads.free()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_adasum_segment_ops_against_numpy(client, dtype):
    """dot_norms and pair_sum per segment; the segments cross the servers' column
    boundaries (1000 columns on 3 servers), so the client adds up partial dot products."""
    n = 1000
    rng = np.random.default_rng(5)
    pool = client.pool("ada-" + dtype, n, dtype=dtype, slots=2)
    tree = client.pool("ada-tree-" + dtype, n, dtype="float32", slots=2)
    np_dtype = numpy_dtype(dtype)
    for s in range(2):
        pool.write((rng.standard_normal(n) + s).astype(np.float32).astype(np_dtype), slot=s)
    a, b = (pool.read(slot=s).astype(np.float64) for s in range(2))
    segments = [(0, 10), (10, 320), (330, 1), (331, 400), (731, 269)]
    dots = pool.dot_norms(0, 1, segments)
    want = np.array([[a[s:s + c] @ b[s:s + c], a[s:s + c] @ a[s:s + c], b[s:s + c] @ b[s:s + c]]
                     for s, c in segments])
    # float32 products: the error is relative to |a||b|, not to a dot that cancels
    scale = np.sqrt(want[:, 1] * want[:, 2])[:, None]
    assert np.all(np.abs(dots - want) <= 1e-6 * (np.abs(want) + scale)), (dots, want)
    # a dot of a slot with itself, across two pools (a float32 one) and an empty segment list
    tree.write(np.ones(n, np.float32), slot=1)
    np.testing.assert_allclose(tree.dot_norms(1, 0, [(0, n)], b_pool=pool)[0],
                               [a.sum(), n, a @ a], rtol=1e-6)
    assert pool.dot_norms(0, 1, []).shape == (0, 3)
    weights = [(1.0, 1.0), (0.5, -2.0), (3.0, 0.0), (1.0, 0.25), (-1.0, 1.0)]
    tree.pair_sum(0, 0, 1, segments, weights, a_pool=pool, b_pool=pool)
    expect = np.concatenate([wa * a[s:s + c] + wb * b[s:s + c] for (s, c), (wa, wb) in zip(segments, weights)])
    np.testing.assert_allclose(tree.read(slot=0), expect, rtol=1e-6, atol=1e-6)
    # in place: a source is the destination
    before = tree.read(slot=0).astype(np.float64)
    tree.pair_sum(0, 0, 1, [(0, n)], [(2.0, 1.0)])
    np.testing.assert_allclose(tree.read(slot=0), 2 * before + 1.0, rtol=1e-6, atol=1e-6)
    with pytest.raises(SMBBoundsError):
        pool.dot_norms(0, 1, [(990, 20)])
    with pytest.raises(SMBBoundsError):
        tree.pair_sum(0, 0, 5, [(0, 10)], [(1.0, 1.0)])
    with pytest.raises(SMBValueError, match="one \\(w_a, w_b\\) per segment"):
        tree.pair_sum(0, 0, 1, [(0, 10)], [])
    pool.free()
    tree.free()


@pytest.mark.timeout(120)
def test_counter_barrier_event_single(client):
    counter = client.counter("single", initial=40)
    assert counter.read() == 40
    assert counter.fetch_add(2) == 40
    assert counter.fetch_add(-1) == 42
    assert counter.compare_swap(0, 5) == 41       # no swap
    assert counter.compare_swap(41, 5) == 41      # swap
    assert counter.read() == 5
    assert client.counter("single", initial=999).read() == 5   # attach keeps the value
    barrier = client.barrier("solo", 1)
    assert [barrier.wait() for _ in range(3)] == [0, 1, 2]
    event = client.event("single")
    assert event.version() == 0
    assert event.notify() == 1
    assert event.wait(1) == 1
    with pytest.raises(TimeoutError):
        event.wait(2, timeout=0.3)
    assert event.notify() == 2


@pytest.mark.timeout(120)
def test_fetch_add_nb_posts_many_adds_before_any_answer(client):
    counter = client.counter("announced", initial=7, server=1)
    requests = [counter.fetch_add_nb(3) for _ in range(50)]
    befores = sorted(request.wait(10) for request in requests)
    # each add saw the ones before it: the values before are 7, 10, ..., one each
    assert befores == list(range(7, 7 + 3 * 50, 3))
    assert counter.read() == 7 + 3 * 50
    with pytest.raises(SMBValueError, match="outside a counter's signed"):
        counter.fetch_add_nb(1 << 64)
    assert counter.read() == counter.peek() == 7 + 3 * 50


@pytest.mark.timeout(120)
def test_fetch_add_that_would_wrap_is_refused_and_the_counter_keeps_its_value(client):
    # issue 44: 2**62 + 2**62 gave -2**63, and the counter handed out its values again
    top = client.counter("near-top", initial=1 << 62)
    with pytest.raises(SMBValueError) as refused:
        top.fetch_add(1 << 62)
    text = str(refused.value)
    assert "counter 'near-top'" in text and str(1 << 62) in text and str((1 << 63) - 1) in text
    assert top.read() == 1 << 62
    assert top.fetch_add((1 << 62) - 1) == 1 << 62          # up to the limit itself is fine
    assert top.read() == (1 << 63) - 1
    with pytest.raises(SMBValueError, match="counter 'near-top'"):
        top.fetch_add(1)
    assert top.read() == (1 << 63) - 1
    bottom = client.counter("near-bottom", initial=-(1 << 63) + 1)
    with pytest.raises(SMBValueError, match=str(-(1 << 63))):
        bottom.fetch_add(-2)
    assert bottom.fetch_add(-1) == -(1 << 63) + 1
    assert bottom.read() == -(1 << 63)
    assert top.fetch_add(-5) == (1 << 63) - 1                # a refusal leaves it usable


CONCURRENT = r"""
import json, sys
import numpy as np
from eddis.smb import Client
run_dir, me, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
length = int(sys.argv[4])
out = {}
with Client(run_dir, expected_servers=3, timeout=30) as c:
    pool = c.pool("shared", length, slots=2 + n)
    counter = c.counter("hits")
    barrier = c.barrier("all", n)
    event = c.event("go")
    # concurrent writers to separate ranges
    part = length // n
    pool.write(np.full(part, me + 1, np.float32), slot=0, start=me * part)
    # concurrent atomics: no lost increments, every old value unique
    olds = [counter.fetch_add(1) for _ in range(200)]
    barrier.wait()
    out["row"] = pool.read(slot=0).tolist()
    out["olds"] = olds
    out["total"] = counter.read()
    # reduction with n contributors: each writes its own slot, then reduce_nb
    contrib = np.arange(length, dtype=np.float32) * (me + 1)
    pool.write(contrib, slot=2 + me)
    req = pool.reduce_nb(2 + me, float(me + 1), n, 1, generation=7)
    req.wait()
    out["reduced"] = pool.read(slot=1).tolist()
    # events: rank 0 notifies after the barrier, the others wait for it
    barrier.wait()
    if me == 0:
        out["version"] = event.notify()
    else:
        out["version"] = event.wait(1, timeout=30)
    barrier.wait()
print(json.dumps(out))
"""


@pytest.mark.timeout(180)
def test_four_clients_concurrently(cluster):
    n, length = 4, 1200
    results = run_clients(cluster, n, CONCURRENT, [str(length)])
    part = length // n
    want_row = np.repeat(np.arange(1, n + 1, dtype=np.float32), part)
    olds = sorted(o for r in results for o in r["olds"])
    assert olds == list(range(200 * n))
    weights = np.arange(1, n + 1, dtype=np.float64)
    want_reduced = np.arange(length) * (weights * weights).sum() / weights.sum()
    for r in results:
        np.testing.assert_array_equal(np.array(r["row"], np.float32), want_row)
        assert r["total"] == 200 * n
        np.testing.assert_allclose(r["reduced"], want_reduced, rtol=1e-5)
        assert r["version"] == 1


@pytest.mark.timeout(120)
def test_one_client_shared_by_threads(client):
    """A background thread and the main thread use one client at the same time."""
    import threading

    pool = client.pool("threads", 5000, slots=3)
    counter = client.counter("threads")
    errors = []

    def background():
        try:
            for i in range(30):
                data = np.full(5000, i, np.float32)
                pool.write(data, slot=0)
                pool.reduce_nb(0, 1.0, 1, 1, generation=i).wait()
                np.testing.assert_array_equal(pool.read(slot=1), data)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=background)
    thread.start()
    olds = []
    try:
        while thread.is_alive() or len(olds) < 200:
            olds.append(counter.fetch_add(1))
            if len(olds) % 50 == 0:
                pool.write(np.ones(100, np.float32), slot=2, start=len(olds) % 4900)
    finally:
        thread.join()
    assert not errors, errors
    assert olds == list(range(len(olds)))
    assert counter.read() == len(olds)
    pool.free()


@pytest.mark.timeout(120)
def test_threads_wait_on_one_clients_transfers(client, cluster):
    """Threads wait on one client at once (a reducer's relay thread on its writes, its finish
    thread on its reads): each gets its own data back, and over the sockets a thread that
    finds another moving them sleeps until that pass completes replies (counted) instead of
    spinning on the lock. A third thread waits on an event all along, so the sockets are
    being moved by another thread most of the time, however the threads are scheduled."""
    import threading

    n = 4 << 20   # 16 MiB of float32 a transfer: many passes over the sockets
    pools = [client.pool(f"shared-wait-{t}", n, slots=1) for t in range(2)]
    held = client.event("shared-wait-held")
    errors, versions = [], []
    before = client._core.shared_waits

    def transfers(t):
        try:
            rng = np.random.default_rng(t)
            out = np.empty(n, np.float32)
            for _ in range(8):
                data = rng.random(n, dtype=np.float32)
                pools[t].write_nb(data, slot=0).wait()
                pools[t].read_nb(out=out, slot=0).wait()
                np.testing.assert_array_equal(out, data)
        except BaseException as exc:   # reported by the main thread
            errors.append(exc)

    def holding():
        try:
            versions.append(held.wait(1, timeout=60))
        except BaseException as exc:
            errors.append(exc)

    holder = threading.Thread(target=holding)
    holder.start()
    threads = [threading.Thread(target=transfers, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    held.notify()
    holder.join(timeout=30)
    assert not any(thread.is_alive() for thread in [holder, *threads])
    assert not errors, errors
    assert versions == [1]
    if cluster.transport == "socket":
        assert client._core.shared_waits > before
    for pool in pools:
        pool.free()


@pytest.mark.timeout(60)
def test_close_while_another_thread_waits(cluster, monkeypatch):
    """close() from one thread while another waits: an error there, never a crash."""
    import threading

    from eddis.errors import UsageError

    for key, value in cluster.client_env.items():
        monkeypatch.setenv(key, value)
    c = Client(cluster.run_dir, expected_servers=3, timeout=20)
    outcome = []

    def waiter():
        try:
            c.event("never").wait(1, timeout=15)
            outcome.append("returned")
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    import time

    time.sleep(0.3)
    c.close()
    thread.join(20)
    assert not thread.is_alive()
    assert isinstance(outcome[0], UsageError), outcome
    with pytest.raises(UsageError):
        c.counter("after-close")
