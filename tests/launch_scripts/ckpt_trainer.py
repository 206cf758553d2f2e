"""The trainer of tests/test_checkpoint_resume.py: a small torch MLP (with dropout, so the RNG
states matter, and SGD with momentum, so the optimizer state does) on a fixed random data set.

    eddis-train --local -n 2 python ckpt_trainer.py --out DIR [--mode sync|easgd] [--steps N]
        [--ckpt DIR] [--checkpoint-at K [--go-on]] [--crash-commit-at K] [--step-seconds S]

sync: epochs over a DistributedSampler (shuffled) in batches of 4; stops after ``--steps``
optimizer steps in all (counting the steps of the run it resumed). easgd: the global learning
counter (EDDIS_TOTAL_ITERATIONS). ``--checkpoint-at K``: an explicit eddis.checkpoint after
step K, then the launch ends (sync with ``--go-on``: it trains on, and one launch gives both the
checkpoint and the uninterrupted run). ``--crash-commit-at K``: rank 0 dies between writing the
checkpoint of step K and committing it. Each rank writes ``DIR/rank-R.json``: the resumed
Start, the sample indices of every step it trained, its final parameters and counters.
"""
import argparse
import json
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", default="sync")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--checkpoint-at", type=int, default=None)
    ap.add_argument("--go-on", action="store_true")
    ap.add_argument("--crash-commit-at", type=int, default=None)
    ap.add_argument("--step-seconds", type=float, default=0.0)
    ap.add_argument("--balanced", action="store_true",
                    help="sync on a fixed global batch of 8 (BalancedBatchSampler), without dropout")
    args = ap.parse_args()

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import eddis.torch as eddis
    from eddis.core.checkpoint import save as checkpoint_run
    from eddis.core.checkpoint.resume import Start
    from eddis.core.progress import counter as progress

    eddis.init()
    rank = eddis.rank()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if args.crash_commit_at is not None and rank == 0:
        def crash(folder):
            if os.path.basename(folder).startswith(f".ckpt-{args.crash_commit_at:08d}."):
                os._exit(3)
        checkpoint_run.before_commit = crash

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(40, 6, generator=g)
    ys = torch.randint(0, 3, (40,), generator=g)
    dataset = torch.utils.data.TensorDataset(xs, ys, torch.arange(40))
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Identity() if args.balanced else nn.Dropout(0.2),
                          nn.Linear(16, 3))
    optimizer = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                           named_parameters=model.named_parameters(), mode=args.mode)
    eddis.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.manual_seed(100 + rank)   # dropout differs per rank: its RNG must be restored per rank
    folder = args.ckpt or os.environ.get("EDDIS_CHECKPOINT_DIR")
    start = eddis.resume(folder, model, optimizer) if folder else Start()
    result = {"start": start.as_dict(), "order": [], "steps": 0}
    if args.mode == "easgd" and start.resumed:
        state = optimizer._eddis.hetero
        result["centre_after_resume"] = state.averager.read_center().tolist()
        result["params_after_resume"] = state.gather().tolist()   # in the centre's (bucket plan) layout

    def train_step(x, y):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        result["steps"] += 1
        if args.step_seconds:
            time.sleep(args.step_seconds)

    def finish():
        result["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
        ctl = progress.controller()
        if ctl is not None:
            # the counter is exact once every rank has stopped: a last claim that crosses the
            # total gives its surplus back a moment later (eddis.core.progress.counter)
            eddis.barrier()
            result["counter"] = ctl.counter.read()
            result["steps_done"] = ctl.steps_done
        with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
            json.dump(result, f)

    if args.mode == "sync":
        # its own generator: a DataLoader draws a seed from the global RNG at each epoch start,
        # which a resumed epoch would draw again
        if args.balanced:
            sampler = eddis.BalancedBatchSampler(dataset, 8, shuffle=True, seed=7, optimizer=optimizer)
            loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                                 generator=torch.Generator().manual_seed(3))
        else:
            sampler = eddis.DistributedSampler(dataset, shuffle=True, seed=7)
            loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler,
                                                 generator=torch.Generator().manual_seed(3))
        step = start.step
        for epoch in range(start.epoch, 1000):
            sampler.set_epoch(epoch)
            for i, (x, y, idx) in enumerate(loader):
                if start.done(epoch, i):
                    continue
                if step >= args.steps:
                    break
                result["order"].append([epoch, i] + idx.tolist())
                train_step(x, y)
                step += 1
                if step == args.checkpoint_at:
                    result["checkpoint"] = eddis.checkpoint(args.ckpt, model, optimizer, note="explicit")
                    result["steps_at_checkpoint"] = len(result["order"])
                    if not args.go_on:
                        finish()
                        return 0
            if step >= args.steps:
                break
    else:
        g2 = torch.Generator().manual_seed(1000 + rank)
        done_here = 0
        while not eddis.should_stop():
            batch = torch.randint(0, 40, (4,), generator=g2)
            train_step(xs[batch], ys[batch])
            done_here += 1
            if done_here == args.checkpoint_at:
                result["checkpoint"] = eddis.checkpoint(args.ckpt, model, optimizer)
                finish()
                return 0
    finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
