"""An elastic training script in the way Horovod's elastic documentation shows it, with
only the import changed (``import eddis.torch as hvd``). Run with EDDIS_MODE=easgd and
EDDIS_ELASTIC=1; ELASTIC_TEST_KILL=rank:batch (a test harness hook, not Horovod's) makes
that rank SIGKILL itself at that batch of the second epoch. Writes <OUT>/<rank>.txt."""
import os
import signal
import sys

import torch
import torch.nn.functional as F

import eddis.torch as hvd

EPOCHS, BATCHES = 3, 20
out = sys.argv[1]
kill_rank, kill_batch = (int(v) for v in os.environ.get("ELASTIC_TEST_KILL", "-1:0").split(":"))

hvd.init()
torch.manual_seed(hvd.rank())          # different on purpose: sync() must make them equal
model = torch.nn.Linear(8, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                     named_parameters=model.named_parameters())
truth = torch.ones(8, 1)
commits = []


@hvd.elastic.run
def train(state):
    first = hvd.allgather_object(model.weight.detach().sum().item())
    assert len(set(first)) == 1, f"state.sync() left the ranks' models apart: {first}"
    generator = torch.Generator().manual_seed(100 + hvd.rank())
    for state.epoch in range(state.epoch, EPOCHS):
        for state.batch in range(state.batch, BATCHES):
            if hvd.rank() == kill_rank and state.epoch == 1 and state.batch == kill_batch:
                os.kill(os.getpid(), signal.SIGKILL)
            x = torch.randn(16, 8, generator=generator)
            optimizer.zero_grad()
            F.mse_loss(model(x), x @ truth).backward()
            optimizer.step()
            if state.batch % 5 == 0:
                state.commit()
                commits.append((state.epoch, state.batch))
        state.batch = 0
    state.commit()


state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0)
train(state)
# restore() goes back to the last commit, not to where the values were moved since
committed = model.weight.detach().clone()
state.epoch, state.batch = 99, 99
with torch.no_grad():
    model.weight.add_(1.0)
state.restore()
assert (state.epoch, state.batch) == (EPOCHS - 1, 0), (state.epoch, state.batch)
assert torch.equal(model.weight.detach(), committed)
with open(os.path.join(out, f"{hvd.rank()}.txt"), "w") as f:
    f.write(f"{len(commits)} {state.epoch} {state.batch}\n")
print(f"HOROVOD-STYLE ELASTIC OK rank {hvd.rank()}")
