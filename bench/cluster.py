"""Every contender on the emulated cluster, side by side: samples/s, time to target, bytes on the links.

    python bench/cluster.py --quick                       # one configuration, under 10 minutes
    python bench/cluster.py [--links 1gbit,10gbit] [--layouts 2x2,4x1] [--slowdowns 1111,1123]
                            [--models comm,compute,lstm,deep] [--contenders ...] [--json out.json]
    python bench/cluster.py --scaling [--json out.json]   # 1, 2, 4, 8 nodes of 1 rank; 2 nodes of 1, 2, 4

The models (``MODELS``): ``comm``, an MLP whose middle layer holds two thirds of its 101 MB;
``compute``, a small CNN; ``lstm``, a small LSTM language model; ``deep`` (not in the
default list), an MLP of about comm's bytes in seven equal layers.

The cluster is ``scripts/eddis-dev-cluster`` in network mode ``netns`` (every Slurm
node its own network host, each link limited by an HTB qdisc), in a state directory
of its own (``--cluster-dir``), rebuilt for each link rate and taken down at the end.
For each configuration (link, nodes x ranks per node, slowdowns, model) one Slurm job
(the EDDIS job script: one smb-server per node, ``srun eddis-train``) runs every
contender in turn on the same data:

- ``ddp`` (torch DDP over gloo: ring allreduce), ``ddp-fp16`` (its fp16 compression
  hook), ``horovod`` (when ``import horovod.torch`` works in the job);
- ``eddis-allreduce`` (MPI), ``eddis-sync`` (hierarchical across nodes), ``-fp16``,
  ``-bf16``, ``eddis-sync-flat`` (``EDDIS_SYNC_REDUCE=server``: every rank's slot to
  the servers, the path before the hierarchy), ``eddis-balanced``, ``eddis-easgd``,
  ``eddis-hybrid`` (a group per node), ``eddis-hybrid-balanced`` (each group's batch
  split among its ranks by their measured speed, ``balance=True``); ``eddis-easgd-locallr`` and
  ``eddis-hybrid-locallr`` (not in the default list): the same with every worker
  (group) stepping at the learning rate of its own batch rather than of the global one;
  easgd and hybrid exchange in the background, each move applied a step later, when the
  centre crosses the network (``EDDIS_EASGD_OVERLAP=auto``, the default: on a cluster of
  several nodes); ``eddis-easgd-overlap``, ``eddis-hybrid-overlap`` and
  ``eddis-hybrid-balanced-overlap`` force it on, ``eddis-easgd-nooverlap``,
  ``eddis-hybrid-nooverlap`` and ``eddis-hybrid-balanced-nooverlap`` off (none of them in
  the default list);
  ``eddis-sync-whole`` and ``eddis-sync-fp16-whole`` (not in the default list): the
  optimizer's update once the whole gradient is in (``EDDIS_OVERLAP_OPTIMIZER=off``), where
  the others update bucket by bucket as each bucket's average arrives;
  ``eddis-sync-forward``, ``eddis-sync-fp16-forward`` and ``eddis-allreduce-forward`` (not in
  the default list): ``step()`` returns before the updates, which the next forward applies
  module by module (``EDDIS_OVERLAP_FORWARD=on``);
  ``eddis-sync-ring``, ``eddis-sync-fp16-ring`` (one rank a node), ``eddis-sync-mesh`` and
  ``eddis-sync-fp16-mesh`` (not in the default list): mode sync's route across the nodes
  asked for (``EDDIS_SYNC_REDUCE=ring`` or ``hierarchical``) whatever ``auto`` picks;
  ``eddis-sync-b1m``, ``-b2m``, ``-b4m``, ``-b8m`` (not in the default list): mode sync with
  buckets of 1, 2, 4 or 8 MiB (``EDDIS_BUCKET_BYTES``), beside the job's size in one run;
  ``eddis-sync-nofirst`` (not in the default list): mode sync with no first bucket of its own
  (``EDDIS_FIRST_BUCKET_BYTES=0``);
  ``eddis-sync-rdma``: ``eddis-sync`` on the rdma transport (one-sided put/get, the
  servers' CPUs touch no byte), in a job of its own, since a job's servers offer one
  transport; the emulated cluster has no HCA, so UCX carries it over its tcp transport
  with the test-only ``SMB_UCX_ALLOW_TCP=1`` (``RDMA_SETTINGS``): a measure of the code
  path and of the servers' CPU, not of InfiniBand;
- ``probe-ring``, ``probe-mpi``, ``probe-allreduce``, ``probe-sync`` (not in the default
  list): each path's communication alone, what ``eddis plan`` calibrates the paths with:
  the gradient's buckets (as EDDIS cuts them) all-reduced by gloo (DDP's ring), by MPI's
  ``Iallreduce`` from the main thread (what ``eddis plan --calibrate`` measures), and by
  EDDIS's allreduce mode and its sync (a backward that only touches every parameter, no
  model); its "samples/s" is a global batch over the time of one such reduction, its bytes
  those of the path; ``probe-smbring`` (one rank a node): the buckets' bytes all-reduced by a
  ring across the nodes through their smb-servers (``smb_ring``: each node's chunk into the
  next node's server, read there from mapped memory), the ring issue 41 allows at one rank a
  node, measured before it is a mode;
- ``solo``, the ideal: every rank trains a model of its own at the same time, with no
  communication, for ``--solo-seconds``; its samples/s is the sum of the ranks' own
  rates, so it carries the same CPU contention and slowdowns as the others, and the
  table gives each contender's share of it (``x ideal``).

The ``floor`` column is what the hardware allows each contender's step: the longer of
the solo step (a global batch at the solo rate) and the time its busiest node link and
way needs for the bytes the contender put there, at the rate a link was measured to
carry when the cluster came up (``link_rate.py``); ``x floor`` is its step over that
(``floor_step_s`` and ``x_floor`` in the ``--json`` records), "-" without ``solo``.
``cpu s/step`` is the CPU time the job's processes used per step, all ranks added up and
all smb-servers added up (``job_cpu.py``; ``cpu_s_per_step`` in the records): where the
2 CPUs went, beside where the seconds went. ``link idle`` is the share of the measured
steps' time a node link and way carried under 5 % of the measured rate, ``busy rate``
what it carried the rest of the time as a share of that rate (``link_usage.py``; per
node and way as ``link_idle`` and ``link_busy_rate`` in the records): a link that idles
little can still run far below its rate while it works.

Each contender warms up, then every rank stops at a barrier while this driver reads
the byte counters of every node link (``eddis.slurm.devcluster.traffic``), trains on
the same number of global samples, stops again for the counters, and reports. The
bytes are counted per node and step (a step: one global batch of samples), out of
and into the node, headers included; ``cross_node_bytes_per_step`` is their mean
each way ((out + in) / 2, averaged over the nodes), the measure of the least a
synchronous step must send: ``2(n-1)/n`` S for a ring of n ranks, ``2(k-1)/k`` S
for a hierarchy of k nodes (each node sends its share of every other node's columns
and serves its own columns' results), S being the fp32 gradient bytes. Time to target is the time until rank 0's
moving average of its mini-batch loss falls below the model's target loss (stated
in the table). Slowdowns act through a simulated accelerator (``--device-ms``: a
rank with factor f sleeps f x D ms per sample between forward and backward), so the
2 CPUs of this machine are not what makes a rank slow.

Every contender runs in worker processes that called ``eddis.init()``, so DDP's and
Horovod's ranks too keep freed memory in the C heap (``EDDIS_KEEP_FREED_MEMORY``, on by
default): the ratios compare the communication on equal heaps. A DDP job of its own runs
with glibc's default; ``EDDIS_KEEP_FREED_MEMORY=0`` in this driver's environment gives
every contender that default.

This is a benchmark, not a test: it prints figures and ratios to DDP and asserts
nothing. Run it alone (it takes /tmp/eddis-bench.lock).
"""
import argparse
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import job_cpu
import link_rate
import link_usage

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

