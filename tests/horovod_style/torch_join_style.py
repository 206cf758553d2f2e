"""A Horovod PyTorch script with uneven data per rank, finished with hvd.join(); only the
import differs from the way Horovod's documentation writes it."""
import torch
import torch.nn.functional as F

import eddis.torch as hvd

hvd.init()
torch.manual_seed(1234)
torch.set_num_threads(1)

# an uneven split: rank 0 gets 3 more batches than the others
data = torch.randn(40 + 24 * hvd.size(), 6, generator=torch.Generator().manual_seed(0))
target = data.sum(dim=1, keepdim=True)
mine = slice(0, 64) if hvd.rank() == 0 else slice(40 + 24 * hvd.rank(), 64 + 24 * hvd.rank())
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data[mine], target[mine]), batch_size=8)

model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

for epoch in range(2):
    for x, y in loader:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    last = hvd.join()
    assert last == 0, f"rank 0 has the most batches, join() said {last}"

flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
assert torch.equal(hvd.broadcast(flat, root_rank=last, name="check"), flat), "ranks' models differ"
print(f"HOROVOD-STYLE OK rank {hvd.rank()}", flush=True)
