"""op=Adasum over real Open MPI ranks (mode allreduce) and real smb-servers (mode sync),
against a plain numpy implementation of Horovod's recursive pairwise combination.

This file is also the worker: ``mpirun -n N python tests/test_adasum.py CASE MODES``.
"""
import hashlib
import json
import sys

import numpy as np

# parameters of different sizes; the bucket cap (512 elements) puts several of them in one
# bucket and gives "big" a bucket of its own
PARAMS = [("a", (10,)), ("b", (3, 4)), ("zero", (50,)), ("big", (1000,)), ("d", (77,)),
          ("e", (300,)), ("f", (129,))]
BUCKET_BYTES = 2048
STEPS = 2


def local_gradients(rank, step):
    """This rank's gradients of one step, one float32 array per parameter. "zero" is zero on
    every rank, "d" only on rank 1 (the |a| = 0 case of a pair); "e" is the same on every
    rank (a.b = |a|^2: the pair keeps it once)."""
    rng = np.random.default_rng(1000 * step + rank)
    grads = []
    for name, shape in PARAMS:
        n = int(np.prod(shape))
        if name == "zero" or (name == "d" and rank == 1):
            g = np.zeros(n)
        elif name == "e":
            g = np.random.default_rng(step).standard_normal(n)
        else:
            g = rng.standard_normal(n) + 0.5 * rank
        grads.append(g.astype(np.float32))
    return grads


# ---------------------------------------------------------------------- the numpy reference
def round_to_wire(x, compression):
    """What the wire keeps of float32 values: float16, or bfloat16 (round to nearest even)."""
    x = np.asarray(x, dtype=np.float32)
    if compression == "fp16":
        return x.astype(np.float16).astype(np.float32)
    if compression == "bf16":
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return rounded.astype(np.uint32).view(np.float32)
    return x


def reference_pair(a, b):
    """Horovod's pairwise Adasum of one tensor, in float64."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    dot, anormsq, bnormsq = a @ b, a @ a, b @ b
    acoeff = 1.0 - dot / anormsq * 0.5 if anormsq != 0 else 1.0
    bcoeff = 1.0 - dot / bnormsq * 0.5 if bnormsq != 0 else 1.0
    return acoeff * a + bcoeff * b


def reference_tree(per_rank):
    """per_rank[r][i]: rank r's gradient of tensor i; pairs at distance 1, then 2, 4, ..."""
    level = per_rank
    while len(level) > 1:
        level = [[reference_pair(x, y) for x, y in zip(level[i], level[i + 1])]
                 for i in range(0, len(level), 2)]
    return level[0]


# ---------------------------------------------------------------------- the worker
def case_equivalence(modes):
    import eddis.core as core
    from eddis.core.basics import basics
    from eddis.errors import ConfigError

    core.init()
    rank, size = core.rank(), core.size()
    plan = core.BucketPlan(PARAMS, bucket_bytes=BUCKET_BYTES)
    shared = [b for b in plan.buckets if len(b.params) > 1]
    assert len(plan.buckets) >= 3 and shared, plan.describe()
    out = {"buckets": [len(b.params) for b in plan.buckets], "errors": {}, "zero": {}, "same": {}}
    for mode in modes:
        for comp in ("none", "fp16", "bf16"):
            red = core.make_reducer(mode, plan, compression=comp, op="adasum", name=f"ada.{mode}.{comp}")
            try:
                red.set_weight(3)
            except ConfigError as exc:
                out["weight_refused"] = str(exc)
            worst, zero = 0.0, True
            digests = []
            for step in range(STEPS):
                for i, g in enumerate(local_gradients(rank, step)):
                    plan.view(i)[...] = g
                for k in reversed(range(len(plan))):
                    red.mark_ready(k)
                red.wait()
                leaves = [[round_to_wire(g, comp) for g in local_gradients(r, step)] for r in range(size)]
                expect = reference_tree(leaves)
                for i, (name, _) in enumerate(PARAMS):
                    got = plan.view(i).astype(np.float64)
                    scale = np.abs(expect[i]).max()
                    if scale == 0:
                        zero = zero and not got.any()
                    else:
                        worst = max(worst, float(np.abs(got - expect[i]).max() / scale))
                digests.append(hashlib.sha256(plan.buffer.tobytes()).hexdigest())
            red.close()
            out["errors"][f"{mode}/{comp}"] = worst
            out["zero"][f"{mode}/{comp}"] = zero
            everyone = core.allgather_object(digests)
            out["same"][f"{mode}/{comp}"] = all(d == everyone[0] for d in everyone)
    if "sync" in modes:  # the node-local paths have no Adasum: refused, naming the flat path
        import os

        os.environ["EDDIS_SYNC_REDUCE"] = "hierarchical"
        try:
            core.make_reducer("sync", plan, op="adasum", name="ada.hier")
        except ConfigError as exc:
            out["hierarchical"] = str(exc)
        os.environ["EDDIS_SYNC_REDUCE"] = "auto"
    # eddis.allreduce(op=Adasum): one tensor, float64, the same tree
    metric = np.array([1.0 + rank, -2.0, 0.5 * rank], dtype=np.float64)
    got = basics.allreduce_array(metric, op="adasum")
    want = reference_tree([[np.array([1.0 + r, -2.0, 0.5 * r])] for r in range(size)])[0]
    out["allreduce_array"] = float(np.abs(got - want).max())
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    core.shutdown()


