"""Train a small CNN on scikit-learn's bundled digits data set with EDDIS.

Runs anywhere EDDIS runs (nothing is downloaded):

    mpirun -n 2 python examples/torch_train.py              # plain MPI, embedded SMB server
    eddis-train --local -n 2 examples/torch_train.py         # the EDDIS launcher, no Slurm
    srun --mpi=pmix eddis-train examples/torch_train.py      # inside scripts/eddis_job.sh

Every line that differs from single-process PyTorch is marked ``# EDDIS``;
docs/pytorch-conversion.md walks through them. Expected result with the
defaults (15 epochs, global batch 64): test accuracy about 0.97 on any number
of ranks.
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

import eddis.torch as eddis  # EDDIS


class DigitsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_data():
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)  # (N, 1, 8, 8)
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (all ranks together)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--mode", default=None, help="sync or allreduce (default: EDDIS_MODE)")
    parser.add_argument("--compression", default=None, choices=["none", "fp16", "bf16"],
                        help="gradient wire format (default: EDDIS_COMPRESSION)")
    parser.add_argument("--shares", default=None,
                        help="per-rank shares of every batch, e.g. 1,2 (default: equal)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    eddis.init()  # EDDIS
    rank, size = eddis.rank(), eddis.size()  # EDDIS
    torch.manual_seed(args.seed)
    train_set, test_set = load_data()

    shares = [float(s) for s in args.shares.split(",")] if args.shares else None  # EDDIS
    batch_sizes = eddis.split_sizes(args.batch_size, shares or [1.0] * size)  # EDDIS: this rank's part
    sampler = eddis.DistributedSampler(train_set, shuffle=True, seed=args.seed, weights=shares)  # EDDIS
    loader = DataLoader(train_set, batch_size=batch_sizes[rank], sampler=sampler, drop_last=True)
    # every rank must take the same number of steps per epoch
    steps = len(sampler.indices()) // batch_sizes[rank]
    steps = int(eddis.allreduce(torch.tensor([steps]), op=eddis.Min).item())  # EDDIS

    model = DigitsNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    compression = getattr(eddis.Compression, args.compression) if args.compression else None
    optimizer = eddis.DistributedOptimizer(  # EDDIS
        optimizer, named_parameters=model.named_parameters(), mode=args.mode, compression=compression)
    optimizer.set_sample_count(batch_sizes[rank])  # EDDIS: weight of this rank in the average
    eddis.broadcast_parameters(model.state_dict(), root_rank=0)  # EDDIS
    eddis.broadcast_optimizer_state(optimizer, root_rank=0)  # EDDIS

    test_sampler = eddis.DistributedSampler(test_set, shuffle=False)  # EDDIS
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # EDDIS
        model.train()
        total_loss = 0.0
        for _, (x, y) in zip(range(steps), loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total_loss += loss.item()
        accuracy = evaluate(model, test_loader)
        mean_loss = eddis.allreduce(torch.tensor(total_loss / steps)).item()  # EDDIS
        if rank == 0:
            print(f"epoch {epoch + 1:2d}  train loss {mean_loss:.4f}  test accuracy {accuracy:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    if rank == 0:
        samples = args.epochs * steps * args.batch_size
        print(f"ranks {size}  mode {optimizer.reducer.mode}  {samples / elapsed:.0f} samples/s", flush=True)
        print(f"test accuracy: {accuracy:.4f}", flush=True)
    eddis.shutdown()  # EDDIS


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    correct = torch.zeros(2)
    for x, y in loader:
        correct += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
    correct = eddis.allreduce(correct, op=eddis.Sum)  # EDDIS: counts of all ranks
    return (correct[0] / correct[1]).item()


if __name__ == "__main__":
    main()
