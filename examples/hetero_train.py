"""Training on mixed GPU generations with EDDIS: easgd, hybrid or balanced sync.

An MLP learns scikit-learn's bundled digits (no download). The job runs a
fixed number of iterations counted job-wide by the global learning counter,
so faster ranks simply do more of them; the final model (the centre variable
for easgd/hybrid) is written once to --checkpoint.

    # 4 ranks on one machine, rank 3 slowed 2x (a testing aid standing in for an older GPU)
    EDDIS_SIMULATE_SLOWDOWN=3:2.0 eddis-train --local -n 4 examples/hetero_train.py --mode easgd
    EDDIS_SIMULATE_SLOWDOWN=3:2.0 eddis-train --local -n 4 examples/hetero_train.py --mode sync --balance
    # hybrid: sync inside each hetjob component (one per GPU type), EASGD between them
    eddis submit --gpus a100:4,v100:4 examples/hetero_train.py --mode hybrid

It reaches about 0.96 test accuracy in every mode with the defaults. See
docs/heterogeneous.md.
"""
import argparse
import importlib.util
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import eddis.torch as eddis


def load_digits():
    """scikit-learn's bundled digits, read from its data file (no sklearn import needed)."""
    package = Path(importlib.util.find_spec("sklearn").submodule_search_locations[0])
    data = np.loadtxt(package / "datasets" / "data" / "digits.csv.gz", delimiter=",")
    x = torch.from_numpy((data[:, :-1] / 16.0).astype(np.float32))
    y = torch.from_numpy(data[:, -1].astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(x)))
    test, train = order[:360], order[360:]
    return x[train], y[train], x[test], y[test]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="easgd", choices=["sync", "easgd", "hybrid"])
    p.add_argument("--balance", action="store_true", help="balanced sync (with --mode sync)")
    p.add_argument("--iterations", type=int, default=1600,
                   help="total iterations of --batch samples, all ranks together")
    p.add_argument("--batch", type=int, default=32, help="samples per rank and iteration")
    p.add_argument("--lr", type=float, default=0.2,
                   help="the rate of synchronous training at the global batch, in every mode: easgd's "
                        "and hybrid's exchanges average the workers' moves (docs/heterogeneous.md)")
    p.add_argument("--checkpoint", default="hetero_model.pt")
    args = p.parse_args()

    eddis.init()
    rank, size = eddis.rank(), eddis.size()
    xtr, ytr, xte, yte = load_digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                           named_parameters=model.named_parameters(),
                                           mode=args.mode, balance=args.balance)
    eddis.broadcast_parameters(model.state_dict(), root_rank=0)
    eddis.configure_progress(total=args.iterations)

    if args.mode == "sync":
        # one global batch per step, cut by speed under --balance
        dataset = torch.utils.data.TensorDataset(xtr, ytr)
        sampler = eddis.BalancedBatchSampler(dataset, global_batch_size=args.batch * size)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)

        def batches():
            epoch = 0
            while True:
                sampler.set_epoch(epoch)
                yield from loader
                epoch += 1
    else:
        # asynchronous: every rank draws its own mini-batches, as many as it gets to
        def batches():
            rng = np.random.default_rng(1000 + rank)
            while True:
                idx = torch.from_numpy(rng.integers(0, len(xtr), args.batch))
                yield xtr[idx], ytr[idx]

    start = time.perf_counter()
    data = batches()
    next_report = 0
    while not eddis.should_stop():
        x, y = next(data)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if rank == 0 and eddis.global_step() >= next_report:
            print(f"iteration {eddis.global_step()}/{args.iterations}: loss {loss.item():.3f}", flush=True)
            next_report += args.iterations // 4
    elapsed = time.perf_counter() - start

    eddis.save_checkpoint(args.checkpoint, model, optimizer, iterations=args.iterations)
    with torch.no_grad():
        accuracy = (model(xte).argmax(1) == yte).float().mean().item()
    counts = eddis.progress_counts()
    if rank == 0:
        print(f"mode {args.mode}{' (balanced)' if args.balance else ''}: {elapsed:.1f} s, "
              f"iterations per rank {counts}, test accuracy {accuracy:.3f}, model in {args.checkpoint}")
    optimizer.close()
    eddis.shutdown()


if __name__ == "__main__":
    main()