def case_misuse(modes):
    import eddis.core as core
    from eddis.core.basics import basics
    from eddis.errors import ConfigError

    core.init()
    plan = core.BucketPlan(PARAMS, bucket_bytes=BUCKET_BYTES)
    found = {}
    for what, call in (("reducer", lambda: core.make_reducer(modes[0], plan, op="adasum", name="bad")),
                       ("easgd", lambda: core.make_reducer("easgd", plan, op="adasum", name="bad2")),
                       ("allreduce", lambda: basics.allreduce_array(np.ones(3), op="adasum")),
                       ("integer", lambda: basics.allreduce_array(np.ones(3, dtype=np.int32), op="adasum"))):
        try:
            call()
            found[what] = "no error"
        except ConfigError as exc:
            found[what] = str(exc)
    if core.rank() == 0:
        print("RESULT " + json.dumps(found), flush=True)
    core.shutdown()


def case_torch(modes):
    """DistributedOptimizer(op=Adasum) of a small torch model: the gradients after synchronize()
    are the numpy tree of every rank's own gradients; eddis.allreduce(op=Adasum) too."""
    import torch

    import eddis.torch as hvd
    from eddis.errors import ConfigError

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for mode in modes:
        torch.manual_seed(0)  # the same model everywhere
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(rank + 1))
        local = torch.autograd.grad(model(x).pow(2).sum(), list(model.parameters()))
        everyone = hvd.allgather_object([g.numpy().ravel().copy() for g in local])
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), op=hvd.Adasum,
                                       mode=mode, bucket_bytes=64)
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.synchronize()
        expect = reference_tree(everyone)
        out[mode] = max(float(np.abs(p.grad.numpy().ravel() - e).max() / np.abs(e).max())
                        for p, e in zip(model.parameters(), expect))
        try:
            opt.set_sample_count(4)
        except ConfigError as exc:
            out["sample_count"] = str(exc)
    got = hvd.allreduce(torch.tensor([1.0 + rank, -2.0, 0.5 * rank]), op=hvd.Adasum)
    want = reference_tree([[np.array([1.0 + r, -2.0, 0.5 * r])] for r in range(size)])[0]
    out["eddis.allreduce"] = float(np.abs(got.numpy() - want).max())
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    hvd.shutdown()


def case_tensorflow(modes):
    """DistributedGradientTape(op=Adasum) of a small Keras model, and eddis.allreduce(op=Adasum)
    of a TF tensor, against the numpy tree of every rank's own gradients."""
    import keras
    import tensorflow as tf

    import eddis.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = {}
    x = np.random.default_rng(rank + 1).standard_normal((8, 6)).astype(np.float32)
    for mode in modes:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="relu"),
                                  keras.layers.Dense(3)])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x)))
        local = tape.gradient(loss, model.trainable_variables)
        everyone = hvd.allgather_object([g.numpy().ravel().copy() for g in local])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x)))
        tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum, mode=mode, bucket_bytes=64)
        grads = tape.gradient(loss, model.trainable_variables)
        expect = reference_tree(everyone)
        out[mode] = max(float(np.abs(g.numpy().ravel() - e).max() / np.abs(e).max())
                        for g, e in zip(grads, expect))
    got = hvd.allreduce(tf.constant([1.0 + rank, -2.0, 0.5 * rank], dtype=tf.float64), op=hvd.Adasum)
    want = reference_tree([[np.array([1.0 + r, -2.0, 0.5 * r])] for r in range(size)])[0]
    out["eddis.allreduce"] = float(np.abs(got.numpy() - want).max())
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    globals()["case_" + sys.argv[1]](sys.argv[2].split(","))
    sys.exit(0)

# ---------------------------------------------------------------------- tests
import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402

# relative to the largest element of each tensor: fp32 arithmetic; fp16/bf16 on the wire
# round the leaves (the reference rounds them too) and, in mode allreduce, every level's
# inputs, in mode sync the result (the tree's inner nodes stay fp32 on the servers)
TOLERANCE = {"none": 1e-6, "fp16": 2e-3, "bf16": 1.6e-2}


def _result(proc):
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr
    return json.loads(lines[0][7:])