MODELS = {  # local batch, target loss, learning rate at a batch of 32, steps to warm up, class separation
    "comm": {"batch": 8, "target": 0.5, "lr": 0.05, "warmup": 2, "separation": 0.2},
    "compute": {"batch": 8, "target": 1.0, "lr": 0.05, "warmup": 2, "separation": 1.0},
    "lstm": {"batch": 8, "target": 3.5, "lr": 1.0, "warmup": 2},
    # about comm's bytes in seven equal layers: the backward makes them ready one by one and
    # the next forward needs them in the other order, where comm's middle layer holds 2/3
    "deep": {"batch": 8, "target": 1.0, "lr": 0.05, "warmup": 2, "separation": 0.2},
}
CONTENDERS = ["ddp", "ddp-fp16", "horovod", "eddis-allreduce", "eddis-sync", "eddis-sync-fp16",
              "eddis-sync-bf16", "eddis-sync-flat", "eddis-sync-rdma", "eddis-balanced", "eddis-easgd",
              "eddis-hybrid", "eddis-hybrid-balanced", "solo"]
PROBES = ["probe-ring", "probe-mpi", "probe-allreduce", "probe-sync", "probe-smbring"]
PROBE_WARMUP, PROBE_REPEATS = 2, 6
# the job of the contenders on the rdma transport (name ends in -rdma): its servers offer it,
# over UCX's tcp here (no HCA on the emulated cluster; unsafe outside a test setting). UCX_TLS
# keeps UCX off its shared memory, which the nodes of one machine share and would bypass the links.
RDMA_SETTINGS = {"SMB_TRANSPORT": "rdma", "SMB_UCX_ALLOW_TCP": "1"}
RDMA_ENV = {"UCX_TLS": "tcp"}
QUICK = {"links": ["1gbit"], "layouts": ["2x2"], "slowdowns": ["1111"], "models": ["comm"],
         "contenders": ["ddp", "eddis-sync", "eddis-hybrid", "solo"]}
# model averaging whose workers step at the learning rate of their own batch (the rule before
# 2026-12-04; docs/benchmarks-cluster.md has both side by side)
LOCAL_LR_VARIANTS = ["eddis-easgd-locallr", "eddis-hybrid-locallr"]
# the elastic exchanges in the background, each move applied a step later (EDDIS_EASGD_OVERLAP)
OVERLAP_VARIANTS = ["eddis-easgd-overlap", "eddis-hybrid-overlap", "eddis-hybrid-balanced-overlap",
                    "eddis-easgd-nooverlap", "eddis-hybrid-nooverlap", "eddis-hybrid-balanced-nooverlap"]
# the optimizer's update after the whole gradient, not bucket by bucket (EDDIS_OVERLAP_OPTIMIZER)
WHOLE_UPDATE_VARIANTS = ["eddis-sync-whole", "eddis-sync-fp16-whole"]
# step() returns before the updates, which the next forward applies (EDDIS_OVERLAP_FORWARD=on)
FORWARD_VARIANTS = ["eddis-sync-forward", "eddis-sync-fp16-forward", "eddis-allreduce-forward"]
# mode sync's route across nodes asked for (EDDIS_SYNC_REDUCE): the ring at one rank a node, the mesh
ROUTE_VARIANTS = ["eddis-sync-ring", "eddis-sync-fp16-ring", "eddis-sync-mesh", "eddis-sync-fp16-mesh"]
# mode sync with buckets of another size than the job's (EDDIS_BUCKET_BYTES), beside the default
BUCKET_VARIANTS = {"eddis-sync-b1m": "1M", "eddis-sync-b2m": "2M", "eddis-sync-b4m": "4M",
                   "eddis-sync-b8m": "8M"}
