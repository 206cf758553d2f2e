"""Equivalence: N ranks, each on its shard of the global batch, end with the same
parameters as one process training on the whole global batch.

The same worker body runs for 1, 2 and 4 ranks (this file is also the worker
script: ``mpirun -n N python tests/test_torch_equivalence.py``). Rank 0 trains a
reference copy on the whole global batch in-process; every rank checks that
its parameters equal rank 0's, and rank 0 reports the relative error against
the reference.

Stated tolerances (relative L2 error of all parameters after 20 SGD-momentum
steps): fp32 1e-5; fp16 compression 5e-3; bf16 compression 5e-2 (bf16 keeps 8
mantissa bits, so each reduced gradient is off by up to 2^-9 relative).

On more than one rank torch.optim's SGD and Adam update bucket by bucket, as each
bucket's average arrives (EDDIS_OVERLAP_OPTIMIZER=auto); the ``whole`` variant
turns that off. The worker counts the wrapped optimizer's own step() calls.
"""
import copy
import json
import os
import sys

STEPS = 20
GLOBAL_BATCH = 24
TOLERANCE = {"none": 1e-5, "fp16": 5e-3, "bf16": 5e-2}
CONFIGS = [  # (mode, compression, model, weighted shares)
    (mode, comp, model, False)
    for mode in ("allreduce", "sync") for comp in ("none", "fp16", "bf16") for model in ("mlp", "cnn")
] + [("allreduce", "none", "mlp", True), ("sync", "none", "mlp", True)] + [
    # mode sync summed by the server instead of the ranks (EDDIS_SYNC_REDUCE=server); plain
    # "sync" above runs the ranks' sum, since mpirun puts every rank on this one node
    ("sync:server", comp, "mlp", weighted) for comp in ("none", "bf16") for weighted in (False, True)
    if not (weighted and comp != "none")] + [
    # zero_grad(set_to_none=False): backward accumulates straight into the gradient buffer,
    # which in the ranks' sum is the rank's slot in the server memory
    ("sync:keepgrads", "none", model, False) for model in ("mlp", "cnn")] + [
    # Adam updated bucket by bucket, and SGD in one update once every bucket is in
    (f"{mode}:{variant}", "none", "mlp", False) for mode in ("allreduce", "sync") for variant in ("adam", "whole")]


def make_model(kind):
    import torch.nn as nn

    if kind == "mlp":
        return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


def batch(kind, step):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 32, generator=g) if kind == "mlp" else torch.randn(GLOBAL_BATCH, 1, 8, 8, generator=g)
    return x, torch.randint(0, 10, (GLOBAL_BATCH,), generator=g)


def train_config(mode, compression, kind, weighted):
    import torch
    import torch.nn.functional as F
    import eddis.torch as eddis
    from eddis.core import batch_slice

    rank, size = eddis.rank(), eddis.size()
    mode, _, variant = mode.partition(":")
    keep_grads = variant == "keepgrads"
    os.environ["EDDIS_SYNC_REDUCE"] = variant if variant in ("server", "ranks", "hierarchical", "ring") else "auto"
    os.environ["EDDIS_OVERLAP_OPTIMIZER"] = "off" if variant == "whole" else "auto"
    torch.manual_seed(0)
    model = make_model(kind)
    reference = copy.deepcopy(model) if rank == 0 else None
    weights = [r + 1 for r in range(size)] if weighted else None
    if variant == "adam":
        make_optimizer = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    else:
        make_optimizer = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
    optimizer = eddis.DistributedOptimizer(
        make_optimizer(model.parameters()), named_parameters=model.named_parameters(), mode=mode,
        compression=getattr(eddis.Compression, compression), bucket_bytes=8192)
    eddis.broadcast_parameters(model.state_dict(), root_rank=0)
    ref_opt = make_optimizer(reference.parameters()) if reference else None
    inner, updates = type(optimizer).__mro__[2], []
    inner_step = inner.step

    def counted_step(self, *args, **kwargs):
        if self is optimizer:
            updates.append(1)
        return inner_step(self, *args, **kwargs)

    inner.step = counted_step
    shard = batch_slice(GLOBAL_BATCH, rank, size, weights)
    optimizer.set_sample_count(shard.stop - shard.start)
    for step in range(STEPS):
        x, y = batch(kind, step)
        optimizer.zero_grad(set_to_none=not keep_grads)
        F.cross_entropy(model(x[shard]), y[shard]).backward()
        optimizer.step()
        if reference is not None:
            ref_opt.zero_grad()
            F.cross_entropy(reference(x), y).backward()
            ref_opt.step()
    inner.step = inner_step
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rank0 = eddis.broadcast(flat, root_rank=0)
    spread = eddis.allreduce((flat - rank0).abs().max().reshape(1), op=eddis.Max).item()
    buckets = len(optimizer.reducer.plan.buckets)
    by_ranks = getattr(optimizer.reducer, "path", "servers") != "servers"
    hierarchical = getattr(optimizer.reducer, "layout", None) is not None
    ring = type(optimizer.reducer).__name__ == "RingSyncReducer"
    in_slot = bool(getattr(optimizer.reducer, "sums_in_slots", False))
    grads = [p.grad.clone() for p in model.parameters()]
    buffer = optimizer._eddis.feed.flat
    slot = (buffer.data_ptr(), buffer.data_ptr() + buffer.nbytes)
    optimizer.close()
    # the gradients left the slot with their values before the client could unmap it
    grads_follow = all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    grads_private = not in_slot or not any(slot[0] <= p.grad.data_ptr() < slot[1] for p in model.parameters())
    if reference is None:
        return None
    ref = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    return {"mode": mode + (f":{variant}" if variant else ""), "compression": compression, "model": kind,
            "weighted": weighted, "ranks": size, "rel_error": float((flat - ref).norm() / ref.norm()),
            "rank_spread": spread, "buckets": buckets, "by_ranks": by_ranks, "in_slot": in_slot,
            "hierarchical": hierarchical, "ring": ring, "updates_per_step": len(updates) / STEPS,
            "grads_follow": grads_follow and grads_private}


