"""CUDA paths of the PyTorch adapter: gradients of CUDA parameters are staged
through pinned host memory on a side stream, reduced through SMB (or MPI), and
copied back; fp16/bf16 compression and autocast + GradScaler on the GPU.

The worker (this file under ``mpirun``) trains a CUDA model on its shard of the
global batch and compares against rank 0's single-process reference trained on
the whole global batch on the same GPU. Skips where torch sees no GPU.
Tolerances as in test_torch_equivalence.py (TF32 is switched off so the GPU
reference and the distributed run use the same fp32 arithmetic).
"""
import copy
import json
import sys

STEPS = 20
GLOBAL_BATCH = 24
TOLERANCE = {"none": 1e-5, "fp16": 5e-3, "bf16": 5e-2}
CONFIGS = [(mode, comp) for mode in ("sync", "allreduce") for comp in ("none", "fp16", "bf16")]


def make_model():
    import torch.nn as nn

    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 8 * 8, 64), nn.Tanh(), nn.Linear(64, 10))


def batch(step, device):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 1, 8, 8, generator=g)
    return x.to(device), torch.randint(0, 10, (GLOBAL_BATCH,), generator=g).to(device)


def train(mode, compression):
    import torch
    import torch.nn.functional as F
    import eddis.torch as eddis
    from eddis.core import batch_slice

    device = torch.device("cuda", 0)
    rank, size = eddis.rank(), eddis.size()
    torch.manual_seed(0)
    model = make_model().to(device)
    reference = copy.deepcopy(model) if rank == 0 else None
    optimizer = eddis.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), mode=mode,
        compression=getattr(eddis.Compression, compression), bucket_bytes=8192)
    eddis.broadcast_parameters(model.state_dict(), root_rank=0)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9) if reference else None
    shard = batch_slice(GLOBAL_BATCH, rank, size)
    optimizer.set_sample_count(shard.stop - shard.start)
    for step in range(STEPS):
        x, y = batch(step, device)
        optimizer.zero_grad()
        F.cross_entropy(model(x[shard]), y[shard]).backward()
        optimizer.step()
        if reference is not None:
            ref_opt.zero_grad()
            F.cross_entropy(reference(x), y).backward()
            ref_opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert flat.is_cuda
    rank0 = eddis.broadcast(flat, root_rank=0)
    spread = eddis.allreduce((flat - rank0).abs().max().reshape(1), op=eddis.Max).item()
    optimizer.close()
    if reference is None:
        return None
    ref = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    return {"mode": mode, "compression": compression, "ranks": size,
            "rel_error": float((flat - ref).norm() / ref.norm()), "rank_spread": spread}


def train_amp(mode):
    """fp16 autocast with GradScaler: the documented order (unscale_ after synchronize)."""
    import torch
    import torch.nn.functional as F
    import eddis.torch as eddis
    from eddis.core import batch_slice

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = make_model().to(device)
    optimizer = eddis.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
        mode=mode, bucket_bytes=8192)
    eddis.broadcast_parameters(model.state_dict(), root_rank=0)
    scaler = torch.amp.GradScaler("cuda")
    shard = batch_slice(GLOBAL_BATCH, eddis.rank(), eddis.size())
    losses = []
    for step in range(STEPS):
        x, y = batch(step % 4, device)
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x[shard]), y[shard])
        scaler.scale(loss).backward()
        optimizer.synchronize()
        scaler.unscale_(optimizer)
        with optimizer.skip_synchronize():
            scaler.step(optimizer)
        scaler.update()
        losses.append(eddis.allreduce(loss.detach().float().reshape(1)).item())
    optimizer.close()
    return {"mode": mode, "amp": True, "first_loss": losses[0], "last_loss": losses[-1]}


def worker():
    import torch
    import eddis.torch as eddis
    from eddis.core import available_modes

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    eddis.init()
    for mode, compression in CONFIGS:
        if mode in available_modes():
            result = train(mode, compression)
            if result is not None:
                print("RESULT " + json.dumps(result), flush=True)
    for mode in ("sync", "allreduce"):
        if mode in available_modes():
            result = train_amp(mode)
            if eddis.rank() == 0:
                print("AMP " + json.dumps(result), flush=True)
    eddis.shutdown()


if __name__ == "__main__":
    sys.exit(worker())

# ---------------------------------------------------------------------- tests
import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_available(), reason="no CUDA GPU visible to torch")]
_outputs = {}


def _run(run_mpi, ranks):
    if ranks not in _outputs:
        _outputs[ranks] = run_mpi(ranks, [PYTHON, __file__], timeout=300, check=True).stdout
    return _outputs[ranks]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(c))
def test_cuda_matches_single_process(run_mpi, ranks, config):
    from eddis.core import available_modes

    # a mode missing from the build is a broken build, not a skip
    assert config[0] in available_modes(), f"mode {config[0]} is not built (available: {available_modes()})"
    found = [json.loads(line[7:]) for line in _run(run_mpi, ranks).splitlines() if line.startswith("RESULT ")]
    results = {(r["mode"], r["compression"]): r for r in found}
    assert config in results, f"worker printed no result for {config}"
    r = results[config]
    assert r["rank_spread"] == 0.0, r
    assert r["rel_error"] < TOLERANCE[config[1]], r


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ranks", [1, 2])
def test_cuda_autocast_gradscaler_trains(run_mpi, ranks):
    lines = [json.loads(line[4:]) for line in _run(run_mpi, ranks).splitlines() if line.startswith("AMP ")]
    assert lines, "worker printed no AMP result"
    assert lines[0]["last_loss"] < lines[0]["first_loss"], lines[0]