# the job's bucket size, which every contender but those above keeps
JOB_BUCKET_BYTES = os.environ.get("EDDIS_BUCKET_BYTES")
# mode sync with its first bucket cut as any other (EDDIS_FIRST_BUCKET_BYTES=0), beside the job's
FIRST_BUCKET_VARIANTS = {"eddis-sync-nofirst": "0"}
JOB_FIRST_BUCKET_BYTES = os.environ.get("EDDIS_FIRST_BUCKET_BYTES")
# probe-smbring: floats a piece of a ring step, and how long one node waits for its neighbour
RING_PROBE_PIECE = 1 << 20
RING_PROBE_TIMEOUT_S = 120
PAUSE_TIMEOUT_S = 300
JOB_TIMEOUT_S = 1800


# ---------------------------------------------------------------- models and data (worker side)
# the width of the MLPs' input (comm, deep): build_model's first layer and Data's samples
MLP_INPUT = 1024


def build_model(name):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    if name == "compute":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(128 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))
    if name == "comm":
        return nn.Sequential(nn.Linear(MLP_INPUT, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                             nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 10))
    if name == "deep":
        hidden = [layer for _ in range(6) for layer in (nn.Linear(2048, 2048), nn.ReLU())]
        return nn.Sequential(nn.Linear(MLP_INPUT, 2048), nn.ReLU(), *hidden, nn.Linear(2048, 10))
    return LanguageModel()


def _language_model_class():
    import torch.nn as nn

    class LanguageModel(nn.Module):
        """A small LSTM language model: 1000 tokens, 128-d embedding, 512 hidden units."""

        def __init__(self, vocab=1000, embed=128, hidden=512):
            super().__init__()
            self.embed = nn.Embedding(vocab, embed)
            self.lstm = nn.LSTM(embed, hidden, batch_first=True)
            self.out = nn.Linear(hidden, vocab)

        def forward(self, tokens):
            hidden, _ = self.lstm(self.embed(tokens))
            return self.out(hidden).flatten(0, 1)

    return LanguageModel


def LanguageModel():  # noqa: N802  (built on first use: torch is imported in the worker only)
    return _language_model_class()()


class Data:
    """Learnable synthetic data, the same on every rank: ten Gaussian classes (comm,
    compute), token streams of a fixed random Markov chain (lstm)."""

    def __init__(self, model, samples=4096):
        import torch

        g = torch.Generator().manual_seed(1234)
        self.model = model
        if model == "lstm":
            vocab, length = 1000, 33
            successor = torch.randperm(vocab, generator=g)
            tokens = torch.empty(samples, length, dtype=torch.long)
            tokens[:, 0] = torch.randint(0, vocab, (samples,), generator=g)
            for t in range(1, length):
                keep = torch.rand(samples, generator=g) < 0.8
                tokens[:, t] = torch.where(keep, successor[tokens[:, t - 1]],
                                           torch.randint(0, vocab, (samples,), generator=g))
            self.x, self.y = tokens[:, :-1], tokens[:, 1:]
        else:
            shape = (MLP_INPUT,) if model in ("comm", "deep") else (3, 32, 32)
            # ten Gaussian classes whose means lie close: learnable, not at once
            self.y = torch.randint(0, 10, (samples,), generator=g)
            means = MODELS[model]["separation"] * torch.randn(10, *shape, generator=g)
            self.x = means[self.y] + torch.randn(samples, *shape, generator=g)

    def batch(self, indices):
        import torch

        idx = torch.as_tensor(indices, dtype=torch.long) % len(self.x)
        return self.x[idx], self.y[idx].reshape(-1)


class LossTracker:
    """Rank 0's moving average of its mini-batch loss; when it first fell below the target."""

    def __init__(self, target):
        self.target, self.ema, self.hit, self.start, self.paused = target, None, None, None, 0.0

    def add(self, loss):
        self.ema = loss if self.ema is None else 0.9 * self.ema + 0.1 * loss
        if self.hit is None and self.start is not None and self.ema <= self.target:
            self.hit = time.perf_counter() - self.start


# ---------------------------------------------------------------- worker
def pause(marker_dir, label, comm, rank):
    """Every rank stops here while the driver reads the link counters (bounded wait)."""
    comm.Barrier()
    if rank == 0:
        Path(marker_dir, f"pause-{label}").write_text(str(time.time()))
        go = Path(marker_dir, f"go-{label}")
        deadline = time.monotonic() + PAUSE_TIMEOUT_S
        while not go.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the driver did not read the counters at {label} within "
                                   f"{PAUSE_TIMEOUT_S} s")
            time.sleep(0.05)
    comm.Barrier()


def model_config(model, local_batch=0):
    """The model's settings, with ``local_batch`` samples per rank and step where it is not 0."""
    if local_batch < 0:
        sys.exit(f"bench/cluster.py: --local-batch must be at least 1 (0: the model's own), got {local_batch}")
    return dict(MODELS[model], **({"batch": local_batch} if local_batch else {}))


def worker(args):
    import torch
    import eddis.torch as eddis

    torch.set_num_threads(1)
    eddis.init()
    from eddis.core.comm import runtime

    comm = runtime.comm()
    rank, size = eddis.rank(), eddis.size()
    factors = [float(c) for c in args.slowdowns]
    factor = factors[rank % len(factors)]
    cfg = model_config(args.model, args.local_batch)
    data = Data(args.model)
    hosts = eddis.allgather_object(runtime.hostname())
    for contender in args.contenders.split(","):
        try:
            if contender in PROBES:
                result = run_probe(contender, args, cfg, comm, rank, size, hosts)
            else:
                result = run_contender(contender, args, data, cfg, comm, rank, size, factor, hosts)
        except ImportError as exc:
            if rank == 0:
                print(f"SKIP {contender}: {exc}", flush=True)
            Path(args.marker_dir, f"skip-{contender}").write_text(str(exc))
            continue
        if rank == 0:
            print("RESULT " + json.dumps(result), flush=True)
    eddis.shutdown()


def runtime_transport():
    from eddis.core.comm import connection

    return connection.smb_client().transport