def worker():
    fake_hosts = os.environ.get("EQUIV_FAKE_HOSTS")  # "hA,hA,hB,hB": this rank's node name by rank
    if fake_hosts:
        os.environ["EDDIS_HOSTNAME"] = fake_hosts.split(",")[int(os.environ["OMPI_COMM_WORLD_RANK"])]
    import eddis.torch as eddis
    from eddis.core import available_modes

    eddis.init()
    only = os.environ.get("EQUIV_CONFIGS")  # "mode,compression,model,weighted;..." (e.g. sync,none,mlp,False)
    configs = CONFIGS if not only else [(m, c, k, w == "True") for m, c, k, w in
                                        (entry.split(",") for entry in only.split(";"))]
    for config in configs:
        if config[0].partition(":")[0] not in available_modes() or (eddis.size() == 1 and config[1] != "none"):
            continue
        result = train_config(*config)
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
    eddis.shutdown()


if __name__ == "__main__":
    sys.exit(worker())

# ---------------------------------------------------------------------- tests
import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402

_results = {}


def _run(run_mpi, ranks):
    if ranks not in _results:
        proc = run_mpi(ranks, [PYTHON, __file__], timeout=240, check=True)
        found = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        _results[ranks] = {(r["mode"], r["compression"], r["model"], r["weighted"]): r for r in found}
    return _results[ranks]


# one rank communicates nothing, so compression does not apply there
CASES = [(ranks, config) for ranks in (1, 2, 4) for config in CONFIGS
         if ranks > 1 or config[1] == "none"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks,config", CASES,
                         ids=["-".join(str(x) for x in c if x is not False) + f"-{n}" for n, c in CASES])
def test_matches_single_process_on_global_batch(run_mpi, ranks, config):
    from eddis.core import available_modes

    if config[0].partition(":")[0] not in available_modes():
        pytest.skip(f"mode {config[0]} needs the SMB extension (eddis.smb), which is not built")
    results = _run(run_mpi, ranks)
    assert config in results, f"worker printed no result for {config}"
    r = results[config]
    assert r["rank_spread"] == 0.0, f"ranks ended with different parameters: {r}"
    assert r["rel_error"] < TOLERANCE[config[1]], r
    if config[1] == "none":
        assert r["buckets"] > 1, "the test model must span several buckets"
    if ranks > 1 and config[0].startswith("sync"):
        # on one node the ranks sum unless told to leave it to the server
        assert r["by_ranks"] == (config[0] != "sync:server"), r
        # ...and stage the gradients in their slot when nothing is compressed
        assert r["in_slot"] == (r["by_ranks"] and config[1] == "none"), r
    assert r["grads_follow"], f"gradients changed or stayed in SMB memory at close: {r}"
    # bucket by bucket wherever a reduction crosses ranks, unless turned off
    by_bucket = ranks > 1 and not config[0].endswith(":whole")
    assert r["updates_per_step"] == (r["buckets"] if by_bucket else 1), r


@pytest.mark.timeout(300)
def test_ranks_that_do_not_map_the_servers_leave_the_sum_to_them(run_mpi):
    from eddis.core import available_modes

    if "sync" not in available_modes():
        pytest.skip("mode sync needs the SMB extension (eddis.smb), which is not built")
    # SMB_LOCAL_MAP=0: the ranks reach the server over UCX as from another node
    env = {"SMB_LOCAL_MAP": "0", "EQUIV_CONFIGS": "sync,none,mlp,False"}
    proc = run_mpi(2, [PYTHON, __file__], env=env, timeout=240, check=True)
    [r] = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert r["by_ranks"] is False and r["rel_error"] < TOLERANCE["none"], r
    env["EQUIV_CONFIGS"] = "sync:ranks,none,mlp,False"
    proc = run_mpi(2, [PYTHON, __file__], env=env, timeout=240)
    assert proc.returncode != 0
    assert "EDDIS_SYNC_REDUCE=ranks needs every rank on the node of every SMB server" in proc.stdout + proc.stderr
