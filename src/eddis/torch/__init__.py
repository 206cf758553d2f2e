"""EDDIS for PyTorch: ``import eddis.torch as eddis`` (or ``as hvd`` in a Horovod script).

    eddis.init()
    torch.manual_seed(0)
    model = Net()
    optimizer = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters())
    eddis.broadcast_parameters(model.state_dict(), root_rank=0)
    eddis.broadcast_optimizer_state(optimizer, root_rank=0)
    sampler = eddis.DistributedSampler(dataset)
    for epoch in ...:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()    # buckets go on the wire during backward
            optimizer.step()                   # waits only for what is not done yet

Names and signatures follow Horovod's (see docs/pytorch-conversion.md for the
differences). The machinery lives in :mod:`eddis.core`.
"""

import torch as _torch

from ..core.basics import basics as _basics
from . import buffers  # noqa: F401  (torch tensors as SMB buffers, bfloat16 included)
from . import elastic  # noqa: F401  (hvd.elastic: run, TorchState)
from .checkpointing import checkpoint, resume
from .compression import Compression
from .functions import broadcast_optimizer_state, broadcast_parameters
from .hetero import (BalancedBatchSampler, balanced_slice, configure_progress, final_model,
                     global_step, progress_counts, reset_progress, save_checkpoint, should_stop)
from .ops import (Adasum, Average, Max, Min, ReduceOp, Sum, allgather, allgather_async, allgather_object,
                  allreduce, allreduce_, allreduce_async, allreduce_async_, barrier, broadcast, broadcast_,
                  broadcast_async, broadcast_async_, broadcast_object, poll, synchronize)
from .optimizer import DistributedOptimizer
from .sampler import DistributedSampler
from .timeline_hooks import trace_module  # FORWARD/BACKWARD events; EDDIS_TIMELINE_MODULE_HOOKS
from ..timeline import start_timeline, stop_timeline  # collective after init(); see docs/profiling.md


# init, rank, ..., the *_built() queries: the same objects as eddis.tensorflow's
globals().update(_basics.bindings(lambda: _torch.version.cuda is not None))


__all__ = [
    *_basics.SHARED,
    "DistributedOptimizer", "Compression", "Average", "Sum", "Min", "Max", "Adasum", "ReduceOp",
    "broadcast_parameters", "broadcast_optimizer_state", "allreduce", "allreduce_", "broadcast",
    "broadcast_", "allgather", "allgather_object", "broadcast_object", "barrier",
    "allreduce_async", "allreduce_async_", "allgather_async", "broadcast_async", "broadcast_async_", "poll",
    "synchronize",
    "DistributedSampler",
    "should_stop", "global_step", "configure_progress", "progress_counts", "reset_progress", "final_model",
    "save_checkpoint", "checkpoint", "resume", "balanced_slice", "BalancedBatchSampler", "start_timeline", "stop_timeline", "trace_module",
]
