"""A sync training run that resumes: every batch is a function of (step, rank) alone, so a
run interrupted and resumed any number of times must end with the parameters of one
uninterrupted run. Usage: resumable_sync.py STEPS OUT.npz [SECONDS_PER_STEP]

``TEST_CRASH_AFTER_STEP=N``: rank 1 kills itself after step N on the launcher's first attempt
(EDDIS_RESTART_COUNT 0), as a node that fails mid-run would.
``TEST_CRASH_BEFORE_INIT=first`` (``always``): rank 1 dies of SIGSEGV before eddis.init() on the
launcher's first attempt (on every attempt), as a rank that Open MPI crashes in MPI_Init does."""
import os
import signal
import sys
import time

import numpy as np
import torch

import eddis.torch as eddis

steps, out = int(sys.argv[1]), sys.argv[2]
pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
crash_at = int(os.environ.get("TEST_CRASH_AFTER_STEP", "-1"))
crash_before_init = os.environ.get("TEST_CRASH_BEFORE_INIT")
if crash_before_init and os.environ["EDDIS_RANK"] == "1" and (
        crash_before_init == "always" or os.environ.get("EDDIS_RESTART_COUNT", "0") == "0"):
    # os.kill, not a real fault: the supervisor sees the same death by SIGSEGV
    os.kill(os.getpid(), signal.SIGSEGV)
eddis.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
optimizer = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters())
eddis.broadcast_parameters(model.state_dict(), root_rank=0)
start = eddis.resume(None, model, optimizer)
print(f"run {os.environ.get('SLURM_RESTART_COUNT', '0')}.{os.environ.get('EDDIS_RESTART_COUNT', '0')} "
      f"starts at step {start.step}", flush=True)
for step in range(start.step, steps):
    batch = torch.Generator().manual_seed(10_000 * step + eddis.rank())
    x, y = torch.randn(8, 16, generator=batch), torch.randn(8, 4, generator=batch)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    print(f"step {step + 1} done", flush=True)
    if step + 1 == crash_at and eddis.rank() == 1 and os.environ.get("EDDIS_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(pause)
if eddis.rank() == 0:
    np.savez(out, **{name: value.numpy() for name, value in model.state_dict().items()})
    print(f"finished {steps} steps", flush=True)
