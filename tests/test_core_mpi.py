"""eddis.core over real Open MPI ranks: reducers, collectives, misuse that must not hang.

This file is also the worker: ``mpirun -n N python tests/test_core_mpi.py CASE``.
"""
import json
import sys

import numpy as np


def case_reduce(modes):
    import eddis.core as core

    core.init()
    r, n = core.rank(), core.size()
    plan = core.BucketPlan([("a", (10,)), ("b", (3, 4)), ("c", (1000,)), ("d", (77,))], bucket_bytes=256)
    weights = np.arange(1, n + 1, dtype=np.float64)
    out, in_slot = {}, {}
    for mode in modes:
        for comp in ("none", "fp16", "bf16"):
            for op in ("average", "sum"):
                red = core.make_reducer(mode, plan, compression=comp, op=op, name=f"t{mode}{comp}{op}")
                errors = []
                for step in range(3):
                    base = np.sin(np.arange(plan.total) + step).astype(np.float64)
                    plan.buffer[:] = base * (r + 1)
                    red.set_weight(weights[r])
                    for k in reversed(range(len(plan))):  # any order of readiness
                        red.mark_ready(k)
                    red.wait()
                    if op == "average":
                        expect = sum(w * base * (i + 1) for i, w in enumerate(weights)) / weights.sum()
                    else:
                        expect = sum(base * (i + 1) for i in range(n))
                    errors.append(float(np.abs(plan.buffer - expect).max() / np.abs(expect).max()))
                out[f"{mode}/{comp}/{op}"] = max(errors)
                if mode == "hybrid":   # one server on this node: uncompressed, the members sum in slots
                    in_slot[f"{comp}/{op}"] = getattr(red, "sums_in_slots", False)   # 1 rank: local
                assert red.stats["steps"] == 3 and red.stats["buckets"] == 3 * len(plan) or n == 1
                red.close()
    avg = core.allreduce_array(np.array([float(r), 1.0]), op="average")
    mx = core.allreduce_array(np.array([r]), op="max")
    obj = core.broadcast_object({"from": r}, root=n - 1)
    gathered = core.allgather_object(r * 10)
    arr = np.full(5, r, dtype=np.int32)
    core.broadcast_array(arr, root=n - 1)
    core.barrier()
    if r == 0:
        print("RESULT " + json.dumps({"errors": out, "in_slot": in_slot, "avg": avg.tolist(),
                                      "max": mx.tolist(),
                                      "obj": obj, "gathered": gathered, "bcast": arr.tolist(),
                                      "buckets": len(plan), "topology": [core.local_rank(), core.local_size(),
                                                                         core.group(), core.num_groups()]}))
    core.shutdown()


def case_hybrid_spans():
    """Mode hybrid's group reduction, compressed: through the servers (a compressed group does
    not sum in its slots), each bucket compressed and widened again on the timeline."""
    import eddis.core as core

    core.init()
    plan = core.BucketPlan([("a", (1000,)), ("b", (3000,))], bucket_bytes=4096)
    red = core.make_reducer("hybrid", plan, compression="fp16", name="spans")
    for _ in range(3):
        plan.buffer[:] = float(core.rank() + 1)
        red.reduce()
    result = {"reducer": type(red).__name__, "value": float(plan.buffer[0]), "buckets": len(plan)}
    print(f"RESULT {core.rank()} " + json.dumps(result), flush=True)
    red.close()
    core.shutdown()


def case_mismatch():
    import eddis.core as core

    core.init()
    text = "layer:3x4\nhead:10" if core.rank() == 0 else "layer:3x4\nhead:11"
    try:
        core.check_same(text, "the model", "Build the same model everywhere.")
    except Exception as exc:
        print(f"RANK{core.rank()} {type(exc).__name__}: {exc}", flush=True)
    core.shutdown()


def case_skip_collective():
    import eddis.core as core

    core.init()
    if core.rank() == 0:
        core.barrier()  # rank 1 never joins
    else:
        import time
        time.sleep(30)


def case_init_twice_and_use_before_init():
    import eddis.core as core
    from eddis.errors import UsageError

    try:
        core.rank()
    except UsageError as exc:
        print("BEFORE_INIT " + str(exc), flush=True)
    core.init()
    core.init()
    print(f"RANK {core.rank()} of {core.size()}", flush=True)
    core.shutdown()


