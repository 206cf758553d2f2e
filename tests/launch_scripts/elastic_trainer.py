"""An easgd/hybrid trainer for the elastic tests (EDDIS_ELASTIC=1 under eddis-train --local).

``--kill-rank R --kill-step S`` and ``--await-loss``: see elastic_steps.py. ``--pause-rank R --pause-step S``: rank R writes
``<out>/paused.R`` before its step S (S < 0: before eddis.init(), so before its training
started) and waits there (at most PAUSE_SECONDS) for the test to kill its node. ``--groups G`` (hybrid): G groups of consecutive ranks, set
as EDDIS_GROUP/EDDIS_NUM_GROUPS before eddis.init(), as the launcher does for the
components of a Slurm hetjob. Every survivor writes ``<out>/<rank>.json`` (its
steps, the global learning counter at the end, the servers of its hybrid group's
reduction pool, and its checkpoint schedule's request counter); the final model (the centre) goes
to ``<out>/model.pt`` through eddis.save_checkpoint. ``--step-seconds S``: every step sleeps S seconds first; ``--say-step S``: every rank says when it
reaches its step S. ``--resume PATH``: eddis.resume(PATH) before
training (a checkpoint, or a folder of them: none there is a fresh start), which also gives the
periodic checkpoints (EDDIS_CHECKPOINT_INTERVAL) the model to save; the json then has the Start.
"""
import argparse
import json
import os
import time

import elastic_steps

PAUSE_SECONDS = 120

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", default="easgd", choices=["easgd", "hybrid", "sync"])
p.add_argument("--total", type=int, default=400)
elastic_steps.add_arguments(p)
p.add_argument("--pause-rank", type=int, default=-1)
p.add_argument("--pause-step", type=int, default=10)
p.add_argument("--groups", type=int, default=0)
p.add_argument("--resume", default=None)
p.add_argument("--step-seconds", type=float, default=0.0)
p.add_argument("--say-step", type=int, default=-1)
args = p.parse_args()

if args.groups:
    rank, size = int(os.environ["EDDIS_RANK"]), int(os.environ["EDDIS_SIZE"])
    os.environ["EDDIS_GROUP"] = str(rank * args.groups // size)
    os.environ["EDDIS_NUM_GROUPS"] = str(args.groups)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import eddis.torch as eddis  # noqa: E402
from eddis.core.checkpoint import schedule as checkpoint_run  # noqa: E402
from eddis.core.comm import connection
from eddis.smb.mirror import MirroredCounter  # noqa: E402

elastic_steps.before_init(args)
if args.pause_step < 0 and int(os.environ["EDDIS_RANK"]) == args.pause_rank:
    open(os.path.join(args.out, f"paused.{args.pause_rank}"), "w").close()
    time.sleep(PAUSE_SECONDS)
eddis.init()
rank = eddis.rank()
torch.manual_seed(0)
truth = torch.randn(16, 1)
model = torch.nn.Linear(16, 1)
optimizer = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(), mode=args.mode)
eddis.broadcast_parameters(model.state_dict(), root_rank=0)
start = eddis.resume(args.resume, model, optimizer) if args.resume else None
ctl = eddis.configure_progress(total=args.total)
generator = torch.Generator().manual_seed(100 + rank)
step = 0
while not eddis.should_stop():
    elastic_steps.before_step(args, rank, step)
    if rank == args.pause_rank and step == args.pause_step:
        open(os.path.join(args.out, f"paused.{rank}"), "w").close()
        time.sleep(PAUSE_SECONDS)
    time.sleep(args.step_seconds)
    if step == args.say_step:
        print(f"rank {rank} reached step {step}", flush=True)
    x = torch.randn(32, 16, generator=generator)
    optimizer.zero_grad()
    F.mse_loss(model(x), x @ truth).backward()
    optimizer.step()
    step += 1
eddis.save_checkpoint(os.path.join(args.out, "model.pt"), model, optimizer)
# with EDDIS_CHECKPOINT_DIR: the checkpoint schedule's request counter, read after any loss
schedules = list(checkpoint_run._schedules.values())
with open(os.path.join(args.out, f"{rank}.json"), "w") as f:
    json.dump({"rank": rank, "steps": ctl.steps_done, "counter": ctl.counter.read(),
               "lost_servers": sorted(connection.smb_client().lost_servers),
               "group_servers": getattr(optimizer.reducer, "servers", None) if args.mode == "hybrid" else None,
               "checkpoint_requests": [{"mirrored": isinstance(s.requests, MirroredCounter),
                                        "value": s.requests.read()} for s in schedules],
               "start": None if start is None else {"path": start.path, "step": start.step},
               "error": float((model.weight.detach().reshape(-1, 1) - truth).norm())}, f)
print(f"rank {rank} finished after {ctl.steps_done} steps")
