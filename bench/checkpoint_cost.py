"""What a checkpoint of a whole run costs: seconds and bytes for the benchmark models.

    PYTHONPATH=src python bench/checkpoint_cost.py [--ranks 2] [--repeat 3] [--modes sync,easgd]
                                                   [--models compute,comm] [--dir DIR]

Launches ``eddis-train --local -n RANKS`` once per mode; inside, every model of
``bench/compare_torch.py`` (``compute``: 2.2 M parameters, ``comm``: 25 M) is
wrapped in a DistributedOptimizer (SGD with momentum, so the optimizer state is
as large as the parameters), trained a few steps, then checkpointed ``--repeat``
times with ``eddis.checkpoint`` (each a new step, so each writes a new folder)
and resumed once with ``eddis.resume``. Printed per model and mode: the median
seconds of a checkpoint and of a resume as rank 0 saw them (both are collective:
every rank waits for the slowest), and the bytes of one checkpoint folder on disk.
In sync rank 0 writes the model and optimizer state once; in easgd every worker
writes its own, plus the centre variable. This is a benchmark: it asserts nothing.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))


def folder_bytes(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def worker(args):
    import torch
    import torch.nn.functional as F

    import eddis.torch as eddis
    from compare_torch import MODELS, build_model

    eddis.init()
    torch.set_num_threads(1)
    results = []
    for name in args.models.split(","):
        model, shape = build_model(name)
        opt = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                         named_parameters=model.named_parameters())
        eddis.broadcast_parameters(model.state_dict(), root_rank=0)
        x = torch.randn(MODELS[name]["batch"], *shape)
        y = torch.randint(0, 10, (MODELS[name]["batch"],))
        folder = os.path.join(args.dir, f"{args.mode}-{name}")
        written, saves = None, []
        for _ in range(args.repeat):
            for _ in range(2):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            began = time.perf_counter()
            written = eddis.checkpoint(folder, model, opt)
            saves.append(time.perf_counter() - began)
        began = time.perf_counter()
        eddis.resume(written, model, opt)
        loaded = time.perf_counter() - began
        if eddis.rank() == 0:
            results.append({"model": name, "mode": args.mode, "save_s": statistics.median(saves),
                            "resume_s": loaded, "bytes": folder_bytes(written),
                            "parameters": sum(p.numel() for p in model.parameters())})
        opt.close()
    if eddis.rank() == 0:
        Path(args.out).write_text(json.dumps(results))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--modes", default="sync,easgd")
    p.add_argument("--models", default="compute,comm")
    p.add_argument("--dir", default=None, help="checkpoint folder (default: a temporary one, removed)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="sync", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="eddis-ckpt-bench-", dir=args.dir) as scratch:
        rows = []
        for mode in args.modes.split(","):
            out = os.path.join(scratch, f"{mode}.json")
            env = dict(os.environ, EDDIS_MODE=mode, OMP_NUM_THREADS="1", SMB_MEMORY="1G",
                       PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
            cmd = [sys.executable, "-m", "eddis.launch.train", "--local", "-n", str(args.ranks),
                   sys.executable, __file__, "--worker", "--mode", mode, "--models", args.models,
                   "--repeat", str(args.repeat), "--dir", scratch, "--out", out]
            subprocess.run(cmd, env=env, check=True, timeout=1800)
            rows += json.loads(Path(out).read_text())
    load = os.getloadavg()[0]
    print(f"\n{time.strftime('%Y-%m-%d %H:%M %Z')}, {args.ranks} ranks, load {load:.2f}, "
          f"median of {args.repeat} checkpoints")
    print("| model | parameters | mode | checkpoint s | resume s | bytes on disk | bytes / parameter |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['parameters'] / 1e6:.1f} M | {r['mode']} | {r['save_s']:.2f} | "
              f"{r['resume_s']:.2f} | {r['bytes'] / 1e6:.1f} MB | {r['bytes'] / r['parameters']:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