def bucket_plan(model):
    """The model's gradient buckets as EDDIS cuts them (definition order, the job's bucket sizes)."""
    from eddis import settings
    from eddis.core.layout.buckets import BucketPlan

    return BucketPlan([(n, tuple(p.shape)) for n, p in model.named_parameters()],
                      settings.get("EDDIS_BUCKET_BYTES"), first_bucket_bytes=settings.get("EDDIS_FIRST_BUCKET_BYTES"))


def init_gloo(args, hosts, rank, size):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://{hosts[0]}:{args.port}", rank=rank, world_size=size)
    return dist


def run_probe(contender, args, cfg, comm, rank, size, hosts):
    """One path's reduction of the gradient alone (see the module docstring), timed over
    PROBE_REPEATS after PROBE_WARMUP, between the driver's two counter readings."""
    import numpy as np
    import torch
    import eddis.torch as eddis

    model = build_model(args.model)
    gradient_bytes = 4 * sum(p.numel() for p in model.parameters())
    global_batch = cfg["batch"] * size
    sizes = [b.nbytes // 4 for b in bucket_plan(model).buckets]
    if contender == "probe-ring":
        dist = init_gloo(args, hosts, rank, size)
        tensors = [torch.ones(n) for n in sizes]

        def once():
            for work in [dist.all_reduce(t, async_op=True) for t in tensors]:
                work.wait()
    elif contender == "probe-mpi":
        from mpi4py import MPI

        buffers = [(np.ones(n, np.float32), np.empty(n, np.float32)) for n in sizes]

        def once():
            MPI.Request.Waitall([comm.Iallreduce(a, b, op=MPI.SUM) for a, b in buffers])
    elif contender == "probe-smbring":
        once, close = smb_ring(sum(sizes), rank, lambda: eddis.allgather_object(0))
    else:   # EDDIS's own path: its sync, or its allreduce mode (MPI from its reduction thread)
        opt = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                         named_parameters=model.named_parameters(), mode=contender[len("probe-"):])
        params = list(model.parameters())

        def once():
            opt.zero_grad()
            sum(p.sum() for p in params).backward()   # every gradient, in backward order, and no model
            opt.step()
    for _ in range(PROBE_WARMUP):
        once()
    pause(args.marker_dir, f"{contender}-1", comm, rank)
    start = time.perf_counter()
    for _ in range(PROBE_REPEATS):
        once()
    wall = max(eddis.allgather_object(time.perf_counter() - start))
    pause(args.marker_dir, f"{contender}-2", comm, rank)
    if contender in ("probe-sync", "probe-allreduce") and hasattr(opt, "close"):
        opt.close()
    if contender == "probe-smbring":
        close()
    return {"contender": contender, "samples": PROBE_REPEATS * global_batch, "wall_s": wall,
            "samples_per_s": PROBE_REPEATS * global_batch / wall, "time_to_target_s": None,
            "final_loss_ema": None, "gradient_bytes": gradient_bytes, "global_batch": global_batch,
            "rank0_steps": PROBE_REPEATS}


def smb_ring(total, rank, barrier):
    """probe-smbring: an allreduce of ``total`` float32s by a ring across the nodes through
    their smb-servers, one rank a node (the ring issue 41 allows there; not an EDDIS mode).
    Each of the 2(n-1) steps sends one chunk of a node's n, in pieces, into the next node's
    server, where that node reads it from mapped memory, adds its own (reduce-scatter) or
    keeps it (allgather) and sends it on; a counter on the receiving server counts the
    pieces that are in. Returns one reduction as a callable; the first call checks the sum."""
    import collections

    import numpy as np
    from eddis.core.comm import connection
    from eddis.core.reduce.hierarchical import NodeLayout

    client = connection.smb_client()
    layout = NodeLayout.gather(client, RING_PROBE_TIMEOUT_S)
    if layout.problem or layout.pieces != 1:
        raise RuntimeError(f"probe-smbring needs one rank and one smb-server a node ({layout.problem})")
    n, me = layout.num_nodes, layout.node_of[rank]
    chunk = -(-total // n)
    steps = 2 * (n - 1)
    pieces = [(lo, min(chunk, lo + RING_PROBE_PIECE)) for lo in range(0, chunk, RING_PROBE_PIECE)]
    x = np.ones(n * chunk, np.float32)
    inbox = client.pool(f"probe.ring.in.{me}", steps * chunk, "float32", servers=[layout.node_server[me]])
    ahead = client.pool(f"probe.ring.in.{(me + 1) % n}", steps * chunk, "float32",
                        servers=[layout.node_server[(me + 1) % n]])
    arrived = client.counter(f"probe.ring.in.{me}", server=layout.node_server[me])
    announce = client.counter(f"probe.ring.in.{(me + 1) % n}", server=layout.node_server[(me + 1) % n])
    received = inbox.mapped_views(0, 0, steps * chunk)[0]
    state = {"base": arrived.read(), "checked": False}
    barrier()   # every base read before any piece is counted

    def once():
        pending = collections.deque()

        def drain(block=False):
            while pending and (block or pending[0].done()):
                pending.popleft().wait(RING_PROBE_TIMEOUT_S)
                announce.fetch_add(1)

        def wait_for(need):
            deadline = time.monotonic() + RING_PROBE_TIMEOUT_S
            while arrived.read() < need:
                drain()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"probe-smbring: node {me} waited {RING_PROBE_TIMEOUT_S} s for "
                                       f"piece {need - state['base']} from node {(me - 1) % n}")
                if pending:   # drive the writes, sleeping in the transport's poll
                    pending[0].wait_done(0.0005)
                else:
                    time.sleep(0.0002)

        for s in range(steps + 1):
            # the chunk sent at step s is the one received from the node before at step s - 1
            at = (me - s) % n * chunk
            for m, (lo, hi) in enumerate(pieces):
                out = x[at + lo:at + hi]
                if s > 0:
                    wait_for(state["base"] + (s - 1) * len(pieces) + m + 1)
                    incoming = received[(s - 1) * chunk + lo:(s - 1) * chunk + hi]
                    if s <= n - 1:
                        out = incoming + out
                        if s == n - 1:   # the sum of every node's chunk: this node's result
                            x[at + lo:at + hi] = out
                    else:
                        x[at + lo:at + hi] = incoming
                        out = incoming
                if s < steps:
                    pending.append(ahead.write_nb(out, start=s * chunk + lo))
                    drain()
        drain(block=True)
        state["base"] += steps * len(pieces)
        if not state["checked"]:
            if not np.all(x == n):
                raise RuntimeError(f"probe-smbring: the sum is wrong (values {np.unique(x)[:8]}, not {n})")
            state["checked"] = True
        barrier()   # no node writes the next reduction's pieces over ones not yet read
        x[:] = 1.0

    def close():
        barrier()
        inbox.free()   # each node its own: the node before it is done writing into it

    return once, close