if __name__ == "__main__":
    case = sys.argv[1]
    if case == "reduce":
        case_reduce(sys.argv[2].split(","))
    else:
        globals()["case_" + case]()
    sys.exit(0)

# ---------------------------------------------------------------------- tests
import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402

TOL = {"none": 1e-6, "fp16": 2e-3, "bf16": 2e-2}


def _result(proc):
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr
    return json.loads(lines[0][7:])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_reducers_weighted_average_and_sum(run_mpi, ranks):
    from eddis.core import available_modes

    # hybrid: one group (one node), its reducer is the group's weighted average
    modes = [m for m in ("allreduce", "sync", "hybrid") if m in available_modes()]
    res = _result(run_mpi(ranks, [PYTHON, __file__, "reduce", ",".join(modes)], check=True))
    assert res["buckets"] > 1
    in_slot, errors = res["in_slot"], res["errors"]
    assert sorted({k.split("/")[0] for k in errors}) == sorted(modes)
    for key, err in errors.items():
        assert err < TOL[key.split("/")[1]], (key, err)
    # both paths of the hybrid group's reduction are covered
    assert in_slot == {f"{c}/{o}": ranks > 1 and c == "none" for c in ("none", "fp16", "bf16")
                       for o in ("average", "sum")}, in_slot
    assert res["avg"] == [(ranks - 1) / 2, 1.0]
    assert res["max"] == [ranks - 1]
    assert res["obj"] == {"from": ranks - 1}
    assert res["gathered"] == [10 * r for r in range(ranks)]
    assert res["bcast"] == [ranks - 1] * 5
    assert res["topology"] == [0, ranks, 0, 1]


@pytest.mark.timeout(120)
def test_hybrid_group_reduction_compresses_on_the_timeline(run_mpi, tmp_path):
    from eddis.timeline.merge import merge_timeline

    proc = run_mpi(2, [PYTHON, __file__, "hybrid_spans"], env={"EDDIS_TIMELINE": str(tmp_path)}, check=True)
    results = [json.loads(line.split(" ", 2)[2]) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert len(results) == 2, proc.stdout + proc.stderr
    assert all(r["reducer"] == "GroupSyncReducer" and r["value"] == 1.5 for r in results), results
    out, summary = merge_timeline(tmp_path)
    events = json.loads(out.read_text())["traceEvents"]
    for rank in summary["ranks"]:
        for name in ("compress", "decompress"):
            buckets = {e["args"]["bucket"] for e in events if e["pid"] == rank and e["name"] == name}
            assert buckets == set(range(results[0]["buckets"])), (rank, name, buckets)


@pytest.mark.timeout(60)
def test_layout_mismatch_is_named_on_every_rank(run_mpi):
    proc = run_mpi(2, [PYTHON, __file__, "mismatch"], check=True)
    for r in range(2):
        # mpirun may glue the ranks' lines together: split on the markers
        assert f"RANK{r} " in proc.stdout, proc.stdout + proc.stderr
        line = proc.stdout.split(f"RANK{r} ")[1].split("RANK")[0]
        assert "ConfigError" in line and "'head:10'" in line and "'head:11'" in line and "rank 1" in line


@pytest.mark.timeout(60)
def test_skipped_collective_times_out_instead_of_hanging(run_mpi):
    proc = run_mpi(2, [PYTHON, __file__, "skip_collective"], env={"EDDIS_COMM_TIMEOUT": "2"}, timeout=50)
    assert proc.returncode != 0
    assert "CollectiveTimeoutError" in proc.stderr and "not every rank joined" in proc.stderr


@pytest.mark.timeout(60)
def test_use_before_init_and_launcher_rank_mismatch(run_mpi):
    proc = run_mpi(2, [PYTHON, __file__, "init_twice_and_use_before_init"], check=True)
    assert "call eddis.init() first" in proc.stdout
    assert "RANK 1 of 2" in proc.stdout
    bad = run_mpi(2, [PYTHON, __file__, "init_twice_and_use_before_init"], env={"EDDIS_SIZE": "4"})
    assert bad.returncode != 0
    assert "EDDIS_SIZE=4" in bad.stderr and "--mpi=pmix" in bad.stderr
