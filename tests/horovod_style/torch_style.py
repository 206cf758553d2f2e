"""A Horovod PyTorch script in the style of Horovod's documentation; only the import differs."""
import torch
import torch.nn.functional as F

import eddis.torch as hvd

hvd.init()
torch.manual_seed(1234)
torch.set_num_threads(1)
if torch.cuda.is_available() and hvd.cuda_built():
    torch.cuda.set_device(hvd.local_rank())
assert not (hvd.nccl_built() or hvd.gloo_built() or hvd.ddl_built() or hvd.ccl_built() or hvd.rocm_built())
assert hvd.mpi_built() and hvd.mpi_enabled() and not hvd.gloo_enabled()
assert 0 <= hvd.local_rank() < hvd.local_size() <= hvd.size() and 0 <= hvd.cross_rank() < hvd.cross_size()
hvd.mpi_threads_supported()

data = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
target = data.sum(dim=1, keepdim=True)
dataset = torch.utils.data.TensorDataset(data, target)
sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)

torch.manual_seed(hvd.rank())  # different initial weights: the broadcast must fix them
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
lr_scaler = hvd.local_size() if hvd.nccl_built() else hvd.size()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler, momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
compression = hvd.Compression.fp16
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression, op=hvd.Average)

for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    avg = hvd.allreduce(loss.detach(), name="avg_loss")
    if hvd.rank() == 0:
        print(f"epoch {epoch} loss {avg.item():.4f}", flush=True)

flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
assert torch.equal(hvd.broadcast(flat, root_rank=0, name="check"), flat), "ranks' models differ"
gathered = hvd.allgather(torch.tensor([[float(hvd.rank())]]))
assert gathered.reshape(-1).tolist() == [float(r) for r in range(hvd.size())]
assert hvd.broadcast_object({"epoch": 2} if hvd.rank() == 0 else None, root_rank=0) == {"epoch": 2}
assert hvd.allgather_object(hvd.rank()) == list(range(hvd.size()))
total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)
assert total.item() == hvd.size()
print(f"HOROVOD-STYLE OK rank {hvd.rank()}", flush=True)