def run_contender(contender, args, data, cfg, comm, rank, size, factor, hosts):
    import numpy as np
    import torch
    import torch.nn.functional as F
    import eddis.torch as eddis

    local_batch = cfg["batch"]
    global_batch = local_batch * size
    total_samples = args.steps * global_batch
    model = build_model(args.model)
    gradient_bytes = 4 * sum(p.numel() for p in model.parameters())
    ddp = contender.startswith("ddp")
    hvd = None
    eddis_mode = None
    group_size = sum(1 for h in hosts if h == hosts[rank])
    if ddp:
        init_gloo(args, hosts, rank, size)
        net = torch.nn.parallel.DistributedDataParallel(model)
        if contender == "ddp-fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"] * global_batch / 32, momentum=0.9)
    elif contender == "solo":
        net = model
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"] * local_batch / 32, momentum=0.9)
    elif contender == "horovod":
        import horovod.torch as hvd  # ImportError: listed as skipped

        hvd.init()
        net = model
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=cfg["lr"] * global_batch / 32,
                                                       momentum=0.9),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    else:
        net = model
        parts = contender.split("-")[1:]
        if parts[-1] == "rdma" and runtime_transport() != "rdma":
            raise RuntimeError(f"{contender}: the SMB client uses {runtime_transport()}, not rdma; its job "
                               f"must run with {RDMA_SETTINGS} and {RDMA_ENV}")
        eddis_mode = {"sync": "sync", "balanced": "sync", "allreduce": "allreduce", "easgd": "easgd",
                      "hybrid": "hybrid"}[parts[0]]
        compression = parts[1] if len(parts) > 1 and parts[1] in ("fp16", "bf16") else "none"
        os.environ["EDDIS_SYNC_REDUCE"] = {"flat": "server", "ring": "ring", "mesh": "hierarchical"}.get(
            parts[-1], "auto")
        os.environ["EDDIS_EASGD_OVERLAP"] = {"overlap": "on", "nooverlap": "off"}.get(parts[-1], "auto")
        os.environ["EDDIS_OVERLAP_OPTIMIZER"] = "off" if parts[-1] == "whole" else "auto"
        os.environ["EDDIS_OVERLAP_FORWARD"] = "on" if parts[-1] == "forward" else "off"
        for name, value in (("EDDIS_BUCKET_BYTES", BUCKET_VARIANTS.get(contender, JOB_BUCKET_BYTES)),
                            ("EDDIS_FIRST_BUCKET_BYTES",
                             FIRST_BUCKET_VARIANTS.get(contender, JOB_FIRST_BUCKET_BYTES))):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        # every contender at the global batch's rate: the average of the workers' (groups')
        # steps then moves as far per sample as one synchronous step of the global batch
        batch_for_lr = global_batch
        if parts[-1] == "locallr":
            batch_for_lr = {"easgd": local_batch, "hybrid": local_batch * group_size}[eddis_mode]
        opt = eddis.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=cfg["lr"] * batch_for_lr / 32, momentum=0.9),
            named_parameters=model.named_parameters(), mode=eddis_mode,
            compression=getattr(eddis.Compression, compression), balance="balanced" in parts)
        eddis.broadcast_parameters(model.state_dict(), root_rank=0)
    # every rank takes its share of one global batch
    lockstep = eddis_mode not in ("easgd", "hybrid") and contender != "solo"
    balanced_groups = eddis_mode == "hybrid" and "balanced" in contender
    rng = np.random.default_rng(100 + rank)
    tracker = LossTracker(cfg["target"])

    def one_step(step):
        if lockstep:
            first = step * global_batch
            if contender == "eddis-balanced":
                share = eddis.balanced_slice(global_batch)
                indices = np.arange(first + share.start, first + share.stop)
            else:
                indices = np.arange(first + rank * local_batch, first + (rank + 1) * local_batch)
        elif balanced_groups:   # this rank's share of its group's batch, by speed
            share = eddis.balanced_slice(local_batch * group_size)
            indices = rng.integers(0, len(data.x), share.stop - share.start)
        else:
            indices = rng.integers(0, len(data.x), local_batch)
        x, y = data.batch(indices)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        if args.device_ms > 0:
            time.sleep(factor * args.device_ms * len(indices) / 1000.0)
        loss.backward()
        opt.step()
        if rank == 0:
            tracker.add(loss.item())

    for step in range(cfg["warmup"]):
        one_step(step)
    pause(args.marker_dir, f"{contender}-1", comm, rank)
    # balanced sync, easgd and hybrid run on the global learning counter (faster ranks do
    # more); the others take the same number of lockstep steps
    counted = eddis_mode in ("easgd", "hybrid") or contender == "eddis-balanced"
    if counted:
        eddis.configure_progress(total=total_samples // local_batch)
    start = tracker.start = time.perf_counter()
    local_steps = 0
    if contender == "solo":   # each rank's own rate over the same stretch of time
        while time.perf_counter() - start < args.solo_seconds:
            one_step(cfg["warmup"] + local_steps)
            local_steps += 1
        local_wall = time.perf_counter() - start
        rates = eddis.allgather_object(local_steps * local_batch / local_wall)
        steps_run = eddis.allgather_object(local_steps)
        pause(args.marker_dir, f"{contender}-2", comm, rank)
        # as global batches: the link counters are divided by samples / global batch
        return {"contender": contender, "samples": sum(steps_run) * local_batch, "wall_s": local_wall,
                "samples_per_s": sum(rates), "time_to_target_s": None, "final_loss_ema": tracker.ema,
                "gradient_bytes": gradient_bytes, "global_batch": global_batch, "rank0_steps": local_steps}
    while (not eddis.should_stop()) if counted else local_steps < args.steps:
        one_step(cfg["warmup"] + local_steps)
        local_steps += 1
    local_wall = time.perf_counter() - start
    if eddis_mode in ("easgd", "hybrid"):
        eddis.final_model(opt)
    walls = eddis.allgather_object(local_wall)
    pause(args.marker_dir, f"{contender}-2", comm, rank)
    if hasattr(opt, "close"):
        opt.close()
    if contender == "horovod":
        import horovod.torch as hvd

        # its background thread would go on polling beside every later contender of the job
        hvd.shutdown()
    if ddp:
        del net
    return {"contender": contender, "samples": total_samples, "wall_s": max(walls),
            "samples_per_s": total_samples / max(walls), "time_to_target_s": tracker.hit,
            "final_loss_ema": tracker.ema, "gradient_bytes": gradient_bytes, "global_batch": global_batch,
            "rank0_steps": local_steps}


# ---------------------------------------------------------------- driver
def cluster_env(args, link, nodes):
    env = dict(os.environ)
    env.update({"EDDIS_DEV_CLUSTER_DIR": args.cluster_dir, "EDDIS_DEV_CLUSTER_NET": "netns",
                "EDDIS_DEV_CLUSTER_LINK": link, "EDDIS_DEV_CLUSTER_NODES": str(nodes),
                "EDDIS_DEV_CLUSTER_PORT": str(args.cluster_port)})
    env["SLURM_CONF"] = str(Path(args.cluster_dir) / "slurm.conf")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    for key in [k for k in env if k.startswith(("SLURM_JOB", "SLURM_STEP", "SLURM_PROCID"))]:
        del env[key]
    return env


def cluster_up(args, link, nodes):
    env = cluster_env(args, link, nodes)
    proc = subprocess.run([str(REPO / "scripts" / "eddis-dev-cluster"), "up"], env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        sys.exit(f"bench/cluster.py: the emulated cluster did not come up ({link}, {nodes} nodes):\n"
                 f"{proc.stdout}\n{proc.stderr}")
    return env


def cluster_down(args):
    env = cluster_env(args, "unlimited", 2)
    subprocess.run([str(REPO / "scripts" / "eddis-dev-cluster"), "down"], env=env, capture_output=True,
                   text=True, timeout=300)


def job_script(nodes, ranks, command, output, settings=None):
    from eddis.slurm.script import JobComponent, render_job_script

    return render_job_script(components=[JobComponent("all", nodes=nodes, tasks_per_node=ranks)],
                             command=command, job_name="eddis-bench", output=output, time="00:45:00",
                             settings={"SMB_MEMORY": "1G", "EDDIS_COMM_TIMEOUT": "600", **(settings or {})})


def run_configuration(args, env, config, contenders, rate):
    """One Slurm job: every contender of this configuration; returns its records. The
    contenders on the rdma transport get a job of their own (RDMA_SETTINGS). ``rate``: what
    a link carries (bytes/s), the measure of an idle one (bench/link_usage.py)."""
    from eddis.slurm import devcluster

    rdma = [c for c in contenders if c.endswith("-rdma")]
    if rdma and len(rdma) < len(contenders):
        return (run_configuration(args, env, config, [c for c in contenders if c not in rdma], rate)
                + run_configuration(args, env, config, rdma, rate))

    work = Path(tempfile.mkdtemp(prefix="eddis-bench-cluster-", dir="/tmp"))
    os.chmod(work, 0o755)
    output = work / "job.out"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", config["model"],
               "--steps", str(args.steps), "--local-batch", str(args.local_batch),
               "--solo-seconds", str(args.solo_seconds), "--slowdowns",
               config["slowdowns"], "--device-ms", str(args.device_ms), "--contenders", ",".join(contenders),
               "--marker-dir", str(work), "--port", str(29500 + os.getpid() % 1000)]
    script = work / "job.sh"
    script.write_text(job_script(config["nodes"], config["ranks_per_node"], command, str(output),
                                 RDMA_SETTINGS if rdma else None))
    # a run directory of the job's own: job ids start again with every rebuilt cluster
    job_env = dict(env, EDDIS_RUN_DIR=str(work / "run"), **(RDMA_ENV if rdma else {}))
    submit = subprocess.run(["sbatch", "--parsable", str(script)], env=job_env, capture_output=True,
                            text=True, timeout=60)
    if submit.returncode != 0:
        sys.exit(f"bench/cluster.py: sbatch failed: {submit.stderr}")
    job = submit.stdout.strip().split(";")[0]
    counters, cpu, deadline = {}, {}, time.monotonic() + JOB_TIMEOUT_S
    samplers, link_samples = {}, {}
    labels = [f"{c}-{i}" for c in contenders for i in (1, 2)]
    while time.monotonic() < deadline:
        for label in labels:
            if label not in counters and (work / f"pause-{label}").exists():
                counters[label] = devcluster.traffic(args.cluster_dir)
                cpu[label] = job_cpu.sample(job_env["EDDIS_RUN_DIR"])
                contender, mark = label.rsplit("-", 1)
                if mark == "1":   # the measured steps start: sample the links until they end
                    samplers[contender] = link_usage.Sampler(
                        lambda: devcluster.traffic(args.cluster_dir)).start()
                elif contender in samplers:
                    link_samples[contender] = samplers.pop(contender).stop()
                (work / f"go-{label}").write_text("")
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True,
                               text=True, timeout=30).stdout.strip()
        if not state:
            break
        time.sleep(0.1)
    else:
        subprocess.run(["scancel", job], env=env, timeout=30)
        print(f"job {job} ran past {JOB_TIMEOUT_S} s and was cancelled", file=sys.stderr)
    for sampler in samplers.values():   # a contender that never reached its end mark
        sampler.stop()
    text = output.read_text() if output.exists() else ""
    records = []
    for line in text.splitlines():
        match = re.search(r"RESULT (\{.*\})", line)
        if not match:
            continue
        r = json.loads(match.group(1))
        c = r["contender"]
        per_node = devcluster.difference(counters[f"{c}-1"], counters[f"{c}-2"])
        steps = r["samples"] / r["global_batch"]
        used_cpu = job_cpu.difference(cpu[f"{c}-1"], cpu[f"{c}-2"])
        used = sorted(per_node)[:config["nodes"]]
        tx = [per_node[n]["tx"] / steps for n in used]
        rx = [per_node[n]["rx"] / steps for n in used]
        # per node and way, the share of the measured steps' time the link carried next to nothing
        idle = link_usage.idle_shares(link_samples.get(c, []), rate, used)
        # and how full it was while it carried something
        busy = link_usage.busy_rates(link_samples.get(c, []), rate, used)
        records.append({
            "config": {**{k: config[k] for k in ("link", "nodes", "ranks_per_node", "slowdowns", "model")},
                       "local_batch": model_config(config["model"], args.local_batch)["batch"],
                       # what bench/plan_validate.py gives the model: the simulated device, the run's
                       # length, the cores every rank shares
                       "device_ms": args.device_ms, "steps": args.steps, "host_cores": os.cpu_count()},
            "contender": c, "samples_per_s": r["samples_per_s"], "time_to_target_s": r["time_to_target_s"],
            "target_loss": MODELS[config["model"]]["target"], "final_loss_ema": r["final_loss_ema"],
            # each way: the mean over nodes of (out + in) / 2, the measure of 2(k-1)/k S
            "cross_node_bytes_per_step": sum(t + x for t, x in zip(tx, rx)) / (2 * len(used)),
            "tx_per_step": tx, "rx_per_step": rx, "gradient_bytes": r["gradient_bytes"],
            "link_idle": idle, "link_idle_mean": link_usage.link_mean(idle),
            "link_busy_rate": busy, "link_busy_rate_mean": link_usage.link_mean(busy),
            "global_batch": r["global_batch"], "wall_s": r["wall_s"], "job": job,
            # every rank's (server's) CPU seconds added up, per global batch
            "cpu_s_per_step": {role: seconds / steps for role, seconds in used_cpu.items()}})
    missing = [c for c in contenders if c not in {r["contender"] for r in records}
               and not (work / f"skip-{c}").exists()]
    if missing:
        print(f"job {job}: no result for {', '.join(missing)}; the end of its output:\n"
              + "\n".join(text.splitlines()[-40:]), file=sys.stderr)
    for c in contenders:
        if (work / f"skip-{c}").exists():
            print(f"{c}: skipped ({(work / f'skip-{c}').read_text()})")
    if args.keep_jobs:
        print(f"job {job}: output and script kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return records


def add_floors(records, link_bytes_per_s):
    """Each record's floor (``floor_step_s``: what the hardware allows its step) and how far
    its step is from it (``x_floor``), from the solo contender of the same configuration."""
    solo = next((r for r in records if r["contender"] == "solo"), None)
    for r in records:
        floor = link_rate.floor_step_s(r, solo, link_bytes_per_s)
        r["link_bytes_per_s"] = link_bytes_per_s
        r["floor_step_s"] = floor
        r["x_floor"] = None if floor is None else link_rate.step_s(r) / floor


def print_table(records):
    by_config = {}
    for r in records:
        by_config.setdefault(json.dumps(r["config"], sort_keys=True), []).append(r)
    for key, rows in by_config.items():
        config = json.loads(key)
        ddp = next((r for r in rows if r["contender"] == "ddp"), None)
        ideal = next((r for r in rows if r["contender"] == "solo"), None)
        print(f"\n{config['link']}, {config['nodes']} nodes x {config['ranks_per_node']} ranks, slowdowns "
              f"{config['slowdowns']}, model {config['model']} (S = {rows[0]['gradient_bytes'] / 1e6:.1f} MB, "
              f"local batch {config.get('local_batch', MODELS[config['model']]['batch'])}, "
              f"target loss {rows[0]['target_loss']})")
        print(f"{'contender':22s} {'samples/s':>10s} {'x DDP':>6s} {'to target s':>12s} {'x DDP':>6s} "
              f"{'bytes/step/node/way':>20s} {'/ S':>6s} {'x ideal':>8s} {'floor s':>8s} {'x floor':>8s} "
              f"{'cpu s/step: ranks':>18s} {'servers':>8s} {'link idle':>10s} {'busy rate':>10s}")
        for r in rows:
            speed = f"{r['samples_per_s'] / ddp['samples_per_s']:.2f}" if ddp else "-"
            hit = r["time_to_target_s"]
            faster = (f"{ddp['time_to_target_s'] / hit:.2f}" if ddp and hit and ddp["time_to_target_s"] else "-")
            share = f"{r['samples_per_s'] / ideal['samples_per_s']:.2f}" if ideal else "-"
            print(f"{r['contender']:22s} {r['samples_per_s']:10.1f} {speed:>6s} "
                  f"{'-' if hit is None else f'{hit:.1f}':>12s} {faster:>6s} "
                  f"{r['cross_node_bytes_per_step'] / 1e6:18.1f}MB {r['cross_node_bytes_per_step'] / r['gradient_bytes']:6.2f} "
                  f"{share:>8s} {_figure(r.get('floor_step_s'), '.3f'):>8s} {_figure(r.get('x_floor'), '.2f'):>8s} "
                  f"{r['cpu_s_per_step']['ranks']:18.3f} {r['cpu_s_per_step']['servers']:8.3f} "
                  f"{_figure(r.get('link_idle_mean'), '.2f'):>10s} "
                  f"{_figure(r.get('link_busy_rate_mean'), '.2f'):>10s}")


def _figure(value, spec):
    return "-" if value is None else format(value, spec)


def configurations(args):
    if args.scaling:
        for nodes in (1, 2, 4, 8):
            yield {"link": "1gbit", "nodes": nodes, "ranks_per_node": 1, "slowdowns": "1", "model": args.models[0]}
        for ranks in (2, 4):
            yield {"link": "1gbit", "nodes": 2, "ranks_per_node": ranks, "slowdowns": "1", "model": args.models[0]}
        return
    for link in args.links:
        for layout in args.layouts:
            nodes, ranks = (int(v) for v in layout.split("x"))
            for slowdowns in args.slowdowns:
                for model in args.models:
                    yield {"link": link, "nodes": nodes, "ranks_per_node": ranks, "slowdowns": slowdowns,
                           "model": model}


def _leave_on_signal(signum, frame):
    raise SystemExit(f"bench/cluster.py: {signal.Signals(signum).name}: stopping the run")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one configuration: 2x2, 1gbit, comm, DDP/sync/hybrid")
    p.add_argument("--scaling", action="store_true", help="the scaling run (DDP, sync, hybrid)")
    p.add_argument("--links", default="1gbit,10gbit")
    p.add_argument("--layouts", default="2x2,4x1", help="NODESxRANKS_PER_NODE, comma-separated")
    p.add_argument("--slowdowns", default="1111,1123", help="per-rank factors, one digit a rank")
    p.add_argument("--models", default="comm,compute,lstm")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--steps", type=int, default=80, help="global batches each contender trains on (measured)")
    p.add_argument("--local-batch", type=int, default=0,
                   help="samples per rank and step (0: the model's own, 8); smaller makes each step's "
                        "compute small beside its transfer, as a GPU's is")
    p.add_argument("--solo-seconds", type=float, default=30.0,
                   help="how long the ranks of the solo contender (the ideal) train alone")
    p.add_argument("--device-ms", type=float, default=0.0,
                   help="simulated accelerator: ms per sample at factor 1 (0: none)")
    p.add_argument("--json", default=None, help="also write the records to this file")
    p.add_argument("--cluster-dir", default="/tmp/eddis-bench-cluster")
    p.add_argument("--cluster-port", type=int, default=18817)
    p.add_argument("--keep-cluster", action="store_true", help="leave the emulated cluster running")
    p.add_argument("--keep-jobs", action="store_true", help="keep each job's script and output")
    p.add_argument("--lock-wait", type=float, default=1800.0,
                   help="seconds to wait for another benchmark's /tmp/eddis-bench.lock")
    # worker side (inside the Slurm job)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="comm", help=argparse.SUPPRESS)
    p.add_argument("--marker-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29500, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:  # its configuration, unless an option names another
        for key, value in QUICK.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, ",".join(value))
    if args.scaling:
        args.contenders = "ddp,eddis-sync,eddis-hybrid"
    args.links = args.links.split(",")
    args.layouts = args.layouts.split(",")
    args.slowdowns = args.slowdowns.split(",")
    args.models = args.models.split(",")
    known = (CONTENDERS + PROBES + LOCAL_LR_VARIANTS + OVERLAP_VARIANTS + WHOLE_UPDATE_VARIANTS + FORWARD_VARIANTS
             + ROUTE_VARIANTS + list(BUCKET_VARIANTS) + list(FIRST_BUCKET_VARIANTS))
    for c in args.contenders.split(","):
        if c not in known:
            sys.exit(f"bench/cluster.py: unknown contender {c!r}; choose from {', '.join(known)}")
    for m in args.models:
        if m not in MODELS:
            sys.exit(f"bench/cluster.py: unknown model {m!r}; choose from {', '.join(MODELS)}")
    lock = open("/tmp/eddis-bench.lock", "w")
    waited = time.monotonic()
    while True:  # benchmarks run alone: wait (bounded) for whoever holds the lock
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            if time.monotonic() - waited > args.lock_wait:
                sys.exit(f"bench/cluster.py: /tmp/eddis-bench.lock still held after {args.lock_wait:g} s; "
                         "run benchmarks alone (or raise --lock-wait)")
            time.sleep(1.0)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"bench/cluster.py, {started}, load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs", flush=True)
    configs = list(configurations(args))
    records, current = [], None
    for signum in (signal.SIGTERM, signal.SIGHUP):   # the finally below takes the cluster down
        signal.signal(signum, _leave_on_signal)
    try:
        for config in configs:
            nodes = max(2, max(c["nodes"] for c in configs))
            if current != (config["link"], nodes):
                env = cluster_up(args, config["link"], nodes)
                current = (config["link"], nodes)
                rate = link_rate.measure(args.cluster_dir)
                print(f"-- a {config['link']} link carries {rate * 8 / 1e9:.2f} Gbit/s (measured)", flush=True)
            contenders = args.contenders.split(",")
            if config["nodes"] * config["ranks_per_node"] == 1:
                contenders = [c for c in contenders if c in ("ddp", "eddis-sync")]
            print(f"-- {config}: {', '.join(contenders)}", flush=True)
            found = run_configuration(args, env, config, contenders, rate)
            add_floors(found, rate)
            for r in found:
                print(f"   {r['contender']:22s} {r['samples_per_s']:8.1f} samples/s, to target "
                      f"{r['time_to_target_s']}, {r['cross_node_bytes_per_step'] / 1e6:.1f} MB/step/node "
                      f"(out {', '.join(f'{t / 1e6:.1f}' for t in r['tx_per_step'])}, in "
                      f"{', '.join(f'{t / 1e6:.1f}' for t in r['rx_per_step'])}), CPU s/step ranks "
                  f"{r['cpu_s_per_step']['ranks']:.3f}, servers {r['cpu_s_per_step']['servers']:.3f}", flush=True)
            records += found
    finally:
        if not args.keep_cluster:
            cluster_down(args)
    print_table(records)
    print(f"\nfinished {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