@pytest.fixture(scope="module")
def servers():
    """Two real smb-servers as separate nodes, so every bucket's columns are split in two."""
    from eddis.smb.testing import LocalServers

    with LocalServers(2, memory="64M", env={"SMB_LOCAL_MAP": "0"}, hostnames=["ada-node0", "ada-node1"]) as s:
        yield s
    assert not s.leftovers and not s.hung


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [2, 4])
def test_adasum_matches_the_numpy_tree(run_mpi, servers, ranks):
    env = {"EDDIS_RUN_DIR": str(servers.run_dir), "SMB_LOCAL_MAP": "0", "EDDIS_SYNC_REDUCE": "auto"}
    res = _result(run_mpi(ranks, [PYTHON, __file__, "equivalence", "allreduce,sync"], env=env,
                          timeout=280, check=True))
    assert max(res["buckets"]) > 1 and len(res["buckets"]) >= 3
    assert sorted(res["errors"]) == sorted(f"{m}/{c}" for m in ("allreduce", "sync")
                                           for c in ("none", "fp16", "bf16"))
    for key, err in res["errors"].items():
        assert err <= TOLERANCE[key.split("/")[1]], (key, err)
    assert all(res["zero"].values()), res["zero"]
    assert all(res["same"].values()), res["same"]
    assert res["allreduce_array"] < 1e-12
    assert "not as a weighted mean" in res["weight_refused"]
    assert "EDDIS_SYNC_REDUCE=auto" in res["hierarchical"]


def test_pair_coefficients_and_the_zero_cases():
    from eddis.core.comm.adasum import pair_weights

    rng = np.random.default_rng(3)
    a, b = rng.standard_normal(40), rng.standard_normal(40)
    zero = np.zeros(40)
    rows = [(a @ b, a @ a, b @ b), (0.0, 0.0, b @ b), (0.0, a @ a, 0.0), (0.0, 0.0, 0.0), (a @ a, a @ a, a @ a)]
    weights = pair_weights(rows)
    for (wa, wb), (x, y) in zip(weights, [(a, b), (zero, b), (a, zero), (zero, zero), (a, a)]):
        np.testing.assert_allclose(wa * x + wb * y, reference_pair(x, y), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(weights[1:4], [[1.0, 1.0]] * 3)
    np.testing.assert_allclose(weights[4], [0.5, 0.5])  # equal gradients are kept once


def test_tree_schedule_pairs_ranks_at_doubling_distances():
    from eddis.core.comm.adasum import check_ranks
    from eddis.core.reduce.adasum_sync import tree_schedule
    from eddis.errors import ConfigError

    assert [tree_schedule(r, 8) for r in range(8)] == [
        ([(1, 1), (2, 2), (4, 4)], None), ([], 1), ([(1, 3)], 2), ([], 1),
        ([(1, 5), (2, 6)], 4), ([], 1), ([(1, 7)], 2), ([], 1)]
    assert tree_schedule(0, 1) == ([], None)
    for size in (1, 2, 4, 64):
        check_ranks(size, "test")
    for size, hint in ((3, "launch 2 or 4"), (6, "launch 4 or 8"), (0, "launch 1 or 2")):
        with pytest.raises(ConfigError, match=hint):
            check_ranks(size, "test")


@pytest.mark.timeout(120)
def test_adasum_needs_a_power_of_two_and_floats(run_mpi):
    res = _result(run_mpi(3, [PYTHON, __file__, "misuse", "allreduce"], timeout=100, check=True))
    for what in ("reducer", "allreduce"):
        assert "power-of-2 number of ranks, not 3" in res[what] and "launch 2 or 4 ranks" in res[what]
    assert "averages models elastically" in res["easgd"]
    assert "float tensor" in res["integer"]


@pytest.mark.timeout(300)
def test_torch_distributed_optimizer_with_adasum(run_mpi, servers):
    env = {"EDDIS_RUN_DIR": str(servers.run_dir), "SMB_LOCAL_MAP": "0"}
    res = _result(run_mpi(2, [PYTHON, __file__, "torch", "allreduce,sync"], env=env, timeout=280, check=True))
    assert res["eddis.allreduce"] < 1e-6
    for mode in ("allreduce", "sync"):
        assert res[mode] <= TOLERANCE["none"], (mode, res[mode])
    assert "not as a weighted mean" in res["sample_count"]


@pytest.mark.timeout(420)
def test_tensorflow_gradient_tape_with_adasum(run_mpi, servers):
    env = {"EDDIS_RUN_DIR": str(servers.run_dir), "SMB_LOCAL_MAP": "0", "TF_CPP_MIN_LOG_LEVEL": "3",
           "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "TF_ENABLE_ONEDNN_OPTS": "0"}
    res = _result(run_mpi(2, [PYTHON, __file__, "tensorflow", "allreduce,sync"], env=env, timeout=400,
                          check=True))
    assert res["eddis.allreduce"] < 1e-12
    for mode in ("allreduce", "sync"):
        assert res[mode] <= TOLERANCE["none"], (mode, res[mode])
