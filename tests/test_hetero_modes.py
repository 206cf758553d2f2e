"""Mixed GPU generations on 4 real MPI ranks with real SMB: sync, balanced sync, easgd
and hybrid train scikit-learn's digits classifier while rank 1 is slowed 2x
(EDDIS_SIMULATE_SLOWDOWN, the testing aid); hybrid groups are ranks {0,1} and {2,3}
(EDDIS_GROUP per rank, as the launcher sets it for hetjob components).

Stated figures: every mode reaches a test accuracy of at least 0.90 on the 360
held-out digits (a linear model gets about 0.95, 1/10 is chance). The global
learning counter ends exactly at the total and the ranks' iterations add up to
it; in easgd and hybrid the fast ranks did more iterations than the slowed
one; balanced sync ends with the same parameters as plain sync (relative error
below 1e-5 after 20 steps), both when all ranks run at the same speed (measured
shares) and when the shares start unequal (balance=[1, 2, 3, 4], rank 1 slowed
3x), with batches from a DataLoader over eddis.BalancedBatchSampler; balanced
hybrid splits each group's batch among the group's own ranks (rank 1 takes the
smaller part of group 0's) and keeps a group's copies identical; the staleness
bound holds in every recorded step.

This file is also the worker: ``mpirun -n 4 python tests/test_hetero_modes.py OUT.json``
(with EDDIS_GROUP/EDDIS_NUM_GROUPS per rank for the hybrid groups).
"""
import json
import os
import sys
import time

SLOWED = 1
TOTAL = 480            # iterations of 32 samples: sync does 120 steps of 128
LOCAL_BATCH = 32
GROUP_SIZE = 2         # hybrid: ranks {0, 1} and {2, 3}
ACCURACY = 0.90
EQUIVALENCE_TOLERANCE = 1e-5


def load_digits_split():
    """scikit-learn's bundled digits, read from its data file: importing sklearn
    costs every rank seconds of CPU on a 2-core machine."""
    import importlib.util
    from pathlib import Path

    import numpy as np
    import torch

    package = Path(importlib.util.find_spec("sklearn").submodule_search_locations[0])
    data = np.loadtxt(package / "datasets" / "data" / "digits.csv.gz", delimiter=",")
    x = (data[:, :-1] / 16.0).astype(np.float32)
    y = data[:, -1].astype(np.int64)
    order = np.random.default_rng(0).permutation(len(x))
    test, train = order[:360], order[360:]
    return (torch.from_numpy(x[train]), torch.from_numpy(y[train]),
            torch.from_numpy(x[test]), torch.from_numpy(y[test]))


