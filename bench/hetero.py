"""Mixed GPU generations, simulated: DDP vs EDDIS sync, balanced sync, easgd and hybrid.

    python bench/hetero.py [--configs 1111,1112,1123] [--samples 49152] [--target-loss 0.15]
                           [--device-ms 0.5] [--json out.json]

Four ranks train the same MLP (64-512-512-10) on scikit-learn's digits with
the same total number of samples; per-rank slowdown factors stand in for GPU
generations. Two ways to make a rank slower:

- ``--device-ms D`` (default 0.5): a simulated accelerator. Every step, after
  the forward pass and before backward, a rank with factor f sleeps
  ``f x D ms`` per sample of its mini-batch: the time its GPU would compute,
  during which the host CPU is free, as on a real GPU node. The real CPU work
  (the small MLP, communication) comes on top. This keeps the speed ratios
  between ranks fixed however the 4 ranks share this machine's cores.
- ``--device-ms 0``: EDDIS_SIMULATE_SLOWDOWN, the testing aid of the runtime
  (a rank sleeps (f-1) x its measured CPU compute time each step); on a machine
  with fewer cores than ranks the measured compute time itself swings with
  the load, and so do the ratios.

One ``mpirun`` per configuration runs, in order:

- ``solo``: every rank trains alone (no communication), all at once, with its
  slowdown: its samples/s is its solo throughput; the ideal throughput of the
  job is their sum (what perfect heterogeneity handling would reach on this
  machine, where the 4 ranks share the CPU cores);
- ``ddp``: torch DistributedDataParallel over gloo, equal shares of a global
  batch of 4 x 64, slowdown applied before backward (so the slowed rank's
  gradients arrive late, as on a slower GPU);
- ``sync``, ``balanced`` (balance=True), ``easgd`` (local batch 64, tau 4,
  default alpha) and ``hybrid`` (ranks of equal factor form one group, as one
  hetjob component per GPU type would) through EDDIS, with the global
  learning counter for easgd/hybrid.

Reported per contender: wall time, samples/s, efficiency (samples/s over the
ideal), time to the target training loss (rank 0's moving average of its
mini-batch loss), the speedup over DDP (time to target), final test accuracy
(of the centre for easgd/hybrid) and the iterations each rank did. This is a
benchmark, not a test: it prints figures and asserts nothing.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCAL_BATCH = 64
CONTENDERS = ["ddp", "sync", "balanced", "easgd", "hybrid"]
EMA = 0.9


def rank_speed(factor, device_ms):
    """(CPU stretch, simulated device) of a rank with this factor: ``device(n)`` sleeps the time a GPU
    of this speed would compute n samples (--device-ms), else the stretch slows the CPU compute."""
    from eddis.core.hetero import simulate

    def device(n):
        if device_ms > 0:
            time.sleep(factor * device_ms * n / 1000.0)
    return simulate.Slowdown(1.0 if device_ms > 0 else factor), device


def load_digits():
    import importlib.util

    import numpy as np
    import torch

    package = Path(importlib.util.find_spec("sklearn").submodule_search_locations[0])
    data = np.loadtxt(package / "datasets" / "data" / "digits.csv.gz", delimiter=",")
    x = torch.from_numpy((data[:, :-1] / 16.0).astype(np.float32))
    y = torch.from_numpy(data[:, -1].astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(x)))
    test, train = order[:360], order[360:]
    return x[train], y[train], x[test], y[test]


def make_model():
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


class LossTracker:
    """Rank 0's moving average of its mini-batch loss; remembers when it first hit the target."""

    def __init__(self, target):
        self.target, self.ema, self.hit, self.start = target, None, None, time.perf_counter()

    def add(self, loss):
        self.ema = loss if self.ema is None else EMA * self.ema + (1 - EMA) * loss
        if self.hit is None and self.ema <= self.target:
            self.hit = time.perf_counter() - self.start


