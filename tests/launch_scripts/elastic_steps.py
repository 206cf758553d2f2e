"""What the elastic trainers (elastic_trainer.py, elastic_tf_trainer.py) do before each step.

``--kill-rank R --kill-step S``: rank R sends itself SIGKILL before its step S, as a crashed
node would end it; ``--kill-step -1``: before ``eddis.init()`` (:func:`before_init`), while the
others start up. ``--await-loss``: every other rank sleeps AWAIT_SECONDS a step until it
counts rank R as lost, so that training goes on after the loss is known, however fast the
steps and however late rank R reaches step S; it does not stop stepping, since a checkpoint
that rank R asked for before it died still needs the others at their step boundaries. After
that, every step of theirs sleeps AFTER_LOSS_SECONDS: the survivors see the loss up to
AWAIT_SECONDS apart, and the first to see it could otherwise use up every iteration left (a
few hundred, at over 1000 steps a second) while the others still sleep, leaving nothing of the
run after the loss to the rest (seen: rank 3 ran 228 steps in 0.14 s, so rank 1 never asked
for a checkpoint).
"""
import os
import signal
import time

AWAIT_SECONDS = 0.3
AFTER_LOSS_SECONDS = 0.03


def add_arguments(parser):
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=10)
    parser.add_argument("--await-loss", action="store_true")
    parser.set_defaults(loss_seen=False)


def before_init(args):
    """Before eddis.init(): the launcher's rank is all there is to go by."""
    if args.kill_step < 0 and int(os.environ["EDDIS_RANK"]) == args.kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)


def before_step(args, rank, step):
    from eddis.core.comm import elastic

    if rank == args.kill_rank and step == args.kill_step:
        os.kill(os.getpid(), signal.SIGKILL)
    if args.await_loss and rank != args.kill_rank:
        members = elastic.current()   # set up at the first step
        if members is not None and args.kill_rank in members.lost():
            args.await_loss = False
            args.loss_seen = True
        else:
            time.sleep(AWAIT_SECONDS)
    elif args.loss_seen:
        time.sleep(AFTER_LOSS_SECONDS)