def make_model():
    import torch.nn as nn

    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def accuracy(model, x, y):
    import torch

    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def flat_params(model):
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(mode, balance=False, total=TOTAL, staleness=None, record=False, lr=None,
          slowdown=None, loader=False, checkpoint=None, overlap=None):
    """One training run; returns the rank's results (collective). ``balance``: False, True
    or initial per-rank weights; ``loader``: sync batches from a DataLoader over
    eddis.BalancedBatchSampler (else eddis.balanced_slice of an in-memory global batch);
    ``checkpoint``: a path for eddis.save_checkpoint; ``overlap``: EDDIS_EASGD_OVERLAP (None:
    the default, auto)."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    import eddis.torch as eddis

    launch_slowdown = os.environ.get("EDDIS_SIMULATE_SLOWDOWN")
    if slowdown is not None:
        os.environ["EDDIS_SIMULATE_SLOWDOWN"] = slowdown
    if overlap is None:   # the default: auto, off on this one node
        os.environ.pop("EDDIS_EASGD_OVERLAP", None)
    else:
        os.environ["EDDIS_EASGD_OVERLAP"] = "1" if overlap else "0"
    xtr, ytr, xte, yte = load_digits_split()
    rank, size = eddis.rank(), eddis.size()
    torch.manual_seed(0)
    model = make_model()
    sync_like = mode == "sync"
    lr = lr if lr is not None else (0.2 if sync_like else 0.05)
    optimizer = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                           named_parameters=model.named_parameters(), mode=mode,
                                           balance=balance, bucket_bytes=1 << 18)
    eddis.broadcast_parameters(model.state_dict(), root_rank=0)
    ctl = eddis.configure_progress(total=total, chunk=2, staleness=staleness, record=record)
    global_batch = LOCAL_BATCH * size
    rng = np.random.default_rng(100 + rank)           # easgd/hybrid: each rank its own batches
    order = np.random.default_rng(7).permutation(len(xtr))   # sync: one global order
    if loader:
        dataset = torch.utils.data.TensorDataset(xtr, ytr)
        sampler = eddis.BalancedBatchSampler(dataset, global_batch, seed=7, optimizer=optimizer)
        batches = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
        epoch, it = 0, iter(batches)
    start = time.perf_counter()
    step = 0
    while not eddis.should_stop():
        if loader:
            try:
                xb, yb = next(it)
            except StopIteration:
                epoch += 1
                sampler.set_epoch(epoch)
                it = iter(batches)
                xb, yb = next(it)
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            step += 1
            continue
        if sync_like:
            picks = np.resize(np.roll(order, -step * global_batch), global_batch)
            part = eddis.balanced_slice(global_batch)
            idx = torch.from_numpy(picks[part])
        elif mode == "hybrid" and balance:   # this rank's share of its group's batch
            part = eddis.balanced_slice(LOCAL_BATCH * GROUP_SIZE)
            idx = torch.from_numpy(rng.integers(0, len(xtr), part.stop - part.start))
        else:
            idx = torch.from_numpy(rng.integers(0, len(xtr), LOCAL_BATCH))
        optimizer.zero_grad()
        F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        optimizer.step()
        step += 1
    wall = time.perf_counter() - start
    # hybrid: a group's members step alike and apply the same moves, so they stay identical
    trained = eddis.allgather_object((eddis.group(), flat_params(model).numpy()))
    group_spread = max(float(np.abs(p - trained[[g for g, _ in trained].index(g)][1]).max())
                       for g, p in trained)
    if checkpoint:
        eddis.save_checkpoint(checkpoint, model, optimizer, note="test")
    else:
        eddis.final_model(optimizer)
    counts = eddis.progress_counts()
    eddis.barrier()
    counter = ctl.counter.read()
    params = flat_params(model)
    reference = eddis.broadcast(params, root_rank=0)
    spread = eddis.allreduce((params - reference).abs().max().reshape(1), op=eddis.Max).item()
    state = optimizer._eddis.hetero
    shares = state.balancer.shares.tolist() if state.balancer is not None else None
    every_shares = eddis.allgather_object(shares)   # hybrid: each rank its group's
    # each exchanging worker's throughput over the mean of all (easgd: every rank; hybrid: leaders)
    masses = eddis.allgather_object(state.averager.mass if state.averager is not None else None)
    history = eddis.allgather_object(ctl.history) if record else None
    result = {"mode": mode, "balance": balance, "accuracy": accuracy(model, xte, yte), "counts": counts,
              "counter": counter, "total": total, "wall": wall, "spread": spread, "shares": shares,
              "params": params, "history": history, "checkpoint": checkpoint, "masses": masses,
              "overlap": overlap, "overlapped": state.overlap, "group_spread": group_spread, "every_shares": every_shares,
              "exchanges": eddis.allgather_object(state.averager.exchanges if state.averager else 0)}
    group_pool = getattr(optimizer.reducer, "pool", None) if mode == "hybrid" else None
    optimizer.close()
    result["leaked_pools"] = leaked_pools(eddis.rank(), state.averager, group_pool)
    if launch_slowdown is None:
        os.environ.pop("EDDIS_SIMULATE_SLOWDOWN", None)
    else:
        os.environ["EDDIS_SIMULATE_SLOWDOWN"] = launch_slowdown
    return result


def leaked_pools(rank, averager, group_pool):
    """The easgd/hybrid pools that optimizer.close() left on the servers. Rank 0 frees the
    centre and its group's pool itself, after the other ranks' arrival, so it can look."""
    from smb_pools import pool_left_on_servers

    pools = [p for p in (averager.pool if averager is not None else None, group_pool) if p is not None]
    if rank != 0:
        return []
    return [pool.name for pool in pools if pool_left_on_servers(pool)]


def run_all(out_dir):
    """Everything in one MPI job (starting torch on 4 ranks costs more than training)."""
    slowed = f"{SLOWED}:2.0"
    ckpt = os.path.join(out_dir, "{}.pt").format
    modes = [train("sync", slowdown=slowed, checkpoint=ckpt("sync")),
             train("sync", balance=True, slowdown=slowed),
             train("easgd", slowdown=slowed, checkpoint=ckpt("easgd")),
             train("hybrid", slowdown=slowed, checkpoint=ckpt("hybrid")),
             train("hybrid", balance=True, slowdown=slowed),
             train("easgd", total=240, staleness=1, record=True, slowdown=slowed)]
    overlapped = [train("easgd", slowdown=slowed, overlap=True), train("hybrid", slowdown=slowed, overlap=True)]
    # 20 steps, as in test_torch_equivalence: rounding differences of the
    # split grow with every step, and this compares the math, not the training
    same = {"total": 80, "lr": 0.05, "loader": True}
    equivalence = [train("sync", **same), train("sync", balance=True, **same),
                   train("sync", balance=[1, 2, 3, 4], slowdown=f"{SLOWED}:3.0", **same)]
    reference = equivalence[0]["params"]
    for run in equivalence:
        run["error"] = float((run["params"] - reference).norm() / reference.norm())
    for run in modes + equivalence + overlapped:
        del run["params"]
    return {"modes": modes, "equivalence": equivalence, "overlapped": overlapped}


def main(out):
    os.environ.setdefault("EDDIS_BALANCE_WARMUP", "3")
    os.environ.setdefault("EDDIS_BALANCE_INTERVAL", "5")
    import eddis.torch as eddis

    eddis.init()
    results = run_all(os.path.dirname(os.path.abspath(out)))
    if eddis.rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    eddis.shutdown()


# ---------------------------------------------------------------- pytest side
if __name__ != "__main__":
    import pytest
    pytestmark = pytest.mark.mpi  # starts real Open MPI ranks

    from conftest import PYTHON
    from test_hetero_units import staleness_violations

    HERE = os.path.abspath(__file__)

    @pytest.fixture(scope="module")
    def results(tmp_path_factory):
        import shutil
        import tempfile

        from conftest import python_env, run_process_group

        shm = tempfile.mkdtemp(prefix="eddis-test-ompi-", dir="/dev/shm")
        out = tmp_path_factory.mktemp("hetero") / "results.json"
        env = python_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                          "OMPI_MCA_btl_vader_backing_directory": shm, "EDDIS_COMM_TIMEOUT": "120"})
        env.pop("EDDIS_SIMULATE_SLOWDOWN", None)
        groups = [["-n", "2", "-x", f"EDDIS_GROUP={g}", "-x", "EDDIS_NUM_GROUPS=2", PYTHON, HERE, str(out)]
                  for g in (0, 1)]
        cmd = ["mpirun", "--oversubscribe", *groups[0], ":", *groups[1]]
        try:
            proc = run_process_group(cmd, env, 420, what="mpirun -n 4 tests/test_hetero_modes.py")
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        if proc.returncode != 0:
            pytest.fail(f"workers failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}",
                        pytrace=False)
        data = json.loads(out.read_text())
        data["stderr"] = proc.stderr
        return data

    @pytest.fixture(scope="module")
    def modes(results):
        return {(r["mode"], r["balance"], r["history"] is not None): r for r in results["modes"]}

    RUNS = {"sync": ("sync", False, False), "balanced sync": ("sync", True, False),
            "easgd": ("easgd", False, False), "hybrid": ("hybrid", False, False),
            "balanced hybrid": ("hybrid", True, False)}

    @pytest.mark.timeout(450)
    @pytest.mark.parametrize("name", list(RUNS))
    def test_mode_reaches_accuracy_and_uses_exactly_the_total(modes, name):
        r = modes[RUNS[name]]
        assert r["accuracy"] >= ACCURACY, (name, r["accuracy"])
        assert r["spread"] == 0.0, "every rank must end with the same final model"
        assert r["counter"] == r["total"]
        assert sum(r["counts"]) == r["total"]

    @pytest.mark.timeout(450)
    @pytest.mark.parametrize("mode", ["easgd", "hybrid"])
    def test_overlapped_exchanges_reach_accuracy_and_keep_groups_identical(results, mode):
        """EDDIS_EASGD_OVERLAP: a stripe exchanged in the background after every step, its move
        applied after the next."""
        r = next(run for run in results["overlapped"] if run["mode"] == mode)
        assert r["overlap"] and r["overlapped"] and r["accuracy"] >= ACCURACY, r["accuracy"]
        assert r["counter"] == r["total"] and sum(r["counts"]) == r["total"]
        assert r["spread"] == 0.0 and r["leaked_pools"] == []
        exchanging = [0, 1, 2, 3] if mode == "easgd" else [0, 2]   # hybrid: the groups' leaders
        assert all(r["exchanges"][k] > 0 for k in exchanging), r["exchanges"]
        assert all(r["exchanges"][k] == 0 for k in set(range(4)) - set(exchanging)), r["exchanges"]
        if mode == "hybrid":
            assert r["group_spread"] == 0.0

    @pytest.mark.timeout(450)
    @pytest.mark.parametrize("name", ["easgd", "hybrid"])
    def test_auto_overlap_is_off_where_every_rank_maps_the_centre(modes, name):
        # one node: the exchanges are memory copies, nothing to hide behind the next step
        assert modes[RUNS[name]]["overlap"] is None and modes[RUNS[name]]["overlapped"] is False

    @pytest.mark.timeout(450)
    @pytest.mark.parametrize("name", ["easgd", "hybrid"])
    def test_close_gives_the_pools_back(modes, name):
        # each optimizer's centre (and hybrid group pool) would otherwise stay on the servers,
        # and a job that builds several optimizers runs out of SMB memory
        assert modes[RUNS[name]]["leaked_pools"] == []

    @pytest.mark.timeout(450)
    def test_sync_ranks_step_together(modes):
        for key in (RUNS["sync"], RUNS["balanced sync"]):
            counts = modes[key]["counts"]
            assert counts == [TOTAL // 4] * 4, counts

    @pytest.mark.timeout(450)
    def test_fast_ranks_do_more_iterations(modes):
        easgd = modes[RUNS["easgd"]]["counts"]
        assert min(c for r, c in enumerate(easgd) if r != SLOWED) > easgd[SLOWED], easgd
        hybrid = modes[RUNS["hybrid"]]["counts"]   # group 0 holds the slowed rank
        assert hybrid[0] == hybrid[1] and hybrid[2] == hybrid[3], hybrid
        assert hybrid[2] > hybrid[SLOWED], hybrid

    @pytest.mark.timeout(450)
    def test_fast_workers_weigh_more_in_the_elastic_exchange(modes):
        easgd = modes[RUNS["easgd"]]["masses"]
        # the other three share 2 cores unevenly here, so only the slowed rank's place is sure
        assert easgd[SLOWED] < min(m for r, m in enumerate(easgd) if r != SLOWED), easgd
        assert easgd[SLOWED] < 1.0 < max(easgd), easgd
        hybrid = modes[RUNS["hybrid"]]["masses"]   # leaders: rank 0 (with the slowed rank), rank 2
        assert hybrid[0] < 1.0 < hybrid[2], hybrid

    @pytest.mark.timeout(450)
    def test_balanced_sync_rebalanced(modes):
        shares = modes[RUNS["balanced sync"]]["shares"]
        assert len(shares) == 4 and all(x > 0 for x in shares) and abs(sum(shares) - 1) < 1e-9, shares
        assert shares != [0.25] * 4, "the measured throughputs never moved the shares"

    @pytest.mark.timeout(450)
    def test_hybrid_groups_balance_their_own_ranks(modes):
        r = modes[RUNS["balanced hybrid"]]
        every = r["every_shares"]
        assert every[0] == every[1] and every[2] == every[3], every   # a group decides together
        assert all(len(s) == GROUP_SIZE and abs(sum(s) - 1) < 1e-9 for s in every), every
        assert every[0][1] < every[0][0], every   # rank 1, slowed 2x, takes less of group 0's batch
        # the members' weighted average is one result: a group's copies stay identical
        assert r["group_spread"] == 0.0
        assert r["counts"][0] == r["counts"][1] and r["counts"][2] == r["counts"][3], r["counts"]

    @pytest.mark.timeout(450)
    def test_staleness_bound_holds(modes):
        r = modes[("easgd", False, True)]
        assert r["counter"] == r["total"] and sum(r["counts"]) == r["total"]
        logs = [[tuple(e) for e in log] for log in r["history"]]
        assert not staleness_violations(logs, 1)
        assert all(any(e == "start" for _, e, _ in log) for log in logs)

    @pytest.mark.timeout(450)
    @pytest.mark.parametrize("name", ["sync", "easgd", "hybrid"])
    def test_checkpoint_holds_the_final_model(modes, name):
        import torch

        r = modes[RUNS[name]]
        saved = torch.load(r["checkpoint"], weights_only=False)
        assert saved["mode"] == name and saved["note"] == "test" and "optimizer" in saved
        model = make_model()
        model.load_state_dict(saved["model"])
        xte, yte = load_digits_split()[2:]
        assert accuracy(model, xte, yte) == pytest.approx(r["accuracy"])
        assert not any(p.name.endswith(".tmp") or ".tmp-" in p.name
                       for p in __import__("pathlib").Path(r["checkpoint"]).parent.iterdir())

    @pytest.mark.timeout(450)
    def test_slowdown_warns_as_a_testing_aid(results):
        assert "testing aid" in results["stderr"]

    @pytest.mark.timeout(450)
    def test_balanced_sync_equals_plain_sync(results):
        plain, equal, unequal = results["equivalence"]
        assert plain["counts"] == [20] * 4
        for run in (equal, unequal):
            assert run["error"] < EQUIVALENCE_TOLERANCE, (run["shares"], run["error"])
        assert unequal["shares"] != [0.25] * 4   # the split really differed from plain sync's


if __name__ == "__main__":
    main(sys.argv[1])