# ---------------------------------------------------------------- worker
def worker(args):
    import numpy as np
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    import eddis.torch as eddis

    eddis.init()
    rank, size = eddis.rank(), eddis.size()
    factors = [float(c) for c in args.factors]
    xtr, ytr, xte, yte = load_digits()
    global_batch = LOCAL_BATCH * size
    total_iterations = args.samples // LOCAL_BATCH
    results = {}

    def accuracy(model):
        with torch.no_grad():
            return (model(xte).argmax(1) == yte).float().mean().item()

    # -- solo: local training only, all ranks at once, each with its slowdown
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    slow, device = rank_speed(factors[rank], args.device_ms)
    rng = np.random.default_rng(rank)
    compute = []
    for step in range(args.solo_steps // 4 + args.solo_steps):   # a quarter untimed, to warm up
        if step == args.solo_steps // 4:
            eddis.barrier()
            compute = []
            start = time.perf_counter()
        idx = torch.from_numpy(rng.integers(0, len(xtr), LOCAL_BATCH))
        t = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
        device(len(idx))
        loss.backward()
        opt.step()
        compute.append(time.perf_counter() - t)
        slow.stretch(compute[-1])
    solo_rate = args.solo_steps * LOCAL_BATCH / (time.perf_counter() - start)
    solo = eddis.allgather_object(solo_rate)
    compute_estimate = float(np.median(compute))   # DDP's slowdown uses it
    results["solo"] = {"rates": solo, "ideal": sum(solo)}

    for name in args.contenders:
        eddis.barrier()
        if name == "ddp":
            res = run_ddp(args, rank, size, factors[rank], compute_estimate, xtr, ytr, accuracy)
        else:
            res = run_eddis(args, name, rank, size, global_batch, total_iterations, xtr, ytr, accuracy,
                            rank_speed(factors[rank], args.device_ms)[1])
        res["samples_per_s"] = args.samples / res["wall"]
        res["efficiency"] = res["samples_per_s"] / results["solo"]["ideal"]
        results[name] = res
        if rank == 0:
            print(f"[{args.factors}] {name}: wall {res['wall']:.1f} s, to target "
                  f"{res['to_target'] if res['to_target'] is None else round(res['to_target'], 1)} s, "
                  f"acc {res['accuracy']:.3f}, counts {res['counts']}", flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    eddis.shutdown()


def run_eddis(args, name, rank, size, global_batch, total_iterations, xtr, ytr, accuracy, device):
    import numpy as np
    import torch
    import torch.nn.functional as F
    import eddis.torch as eddis

    model = make_model()
    mode = {"sync": "sync", "balanced": "sync", "easgd": "easgd", "hybrid": "hybrid"}[name]
    sync_like = mode == "sync"
    # 0.2, the rate of the global batch of 4 x 64, in every mode (docs/heterogeneous.md: the
    # exchanges average the workers' moves); --local-lr: each worker's own batch's rate, 0.05 per
    # rank's 64 in easgd and 0.05 x the group's ranks in hybrid
    lr = 0.2
    if args.local_lr:
        group_size = [float(c) for c in args.factors].count(float(args.factors[rank]))
        lr = {"sync": 0.2, "easgd": 0.05, "hybrid": 0.05 * group_size}[mode]
    opt = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                     named_parameters=model.named_parameters(), mode=mode,
                                     balance=name == "balanced")
    eddis.broadcast_parameters(model.state_dict(), root_rank=0)
    eddis.configure_progress(total=total_iterations)
    order = np.random.default_rng(7).permutation(len(xtr))
    rng = np.random.default_rng(100 + rank)
    tracker = LossTracker(args.target_loss)
    eddis.barrier()
    start = time.perf_counter()
    tracker.start = start
    step = 0
    while not eddis.should_stop():
        if sync_like:
            picks = np.resize(np.roll(order, -step * global_batch), global_batch)
            idx = torch.from_numpy(picks[eddis.balanced_slice(global_batch)])
        else:
            idx = torch.from_numpy(rng.integers(0, len(xtr), LOCAL_BATCH))
        opt.zero_grad()
        loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
        device(len(idx))
        loss.backward()
        opt.step()
        if rank == 0:
            tracker.add(loss.item())
        step += 1
    wall_local = time.perf_counter() - start
    eddis.final_model(opt)
    wall = max(eddis.allgather_object(wall_local))
    counts = eddis.progress_counts()
    state = opt._eddis.hetero
    shares = state.balancer.shares.round(3).tolist() if state.balancer is not None else None
    opt.close()
    return {"wall": wall, "to_target": tracker.hit, "accuracy": accuracy(model), "counts": counts,
            "shares": shares}


def run_ddp(args, rank, size, factor, compute_estimate, xtr, ytr, accuracy):
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import eddis.torch as eddis

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                                world_size=size)
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    slow, device = rank_speed(factor, args.device_ms)
    global_batch = LOCAL_BATCH * size
    steps = args.samples // global_batch
    order = np.random.default_rng(7).permutation(len(xtr))
    tracker = LossTracker(args.target_loss)
    dist.barrier()
    start = time.perf_counter()
    tracker.start = start
    for step in range(steps):
        picks = np.resize(np.roll(order, -step * global_batch), global_batch)
        idx = torch.from_numpy(picks[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH])
        opt.zero_grad()
        loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
        slow.stretch(compute_estimate)   # before backward: the gradients leave late
        device(len(idx))
        loss.backward()
        opt.step()
        if rank == 0:
            tracker.add(loss.item())
    wall = max(eddis.allgather_object(time.perf_counter() - start))
    final_accuracy = accuracy(model.module)
    dist.destroy_process_group()
    return {"wall": wall, "to_target": tracker.hit, "accuracy": final_accuracy,
            "counts": [steps] * size, "shares": None}


