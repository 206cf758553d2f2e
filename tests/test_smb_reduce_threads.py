"""The smb-server's reduction threads (SMB_REDUCE_THREADS), against real servers.

A vector operation that is cut into element ranges over several threads must
give the very bits of the single-threaded server, and those of numpy doing the
same float32 arithmetic. Sizes are odd on purpose: no multiple of the 64-element
part alignment nor of the kernels' 1024-element chunk, and large enough
(SMB_VECPOOL_MIN_PART = 32768 elements per part) that 2, 3 and 4 threads all
take part; the servers' counters prove that the split path ran.
"""
import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from conftest import python_env

from eddis.errors import ConfigError
from eddis.smb import Client
from eddis.smb import server as smb_server
from eddis.smb.pool import numpy_dtype
from eddis.smb.testing import LocalServers

THREADS = (1, 2, 3, 4)
MIN_PART = 32768
SIZES = (4 * MIN_PART + 4099, 3 * MIN_PART + 77)
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@pytest.fixture(scope="module")
def servers():
    """One single-server job per thread count; same-node, so writes and reads are memcpy."""
    jobs = {}
    try:
        for threads in THREADS:
            jobs[threads] = LocalServers(1, memory="48M",
                                         env={"SMB_REDUCE_THREADS": str(threads)}).start()
        yield jobs
    finally:
        for job in jobs.values():
            job.stop()
    for job in jobs.values():
        assert not job.leftovers and not job.hung and not job.unpublished


def run_ops(run_dir, dtype, n, rows, g):
    """weighted_sum, axpy, scale and both conversions on one server: the result bytes and stats."""
    out = {}
    with Client(run_dir, expected_servers=1, timeout=30) as c:
        before = c.stats()
        pool = c.pool(f"ops-{dtype}-{n}", n, dtype=dtype, slots=8)
        f32 = c.pool(f"f32-{dtype}-{n}", n, dtype="float32", slots=2)
        for s, row in enumerate(rows):
            pool.write(row, slot=s)
        f32.write(g, slot=0)
        pool.weighted_sum(4, [0, 1, 2, 3], [0.3, -1.7, 2.5, 0.0625])
        out["wsum"] = pool.read(slot=4)
        # weights of a reduction: the destination is one of the sources
        pool.weighted_sum(0, [0, 1], [1 / 3, 2 / 3])
        out["wsum_in_place"] = pool.read(slot=0)
        pool.copy(5, 1)
        pool.axpy(5, 2, -0.7)
        out["axpy"] = pool.read(slot=5)
        pool.scale(3, 1.3)
        out["scale"] = pool.read(slot=3)
        pool.copy(6, 0, src_pool=f32)
        out["copy_from_f32"] = pool.read(slot=6)
        f32.copy(1, 2, src_pool=pool)
        out["copy_to_f32"] = f32.read(slot=1)
        out["stats"] = (before, c.stats())
        pool.free()
        f32.free()
    return out


def reference(dtype, rows, g):
    """numpy in float32, as the kernels compute: products and sums rounded per step, no FMA."""
    t = NP_DTYPES[dtype]
    x = [r.astype(np.float32) for r in rows]

    def wsum(srcs, weights):
        acc = np.float32(weights[0]) * srcs[0]
        for w, s in zip(weights[1:], srcs[1:]):
            acc = acc + np.float32(w) * s
        return acc.astype(t)

    ref = {"wsum": wsum(x, [0.3, -1.7, 2.5, 0.0625])}
    ref["wsum_in_place"] = wsum(x[:2], [1 / 3, 2 / 3])
    ref["axpy"] = (x[1] + np.float32(-0.7) * x[2]).astype(t)
    ref["scale"] = (np.float32(1.3) * x[3]).astype(t)
    ref["copy_from_f32"] = g.astype(t)
    ref["copy_to_f32"] = x[2]
    return ref


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_split_operations_are_bit_identical(servers, dtype):
    rng = np.random.default_rng(7)
    for n in SIZES:
        rows = [(rng.standard_normal(n) * 4).astype(NP_DTYPES[dtype]) for _ in range(4)]
        g = (rng.standard_normal(n) * 4).astype(np.float32)
        want = reference(dtype, rows, g)
        results = {t: run_ops(job.run_dir, dtype, n, rows, g) for t, job in servers.items()}
        for threads, got in results.items():
            for op, ref in want.items():
                assert got[op].dtype == numpy_dtype(dtype) or op == "copy_to_f32"
                assert got[op].tobytes() == ref.tobytes(), \
                    f"{op} on {threads} threads, {dtype}, n={n}: differs from numpy"
            before, after = got["stats"]
            assert after["reduce_threads"] == threads
            assert after["vector_ops"] - before["vector_ops"] == 7
            split = after["vector_ops_split"] - before["vector_ops_split"]
            # every op is at least 3 * MIN_PART long: all are split when there are threads to split over
            assert split == (7 if threads > 1 else 0), (threads, split)


@pytest.mark.timeout(120)
def test_small_operations_stay_on_the_request_thread(servers):
    job = servers[4]
    with Client(job.run_dir, expected_servers=1, timeout=30) as c:
        pool = c.pool("small", 2 * MIN_PART - 1, slots=3)
        pool.write(np.ones(2 * MIN_PART - 1, np.float32), slot=0)
        before = c.stats()
        pool.weighted_sum(1, [0, 0], [0.5, 0.25])
        pool.weighted_sum(2, [0, 1], [1.0, 1.0], count=MIN_PART - 1)
        after = c.stats()
        np.testing.assert_array_equal(pool.read(slot=1), np.full(2 * MIN_PART - 1, 0.75, np.float32))
        pool.free()
    assert after["vector_ops"] - before["vector_ops"] == 2
    assert after["vector_ops_split"] == before["vector_ops_split"]


