"""An easgd/hybrid training run that resumes from EDDIS_CHECKPOINT_DIR (eddis.resume) and is
scored on a fixed held-out set. Usage::

    resumable_hetero.py OUT.json [--mode easgd|hybrid] [--groups G] [--step-seconds S]
                        [--request-at K]

It trains until the global learning counter reaches EDDIS_TOTAL_ITERATIONS: a small MLP on
three Gaussian classes whose best accuracy is well below 100 %, so that a run trained to its
plateau scores the same within a point however its steps were split between runs. A rank's
batch is a function of (its step, its rank) alone. ``--groups G`` (hybrid): G groups of
consecutive ranks, set as EDDIS_GROUP/EDDIS_NUM_GROUPS before eddis.init(), as the launcher
does for the components of a Slurm hetjob. ``--step-seconds S``: a pause after every step, so
that a run is long in steps but light on the CPUs. ``--request-at K``: rank 0 asks for a
checkpoint after its K-th step of the first run (as Slurm's warning signal would), so every
rank writes one at its next step boundary and stops with status 75.

``--end-race begun-first`` (needs --request-at K): the request reaches rank 0 just after the
last step boundary of the ranks that do not step with it, and before they find the total
reached: rank 0 waits in its step K until they all are past their last boundary, then asks;
they wait until rank 0 has begun the save, which they must join at their end of training.
They start their second step (after the first, whose set-up is collective) only once rank 0
runs its step K, so that they cannot use up the counter before rank 0 has claimed it (a slow
rank 0 unit would otherwise end its training before step K, with nothing requested).
``--end-race ended-first``: a rank at its last step waits until every other rank has ended its
training, then asks: the request must be refused (training complete). The waits are on SMB
counters, bounded.

Each rank prints ``run R.E starts at step S`` (R: SLURM_RESTART_COUNT, E: EDDIS_RESTART_COUNT)
and, when a requested checkpoint stops it, ``stopped after step N``. Rank 0 writes OUT.json
when the counter has reached the total: the held-out accuracy of the final model (the centre),
the counter, every rank's steps in this run and in all, where each rank started and the
centre variable as the resume restored it.
"""
import argparse
import json
import os
import time

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--mode", default="easgd", choices=["easgd", "hybrid"])
p.add_argument("--groups", type=int, default=0)
p.add_argument("--step-seconds", type=float, default=0.0)
p.add_argument("--request-at", type=int, default=None)
p.add_argument("--end-race", choices=["begun-first", "ended-first"], default=None)
args = p.parse_args()

if args.groups:
    rank, size = int(os.environ["EDDIS_RANK"]), int(os.environ["EDDIS_SIZE"])
    os.environ["EDDIS_GROUP"] = str(rank * args.groups // size)
    os.environ["EDDIS_NUM_GROUPS"] = str(args.groups)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import eddis.torch as eddis  # noqa: E402
from eddis.core.checkpoint import schedule as checkpoint_run  # noqa: E402
from eddis.core.progress import counter as progress
from eddis.core.comm import connection, groups
from eddis.errors import CheckpointStop  # noqa: E402

FEATURES, CLASSES, BATCH = 8, 3, 32
RACE_WAIT_SECONDS = 60


def at_last_step():
    """Whether this rank's running step is its last: nothing left of its claim, none to claim.

    The running claim tells the ranks of a group (hybrid) alike whether it took the counter to
    its end. A member must not read the counter live: the group's reduction completes during
    the backward, so its leader may already have made the group's next claim when the member
    looks, and the two would disagree. A rank that steps alone may: the counter then reached
    the total by another's claim, and its own next claim is empty."""
    ctl = progress.controller()
    if ctl.reserved:
        return False
    if ctl.position + 2 * ctl.unit > ctl.total:   # not a whole unit left after this step
        return True
    return ctl.unit == 1 and ctl.counter.read() >= ctl.total


def gaussian_classes(count, seed):
    """``count`` samples of three overlapping Gaussian classes, the same for every rank."""
    centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(1)) * 0.8
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (count,), generator=g)
    return centres[labels] + torch.randn(count, FEATURES, generator=g), labels


eddis.init()
rank = eddis.rank()
train_x, train_y = gaussian_classes(4096, seed=2)
held_out_x, held_out_y = gaussian_classes(3000, seed=3)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))
optimizer = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                                       named_parameters=model.named_parameters(), mode=args.mode)
eddis.broadcast_parameters(model.state_dict(), root_rank=0)
start = eddis.resume(None, model, optimizer)
run = f"{os.environ.get('SLURM_RESTART_COUNT', '0')}.{os.environ.get('EDDIS_RESTART_COUNT', '0')}"
print(f"run {run} starts at step {start.step}", flush=True)
# what the resume put into this job's servers, before any step moves it
centre_after_resume = optimizer._eddis.hetero.averager.read_center().tolist() if start.resumed else None
if args.end_race is not None:
    steps_with_rank0 = groups.group_members()[0] if args.mode == "hybrid" else [0]
    client = connection.smb_client()
    past_last_boundary = client.counter("test.end-race.past-last-boundary")
    training_ended = client.counter("test.end-race.ended")
    rank0_at_request = client.counter("test.end-race.rank0-at-request")
step = start.step
try:
    while not eddis.should_stop():
        if args.end_race == "begun-first" and rank not in steps_with_rank0 and step == start.step + 1:
            rank0_at_request.wait_for(1, RACE_WAIT_SECONDS)
        batch = torch.randint(0, len(train_y), (BATCH,), generator=torch.Generator().manual_seed(
            10_000 * step + rank))
        optimizer.zero_grad()
        F.cross_entropy(model(train_x[batch]), train_y[batch]).backward()
        step += 1   # before step(): a requested checkpoint stops the run inside it, after the update
        if args.end_race == "begun-first" and rank == 0 and step == args.request_at:
            rank0_at_request.fetch_add(1)
            past_last_boundary.wait_for(eddis.size() - len(steps_with_rank0), RACE_WAIT_SECONDS)
            eddis.request_checkpoint("the test asks for one")
        if args.end_race == "ended-first" and at_last_step():
            training_ended.wait_for(eddis.size() - 1, RACE_WAIT_SECONDS)
            eddis.request_checkpoint("the test asks for one after the others ended")
        last = args.end_race == "begun-first" and rank not in steps_with_rank0 and at_last_step()
        optimizer.step()
        if last:
            past_last_boundary.fetch_add(1)
            saves = checkpoint_run.schedule_of(optimizer._eddis.hetero).saves
            saves.wait_for(1, RACE_WAIT_SECONDS)   # rank 0 began the save
        if args.request_at is not None and args.end_race is None and rank == 0 and not start.resumed \
                and step == args.request_at:
            eddis.request_checkpoint("the test asks for one")
        time.sleep(args.step_seconds)
except CheckpointStop:
    print(f"stopped after step {step}", flush=True)
    raise
if args.end_race is not None:
    training_ended.fetch_add(1)
eddis.final_model(optimizer)
with torch.no_grad():
    accuracy = float((model(held_out_x).argmax(1) == held_out_y).float().mean())
ranks = eddis.allgather_object({"start": start.step, "steps": step, "this_run": step - start.step})
counter = progress.controller().counter.read()
if rank == 0:
    with open(args.out, "w") as f:
        json.dump({"accuracy": accuracy, "counter": counter, "ranks": ranks,
                   "centre_after_resume": centre_after_resume}, f)
print(f"finished at step {step}: held-out accuracy {accuracy:.4f}, counter {counter}", flush=True)
