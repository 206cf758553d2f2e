"""EDDIS vs torch DDP (and Horovod where installed) on the same models, side by side.

    python bench/compare_torch.py [--ranks 2] [--rounds 2] [--models compute,comm[,resnet18]]

Launches ``mpirun -n RANKS`` once; inside, every contender trains the same
model on the same per-rank batch, in interleaved rounds (so load from other
processes on a shared machine hits all contenders alike), and the best round
counts. Contenders: EDDIS sync (none/fp16/bf16 on the wire), EDDIS allreduce
(MPI), torch DDP over gloo (plain, fp16 and bf16 compression hooks), and
Horovod when ``import horovod.torch`` works. A second, single-process run
measures EDDIS's overhead over plain PyTorch on one rank: two plain models
(A and B) and one wrapped in eddis.DistributedOptimizer, built once, take
single steps in turn (the order rotates every round, --single-rounds rounds),
so a slow spell of a shared machine hits all three alike. The overhead is the
median of the per-round ratios EDDIS / A; B / A, the same measurement between
two identical plain models, is printed beside it as the noise floor (where the
model's memory happens to lie moves a 100 MB model's step by up to 15 %,
depending on what the process allocated before). This runs in
--single-launches fresh processes, each building the three models in another
order, so no side always gets the same place in memory (and one model per
process: the compute model's steps before the comm model's once made the comm
model's EDDIS side 9-27 % slower, and a second plain copy up to 13 %), and twice per model:
with ``zero_grad()`` as PyTorch defaults (set_to_none: every backward allocates
the gradients anew, and whether glibc hands back warm heap memory or fresh
pages that fault in differs from model to model: up to 2x on the backward of
the 100 MB model) and with ``zero_grad(set_to_none=False)`` (no allocation in
the step: what is left is EDDIS's own cost).

Models: ``compute`` (a small CNN, 2.2 M parameters, 32 samples per rank:
compute-bound) and ``comm`` (wide fully-connected layers, 25 M parameters =
100 MB of fp32 gradients, 8 samples per rank: communication-bound), and for the
single-rank run on a GPU ``resnet18`` (torchvision's, 64 images of 224 x 224): on a
GPU the two small models step in 1-2 ms, where a fixed host-side cost per step
weighs far more than in real training.

EDDIS sync talks to an ``smb-server`` process started here (as ``eddis-train
--local`` and the Slurm job script run it); ``--server embedded`` uses the
server that a plain ``mpirun`` starts inside rank 0 instead.

Every process runs with OMP_NUM_THREADS=1 and torch.set_num_threads(1). This
is a benchmark, not a test: it prints samples/s and ratios, asserts nothing.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = {"compute": {"batch": 32, "warmup": 3, "steps": 20},
          "comm": {"batch": 8, "warmup": 2, "steps": 10},
          # torchvision's, on ImageNet-sized images: a GPU step of real size for the
          # single-rank overhead (--device cuda); far too slow for the ranks' CPU run
          "resnet18": {"batch": 64, "warmup": 3, "steps": 20}}
CONTENDERS = ["ddp", "ddp-fp16", "ddp-bf16", "eddis-sync", "eddis-sync-fp16", "eddis-sync-bf16",
              "eddis-allreduce", "horovod", "horovod-fp16"]


def build_model(name):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    if name == "compute":
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(128 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))
        shape = (3, 32, 32)
    elif name == "comm":
        model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                              nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 10))
        shape = (1024,)
    else:
        try:
            import torchvision
        except ImportError as exc:
            raise SystemExit(f"--models {name} needs torchvision: pip install torchvision") from exc
        model = torchvision.models.resnet18(num_classes=10)
        shape = (3, 224, 224)
    return model, shape


def measure(contender, model_name, rank, size, comm_state):
    import torch
    import torch.nn.functional as F

    cfg = MODELS[model_name]
    model, shape = build_model(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    net, cleanup = model, None
    if contender.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        net = DDP(model)
        if contender == "ddp-fp16":
            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif contender == "ddp-bf16":
            net.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif contender.startswith("eddis"):
        import eddis.torch as eddis

        mode = "allreduce" if contender == "eddis-allreduce" else "sync"
        comp = contender.split("-")[2] if contender.count("-") == 2 else "none"
        opt = eddis.DistributedOptimizer(opt, named_parameters=model.named_parameters(), mode=mode,
                                         compression=getattr(eddis.Compression, comp))
        cleanup = opt.close
    elif contender.startswith("horovod"):
        import horovod.torch as hvd

        comp = hvd.Compression.fp16 if contender.endswith("fp16") else hvd.Compression.none
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
    x = torch.randn(cfg["batch"], *shape)
    y = torch.randint(0, 10, (cfg["batch"],))

    def step():
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()

    for _ in range(cfg["warmup"]):
        step()
    comm_state["barrier"]()
    start = time.perf_counter()
    for _ in range(cfg["steps"]):
        step()
    elapsed = comm_state["max"](time.perf_counter() - start)
    if cleanup:
        cleanup()
    return cfg["steps"] * cfg["batch"] * size / elapsed


def worker(args):
    import torch
    import torch.distributed as dist
    import eddis.torch as eddis
    from eddis.core import allreduce_array, barrier
    import numpy as np

    torch.set_num_threads(1)
    eddis.init()
    rank, size = eddis.rank(), eddis.size()
    if size == 1:
        rounds = {f"{m}|{label}": single_rank_rounds(m, args.single_rounds, args.build_shift, to_none,
                                                      args.device)
                  for m in args.models.split(",")
                  for label, to_none in (("set_to_none", True), ("grads kept", False))}
        print("ROUNDS " + json.dumps(rounds), flush=True)
        eddis.shutdown()
        return
    contenders = args.contenders.split(",")
    available = []
    for c in contenders:
        if c.startswith("horovod"):
            try:
                import horovod.torch as hvd
                hvd.init()
            except Exception as exc:
                if rank == 0:
                    print(f"SKIP {c}: horovod not available ({type(exc).__name__}: {exc})", flush=True)
                continue
        available.append(c)
    if any(c.startswith("ddp") for c in available):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=size)
    comm_state = {"barrier": barrier,
                  "max": lambda t: float(allreduce_array(np.array([t]), op="max")[0])}
    results = {}
    for round_ in range(args.rounds):
        for model_name in args.models.split(","):
            for c in available:
                try:
                    sps = measure(c, model_name, rank, size, comm_state)
                except Exception as exc:
                    if rank == 0:
                        print(f"FAIL {c} {model_name}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                results.setdefault(f"{c}|{model_name}", []).append(sps)
                if rank == 0:
                    print(f"round {round_} {model_name:8s} {c:16s} {sps:10.1f} samples/s", flush=True)
    if rank == 0:
        print("RESULTS " + json.dumps(results), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    eddis.shutdown()


def single_rank_rounds(model_name, rounds, build_shift=0, set_to_none=True, device="cpu"):
    """[(plain A, plain B, EDDIS) step seconds] per round; the three take one step each
    in a rotating order, after one warm-up step each. They are built in the order
    A, B, EDDIS rotated by build_shift. On a CUDA device each step is timed to its
    last kernel (synchronize), as a training loop that reads its loss would be."""
    import torch
    import torch.nn.functional as F
    import eddis.torch as eddis

    cfg = MODELS[model_name]
    sides = [None] * 3
    for side in [(i + build_shift) % 3 for i in range(3)]:
        wrapped = side == 2
        model, shape = build_model(model_name)
        model = model.to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if wrapped:
            opt = eddis.DistributedOptimizer(opt, named_parameters=model.named_parameters(), mode="sync")
        x = torch.randn(cfg["batch"], *shape, device=device)
        y = torch.randint(0, 10, (cfg["batch"],), device=device)
        sides[side] = (model, opt, x, y)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

    def step(side):
        model, opt, x, y = sides[side]
        sync()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=set_to_none)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sync()
        return time.perf_counter() - start

    for side in range(3):
        step(side)
    orders = [(0, 1, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0), (1, 0, 2), (0, 2, 1)]
    out = []
    for i in range(rounds):
        times = {side: step(side) for side in orders[i % len(orders)]}
        out.append((times[0], times[1], times[2]))
    sides[2][1].close()
    return out


def overhead_summary(rounds):
    """(EDDIS / A - 1, B / A - 1) in %, medians of the per-round ratios; median step times."""
    med = statistics.median
    return (100 * (med(c / a for a, _, c in rounds) - 1), 100 * (med(b / a for a, b, _ in rounds) - 1),
            med(a for a, _, _ in rounds), med(c for _, _, c in rounds))


class SmbServer:
    """An smb-server process in a private run directory, as eddis-train --local starts one."""

    def __init__(self, env, memory):
        import tempfile

        self.run_dir = Path(tempfile.mkdtemp(prefix="eddis-bench-"))
        self.proc = subprocess.Popen([sys.executable, "-m", "eddis.smb.server", "--run-dir", str(self.run_dir),
                                      "--create-run-dir", "--memory", memory], env=env)
        deadline = time.monotonic() + 60
        while not (self.run_dir / "servers" / "0.json").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit("the smb-server did not start")
            time.sleep(0.05)

    def stop(self):
        import shutil

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def launch(ranks, args):
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    server = None
    if args.server == "external" and ranks > 1:  # one rank communicates nothing
        server = SmbServer(env, args.memory)
        env["EDDIS_RUN_DIR"] = str(server.run_dir)
    try:
        return _launch(ranks, args, env)
    finally:
        if server is not None:
            server.stop()


def _launch(ranks, args, env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = ["mpirun", "--oversubscribe", "-n", str(ranks), sys.executable, __file__, "--worker",
           "--port", str(port), "--rounds", str(args.rounds), "--models", args.models,
           "--contenders", args.contenders]
    if ranks == 1:
        cmd += ["--single-rounds", str(args.single_rounds), "--build-shift", str(args.build_shift),
                "--device", args.device]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    results = {}
    for line in proc.stdout:
        if line.startswith("ROUNDS "):
            proc.wait()
            return json.loads(line[7:])
        if line.startswith("RESULTS "):
            results = json.loads(line[8:])
        else:
            print("   " + line.rstrip(), flush=True)
    proc.wait()
    return {k: max(v) for k, v in results.items()}


def table(best, models, ranks):
    lines = [f"\n{ranks} ranks, samples/s (best of rounds); ratio to DDP plain and to the best "
             "compressed DDP", "", "| model | contender | samples/s | vs DDP | vs best compressed DDP |",
             "|---|---|---|---|---|"]
    for m in models:
        ddp = best.get(f"ddp|{m}")
        ddp_c = max([best[k] for k in (f"ddp-fp16|{m}", f"ddp-bf16|{m}") if k in best] or [0]) or None
        for c in CONTENDERS:
            v = best.get(f"{c}|{m}")
            if v is None:
                continue
            r1 = f"{v / ddp:.2f}x" if ddp else "-"
            r2 = f"{v / ddp_c:.2f}x" if ddp_c else "-"
            lines.append(f"| {m} | {c} | {v:.1f} | {r1} | {r2} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--models", default="compute,comm")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--skip-single", action="store_true", help="skip the single-rank overhead run")
    p.add_argument("--single-rounds", type=int, default=60,
                   help="rounds of one step each of plain A, plain B and EDDIS per launch "
                        "in the single-rank overhead run")
    p.add_argument("--build-shift", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu",
                   help="where the single-rank overhead run trains (cpu, cuda); the ranks' run is on CPU")
    p.add_argument("--single-launches", type=int, default=3,
                   help="fresh processes the single-rank overhead run is repeated in")
    p.add_argument("--server", choices=["external", "embedded"], default="external",
                   help="EDDIS sync through an smb-server process (as eddis-train/Slurm run it, "
                        "default) or through the server embedded in rank 0 (plain mpirun)")
    p.add_argument("--memory", default="2G", help="memory of the external smb-server")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if args.ranks > 1:
        print(f"== {args.ranks} ranks ==", flush=True)
        best = launch(args.ranks, args)
        print(table(best, models, args.ranks))
    if not args.skip_single:
        print(f"\n== 1 rank: EDDIS overhead over plain PyTorch, {args.single_launches} launches of "
              f"{args.single_rounds} rounds ==", flush=True)
        # Each model in processes of its own: what one model's steps leave in the heap
        # changes where the next one's gradients land (the set_to_none lottery above).
        launches = [{} for _ in range(args.single_launches)]
        for m in models:
            for i in range(args.single_launches):
                launches[i].update(launch(1, argparse.Namespace(**{**vars(args), "models": m,
                                                                    "build_shift": i % 3})))
        print("\n| model | plain step | EDDIS step | EDDIS / plain A - 1, per launch | median | "
              "noise floor: plain B / plain A - 1, per launch |\n|---|---|---|---|---|---|")
        for m in [f"{m}|{label}" for m in models for label in ("set_to_none", "grads kept")]:
            sums = [overhead_summary(rounds[m]) for rounds in launches]
            over = [s[0] for s in sums]
            print(f"| {m.replace('|', ', ')} | {1e3 * statistics.median(s[2] for s in sums):.1f} ms "
                  f"| {1e3 * statistics.median(s[3] for s in sums):.1f} ms "
                  f"| {', '.join(f'{o:+.1f} %' for o in over)} | {statistics.median(over):+.1f} % "
                  f"| {', '.join(f'{s[1]:+.1f} %' for s in sums)} |")


if __name__ == "__main__":
    sys.exit(main())