REDUCERS = r"""
import json, sys
import numpy as np
from eddis.smb import Client
run_dir, me, n, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with Client(run_dir, expected_servers=1, timeout=30) as c:
    pool = c.pool("grads", length, slots=n + 1)
    sums = []
    for generation in range(3):
        contrib = (np.arange(length, dtype=np.float32) % 1000) * (me + 1) + generation
        pool.write(contrib, slot=1 + me)
        pool.reduce_nb(1 + me, float(me + 1), n, 0, generation=generation).wait(timeout=60)
        got = pool.read(slot=0)
        c.barrier("read", n).wait()
        sums.append(got.astype(np.float64).tolist()[:: length // 97])
print(json.dumps({"sums": sums}))
"""


@pytest.mark.timeout(240)
def test_four_concurrent_contributors(servers):
    """Four client processes reduce three generations through a server with 3 threads."""
    job, n, length = servers[3], 4, 3 * MIN_PART + 77
    with Client(job.run_dir, expected_servers=1, timeout=30) as c:
        before = c.stats()
        env = python_env()
        procs = [subprocess.Popen([sys.executable, "-c", REDUCERS, str(job.run_dir), str(i), str(n),
                                   str(length)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for i in range(n)]
        results = []
        try:
            for proc in procs:
                out, err = proc.communicate(timeout=150)
                assert proc.returncode == 0, err
                results.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        after = c.stats()
    weights = np.arange(1, n + 1, dtype=np.float32)
    base = np.arange(length, dtype=np.float32) % 1000
    for generation in range(3):
        contribs = [base * np.float32(k + 1) + np.float32(generation) for k in range(n)]
        want = sum(np.float64(w) * x for w, x in zip(weights, contribs)) / weights.sum()
        # the server adds the contributions in arrival order: exact up to float32 rounding
        for r in results:
            assert r["sums"][generation] == results[0]["sums"][generation]
            np.testing.assert_allclose(r["sums"][generation], want[:: length // 97], rtol=1e-6)
    assert after["vector_ops_split"] - before["vector_ops_split"] == 3


def test_thread_count_values():
    assert smb_server.resolve_reduce_threads("3") == 3
    assert smb_server.resolve_reduce_threads(1) == 1
    for bad in ("-1", "two", 2.5, 257, True):
        with pytest.raises(ConfigError, match="SMB_REDUCE_THREADS"):
            smb_server.resolve_reduce_threads(bad)


@pytest.mark.parametrize("cpus,want", [(1, 1), (2, 1), (6, 3), (16, 8), (64, 8)])
def test_auto_thread_count(monkeypatch, cpus, want):
    monkeypatch.setattr(smb_server.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert smb_server.resolve_reduce_threads(0) == want
    monkeypatch.setenv("SMB_REDUCE_THREADS", "0")
    assert smb_server.resolve_reduce_threads() == want


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", [{"argv": ["--reduce-threads", "-2"]},
                                 {"argv": ["--reduce-threads", "1000"]},
                                 {"env": {"SMB_REDUCE_THREADS": "lots"}}])
def test_bad_thread_count_is_refused(tmp_path, how):
    argv = [sys.executable, "-m", "eddis.smb.server", "--run-dir", str(tmp_path / "run"),
            "--create-run-dir", "--memory", "8M", "--host", "127.0.0.1", *how.get("argv", [])]
    proc = subprocess.run(argv, env=python_env(how.get("env")), capture_output=True, text=True,
                          timeout=45)
    assert proc.returncode != 0
    assert "SMB_REDUCE_THREADS" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.timeout(120)
def test_concurrent_callers_and_many_operations(tmp_path, monkeypatch):
    """Two threads call the server core at once, 60 accumulating operations each.

    Each operation adds into its destination (slot 2 += w * slot 0), so a part
    that ran twice, or not at all, or with another operation's job, changes the
    final bits. A caller that finds the pool busy reduces alone."""
    import threading

    from eddis.smb import rundir

    monkeypatch.delenv("EDDIS_HOSTNAME", raising=False)
    run_dir = tmp_path / "run"
    rundir.create_run_dir(run_dir)
    n, rounds = 3 * MIN_PART + 5, 60
    rng = np.random.default_rng(3)
    server = smb_server.Server(run_dir, memory="32M", host="127.0.0.1", reduce_threads=3).start()
    try:
        with Client(run_dir, expected_servers=1, timeout=30) as c:
            pools = [c.pool(f"acc{i}", n, slots=3) for i in range(2)]
            data = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
            for pool, x in zip(pools, data):
                pool.write(x, slot=0)
            rids = [server.regions[f"pool:acc{i}"].rid for i in range(2)]
            weights = [[float(w) for w in rng.uniform(-1, 1, rounds)] for _ in range(2)]
            errors = []

            def work(i):
                try:
                    for w in weights[i]:
                        server.core.weighted_sum(rids[i], 2, 0, n, [(rids[i], 2, 1.0), (rids[i], 0, w)])
                except BaseException as exc:  # reported by the main thread
                    errors.append(exc)

            before = server.core.stats
            threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
            assert not any(t.is_alive() for t in threads)
            assert not errors, errors
            after = server.core.stats
            for pool, x, ws in zip(pools, data, weights):
                want = np.zeros(n, np.float32)
                for w in ws:
                    want = np.float32(1.0) * want + np.float32(w) * x
                assert pool.read(slot=2).tobytes() == want.tobytes()
    finally:
        server.stop()
    assert after["vector_ops"] - before["vector_ops"] == 2 * rounds
    assert after["vector_ops_split"] > before["vector_ops_split"]
