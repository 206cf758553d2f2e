"""A Horovod elastic training script with only the import changed (``import eddis.torch as
hvd``), run in mode sync with EDDIS_MAX_RESTARTS: a lost rank ends the trainers, the launcher
starts them again, and ``hvd.elastic.run`` goes on from the last ``state.commit()``, which in
sync is a checkpoint of the run. A commit records the batches of the epoch done, so a
restarted run trains each batch exactly once: its final model is the uninterrupted run's.
Usage: torch_elastic_sync_style.py OUT.npz

ELASTIC_TEST_KILL_AFTER=epoch:batch (a test harness hook, not Horovod's): rank 1 SIGKILLs
itself right after the commit at that point, on the launcher's first attempt; with
ELASTIC_TEST_DAMAGE_NEWEST=FOLDER (the commits' folder) it first flips 64 bytes in the middle
of the newest commit's rank-00000.pt, as a disk would."""
import os
import signal
import sys

import numpy as np
import torch
import torch.nn.functional as F

import eddis.torch as hvd

EPOCHS, BATCHES, COMMIT_EVERY = 2, 10, 4
out = sys.argv[1]
kill_after = os.environ.get("ELASTIC_TEST_KILL_AFTER")
attempt = os.environ.get("EDDIS_RESTART_COUNT", "0")
damage_in = os.environ.get("ELASTIC_TEST_DAMAGE_NEWEST")

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=model.named_parameters())


def batch_of(epoch, batch):
    generator = torch.Generator().manual_seed(1000 * epoch + 10 * batch + hvd.rank())
    x = torch.randn(16, 8, generator=generator)
    return x, x.sum(dim=1, keepdim=True)


def damage_newest_commit(folder):
    newest = max(name for name in os.listdir(folder) if name.startswith("ckpt-"))   # ckpt-<8 digits>
    path = os.path.join(folder, newest, "rank-00000.pt")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        data = f.read(64)
        f.seek(-len(data), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))


@hvd.elastic.run
def train(state):
    print(f"attempt {attempt} starts at epoch {state.epoch} batch {state.batch}", flush=True)
    for state.epoch in range(state.epoch, EPOCHS):
        for batch in range(state.batch, BATCHES):
            x, y = batch_of(state.epoch, batch)
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            state.batch = batch + 1
            if state.batch % COMMIT_EVERY == 0:
                state.commit()
                if kill_after == f"{state.epoch}:{state.batch}" and hvd.rank() == 1 and attempt == "0":
                    if damage_in:
                        damage_newest_commit(damage_in)
                    os.kill(os.getpid(), signal.SIGKILL)
        state.batch = 0
    state.commit()


train(hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0))
if hvd.rank() == 0:
    np.savez(out, **{name: value.detach().numpy() for name, value in model.state_dict().items()})
print(f"HOROVOD-STYLE ELASTIC SYNC OK rank {hvd.rank()}", flush=True)