# ---------------------------------------------------------------- launcher
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def groups_of(factors):
    """Hybrid groups: ranks of equal factor (one GPU type) form one group, numbered in order."""
    kinds = list(dict.fromkeys(factors))
    return [kinds.index(f) for f in factors]


def launch(config, args, tmp):
    factors = list(config)
    groups = groups_of(factors)
    out = Path(tmp) / f"{config}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
               EDDIS_COMM_TIMEOUT="300", PYTHONWARNINGS="ignore::UserWarning")
    if args.device_ms <= 0:
        env["EDDIS_SIMULATE_SLOWDOWN"] = ",".join(f"{r}:{f}" for r, f in enumerate(factors))
    shm = tempfile.mkdtemp(prefix="eddis-bench-ompi-", dir="/dev/shm")
    env["OMPI_MCA_btl_vader_backing_directory"] = shm
    cmd = ["mpirun", "--oversubscribe"]
    port = free_port()
    for r, g in enumerate(groups):
        if r:
            cmd.append(":")
        cmd += ["-n", "1", "-x", f"EDDIS_GROUP={g}", "-x", f"EDDIS_NUM_GROUPS={len(set(groups))}",
                sys.executable, __file__, "--worker", "--factors", config, "--out", str(out),
                "--samples", str(args.samples), "--target-loss", str(args.target_loss),
                "--solo-steps", str(args.solo_steps), "--port", str(port), "--device-ms", str(args.device_ms),
                "--contenders", ",".join(args.contenders)] + (["--local-lr"] if args.local_lr else [])
    server = None
    if args.server == "external":
        sys.path.insert(0, str(REPO / "src"))
        from eddis.smb.testing import LocalServers

        server = LocalServers(1, memory="512M").start()
        env["EDDIS_RUN_DIR"] = str(server.run_dir)
    try:
        subprocess.run(cmd, env=env, check=True, timeout=args.timeout)
    finally:
        subprocess.run(["rm", "-rf", shm])
        if server is not None:
            server.stop()
    return json.loads(out.read_text())


def report(all_results):
    lines = []
    for config, res in all_results.items():
        ddp = res.get("ddp")
        lines.append(f"\nslowdowns {{{','.join(config)}}}: ideal {res['solo']['ideal']:.0f} samples/s "
                     f"(solo: {', '.join(f'{r:.0f}' for r in res['solo']['rates'])})")
        lines.append(f"{'contender':<10} {'wall s':>7} {'samples/s':>10} {'eff.':>5} {'to target s':>11} "
                     f"{'vs DDP':>7} {'test acc':>8}  iterations per rank / shares")
        for name in CONTENDERS:
            r = res.get(name)
            if r is None:
                continue
            speedup = "-"
            if ddp and r["to_target"] and ddp["to_target"]:
                speedup = f"{ddp['to_target'] / r['to_target']:.2f}x"
            to_target = f"{r['to_target']:.1f}" if r["to_target"] is not None else "never"
            extra = r["shares"] if r.get("shares") else r["counts"]
            lines.append(f"{name:<10} {r['wall']:>7.1f} {r['samples_per_s']:>10.0f} {r['efficiency']:>5.2f} "
                         f"{to_target:>11} {speedup:>7} {r['accuracy']:>8.3f}  {extra}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="1111,1112,1123",
                   help="comma-separated slowdown configurations, one digit per rank")
    p.add_argument("--samples", type=int, default=49152, help="training samples per contender")
    p.add_argument("--target-loss", type=float, default=0.15)
    p.add_argument("--solo-steps", type=int, default=100)
    p.add_argument("--server", choices=["external", "embedded"], default="external",
                   help="EDDIS through an smb-server process (as eddis-train and the Slurm job script "
                        "run it, default) or through the server embedded in rank 0 (plain mpirun)")
    p.add_argument("--device-ms", type=float, default=0.5,
                   help="simulated GPU time per sample at factor 1, in ms (0: stretch the CPU compute "
                        "with EDDIS_SIMULATE_SLOWDOWN instead)")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--local-lr", action="store_true",
                   help="easgd/hybrid step at their worker's own batch's learning rate (the rule "
                        "before 2026-12-04), not the global batch's")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", default=None, help="also write all figures to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--factors", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.contenders = [c for c in args.contenders.split(",") if c]
    if args.worker:
        return worker(args)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs.split(","):
            results[config] = launch(config, args, tmp)
    how = (f"simulated device: {args.device_ms:g} ms per sample at factor 1, times the rank's factor"
           if args.device_ms > 0 else "EDDIS_SIMULATE_SLOWDOWN: CPU compute stretched by each rank's factor")
    text = how + "\n" + report(results)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
