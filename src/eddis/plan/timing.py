"""Step times: the equations of docs/plan.md, "Time", as pure functions.

Lockstep modes (DDP's ring, MPI allreduce, sync in its forms): every rank computes its
share of the global batch; bucket b is ready when the last rank has it
(``t_b = max_i ready_b F_i``); it then passes through its mode's *stages*, each on a
resource (the ranks' submit and finish threads, the node's link, the servers), and a
stage starts once the bucket's previous stage is over and its resource is free (first
come, first served). The optimizer's update follows, bucket by bucket (EDDIS) or once
the whole gradient is in (DDP).

Elastic modes (easgd, hybrid): a worker (a rank, or a node's group in lockstep) steps at
its own pace and exchanges with the centre every ``tau`` steps, in the background
(striped, applied a step later) when the centre crosses the network; the workers
together may ask no link for more than it carries.
"""
import heapq
import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from .._sync_route import auto_route
from ..errors import ConfigError
from . import traffic
from .modes import MODES


def seconds(nbytes, rate):
    """Time to move ``nbytes`` at ``rate`` bytes/s; no rate given: not a limit."""
    return 0.0 if rate is None or nbytes == 0 else nbytes / rate


def per_sample_times(cluster, workload):
    """Each rank's seconds per sample alone (forward, backward and update)."""
    out = []
    for r in cluster.ranks:
        if r.samples_per_s is not None:
            out.append(1.0 / r.samples_per_s)
        elif workload.compute_s_per_sample is None:
            raise ConfigError("a rank is given by speed, but the model has no compute_s_per_sample; "
                              "add it to model.json or give the ranks' samples_per_s")
        else:
            out.append(workload.compute_s_per_sample / r.speed)
    return out


def split_batch(total, per_sample):
    """Whole samples per rank, at least one each, so that the slowest rank ends soonest:
    each sample goes to the rank that would finish it first (optimal for equal samples)."""
    n = len(per_sample)
    if total < n:
        raise ConfigError(f"a batch of {total} cannot give each of the {n} ranks a sample; raise the "
                          "local batch (model.json local_batch)")
    counts = [1] * n
    heap = [(2 * c, i) for i, c in enumerate(per_sample)]
    heapq.heapify(heap)
    for _ in range(total - n):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, ((counts[i] + 1) * per_sample[i], i))
    return counts


def pipeline(ready, stages):
    """When each bucket is through its stages. ``ready[b]``: when bucket b may start;
    ``stages[b]``: [(resource, seconds), ...] in order. A stage starts at the later of its
    bucket's previous stage's end and its resource's last end (first come, first served;
    ties in bucket order)."""
    free = {}
    done = [0.0] * len(ready)
    heap = [(t, b, 0) for b, t in enumerate(ready)]
    heapq.heapify(heap)
    while heap:
        t, b, s = heapq.heappop(heap)
        if s == len(stages[b]):
            done[b] = t
            continue
        resource, duration = stages[b][s]
        end = max(t, free.get(resource, 0.0)) + duration
        free[resource] = end
        heapq.heappush(heap, (end, b, s + 1))
    return done


# ---------------------------------------------------------------- stages of one bucket
@dataclass
class Layout:
    """The nodes that take part in one reduction: their ranks, link rates and latencies."""
    ranks: List[int]
    link_bps: List[float]
    latency_s: List[float]

    @property
    def k(self):
        return len(self.ranks)

    @property
    def n(self):
        return sum(self.ranks)

    @property
    def latency(self):
        return max(self.latency_s)

    @classmethod
    def of(cls, cluster, nodes=None):
        nodes = cluster.nodes if nodes is None else nodes
        return cls([len(n.ranks) for n in nodes], [n.link_bps for n in nodes], [n.latency_s for n in nodes])


def _capped(rate, cap):
    return rate if cap is None else min(rate, cap)


def _link_phase(layout, out_in, cap=None):
    """The slowest node's time for per-node (out, in) bytes on its link (capped by an SMB rate)."""
    return max(max(o, i) / _capped(b, cap) for (o, i), b in zip(out_in, layout.link_bps))


def route(path, layout):
    """The path a bucket takes: mode sync's ``sync`` as ``EDDIS_SYNC_REDUCE=auto`` chooses it
    for the layout (``smb-ring`` or ``hierarchical``), any other path as it is."""
    if path != "sync":
        return path
    return "smb-ring" if auto_route(layout.ranks) == "ring" else "hierarchical"


def bucket_stages(path, wire_bytes_per_element, layout, cluster, nbytes):
    """[(resource, seconds)] of one bucket of ``nbytes`` fp32 bytes on ``path`` (routed)."""
    wire = nbytes * wire_bytes_per_element / 4
    k, n, lat = layout.k, layout.n, layout.latency
    pcie = seconds(nbytes, cluster.pcie_bps)
    cast = seconds(nbytes, cluster.cast_bps) if wire_bytes_per_element != 4 else 0.0
    local_sum = seconds(nbytes, cluster.reduce_bps)
    if path == "hierarchical":
        if k == 1:   # the node's ranks sum in mapped memory (and write it into every slot)
            return [("submit", pcie + local_sum), ("finish", local_sum + pcie)]
        phase = traffic.hierarchical_phase(k, wire)
        return [("submit", pcie + local_sum),
                ("link", _link_phase(layout, [(phase, phase)] * k, cluster.put_bps) + 2 * lat),
                ("server", seconds(wire, cluster.reduce_bps)),
                ("link", _link_phase(layout, [(phase, phase)] * k, cluster.get_bps) + 2 * lat),
                ("finish", local_sum + pcie)]
    if path == "smb-ring":
        if max(layout.ranks) > 1 or k < 2:
            raise ConfigError(f"sync's ring (EDDIS_SYNC_REDUCE=ring) takes one rank on each of 2 or more "
                              f"nodes, and this cluster has {layout.ranks} ranks a node; plan eddis-sync "
                              "(auto) or eddis-sync-mesh there")
        # each of 2(k-1) steps writes a chunk into the next node's server while the pieces of
        # the step before are summed on the rank from mapped memory: one stream a link, no
        # server stage, the sum beside the transfer
        both = traffic.ring(k, k, wire)
        rate = cluster.put_bps if cluster.smb_ring_bps is None else cluster.smb_ring_bps
        move = _link_phase(layout, [(both, both)] * k, rate) + 2 * (k - 1) * lat
        summed = seconds((k - 1) / k * nbytes, cluster.reduce_bps)
        return [("submit", pcie + cast), ("link", max(move, summed)), ("finish", cast + pcie)]
    if path == "flat":
        phases = traffic.flat_phases(layout.ranks, wire)
        stages = [("submit", pcie + cast)]
        if k > 1:
            stages.append(("link", _link_phase(layout, [p for p, _ in phases], cluster.put_bps) + 2 * lat))
        else:   # the slot is mapped memory: a copy
            stages.append(("submit", seconds(wire, cluster.reduce_bps)))
        stages.append(("server", seconds(n * wire / k, cluster.reduce_bps)))
        if k > 1:
            stages.append(("link", _link_phase(layout, [g for _, g in phases], cluster.get_bps) + 2 * lat))
        return stages + [("finish", cast + pcie)]
    if path == "mpi":
        if k == 1:
            move = seconds(2 * (n - 1) / n * wire, cluster.intra_bps)
        else:
            both = traffic.halving_doubling(k, wire)
            move = _link_phase(layout, [(both, both)] * k, cluster.mpi_bps) + 2 * math.ceil(math.log2(n)) * lat
        return [("submit", pcie + cast), ("link", move), ("finish", cast + pcie)]
    if path == "ring":
        if k == 1:
            move = seconds(2 * (n - 1) / n * wire, cluster.intra_bps)
        else:
            both = traffic.ring(n, k, wire)
            move = _link_phase(layout, [(both, both)] * k, cluster.ring_bps) + 2 * (n - 1) * lat
            if cluster.intra_bps is not None and max(layout.ranks) > 1:
                move = max(move, seconds(both, cluster.intra_bps))
        return [("submit", cast), ("link", move), ("finish", cast)]
    raise ConfigError(f"no lockstep path {path!r}")


def link_bytes(path, wire_bytes_per_element, layout, nbytes):
    """Per node (out, in) bytes of one bucket on ``path`` (lockstep modes, routed)."""
    wire = nbytes * wire_bytes_per_element / 4
    k, n = layout.k, layout.n
    if k == 1:
        return [(0.0, 0.0)]
    if path in ("hierarchical", "smb-ring"):   # the same 2(k-1)/k W: one rank a node, ring(k, k)
        both = 2 * traffic.hierarchical_phase(k, wire)
        return [(both, both)] * k
    if path == "flat":
        return [(p[0] + g[0], p[1] + g[1]) for p, g in traffic.flat_phases(layout.ranks, wire)]
    both = traffic.halving_doubling(k, wire) if path == "mpi" else traffic.ring(n, k, wire)
    return [(both, both)] * k


# ---------------------------------------------------------------- one mode
@dataclass
class Step:
    """What the model says of one mode (times in seconds, bytes per global batch)."""
    mode: str
    step_s: float                   # one global batch
    samples_per_s: float
    global_batch: int
    batches: List[int]              # samples per rank and step
    link_out_in: List[Tuple[float, float]]   # per node, bytes per global batch
    link_busy: float                # the busiest link's share of the time, one way
    tau: Optional[int] = None
    overlap: Optional[bool] = None
    details: dict = field(default_factory=dict)

    @property
    def bytes_per_node_way(self):
        """The mean over the nodes of (out + in) / 2: bench/cluster.py's measure."""
        pairs = self.link_out_in
        return sum(o + i for o, i in pairs) / (2 * len(pairs)) if pairs else 0.0


def lockstep(mode, cluster, workload, per_sample, batches, nodes=None):
    """(step seconds, per node (out, in) bytes, link seconds) of one lockstep step of the
    ranks of ``nodes`` (default: all) with ``batches`` samples each."""
    layout = Layout.of(cluster, nodes)
    u = workload.update_share
    forward_backward = [(1 - u) * b * c for b, c in zip(batches, per_sample)]
    update = max(u * b * c for b, c in zip(batches, per_sample))
    end_of_backward = max(forward_backward)
    ready = [bucket.ready * end_of_backward for bucket in workload.buckets]
    path = route(mode.path, layout)
    stages = [bucket_stages(path, mode.wire, layout, cluster, bucket.nbytes) for bucket in workload.buckets]
    done = pipeline(ready, stages)
    total = workload.gradient_bytes
    if mode.whole_update:
        step = max(end_of_backward, max(done)) + update
    else:   # bucket by bucket, in plan order, on the training thread once the backward is over
        step = end_of_backward
        for bucket, finished in zip(workload.buckets, done):
            step = max(step, finished) + update * bucket.nbytes / total
    pairs = [(0.0, 0.0)] * layout.k
    for bucket in workload.buckets:
        pairs = [(o + bo, i + bi) for (o, i), (bo, bi) in
                 zip(pairs, link_bytes(path, mode.wire, layout, bucket.nbytes))]
    link_s = sum(d for st in stages for res, d in st if res == "link")
    return step, pairs, link_s


def lockstep_mode(mode, cluster, workload, per_sample):
    n = cluster.size
    global_batch = workload.local_batch * n
    batches = split_batch(global_batch, per_sample) if mode.balanced else [workload.local_batch] * n
    step, pairs, link_s = lockstep(mode, cluster, workload, per_sample, batches)
    return Step(mode.name, step, global_batch / step, global_batch, batches, pairs,
                link_busy=min(1.0, link_s / step) if step > 0 else 0.0)


def _groups(cluster, mode):
    """The elastic workers: [(rank indices, node index)]."""
    node_of = cluster.node_of_ranks()
    if mode.path == "easgd":
        return [([i], j) for i, j in enumerate(node_of)]
    return [([i for i, m in enumerate(node_of) if m == j], j) for j in range(cluster.num_nodes)]


def exchange_seconds(cluster, node, workload, group_size):
    """One whole exchange of a worker on ``node``: read the centre, write the move (the
    servers' axpy), and for a group the leader's broadcast of the move."""
    k = cluster.num_nodes
    centre = workload.gradient_bytes
    axpy = seconds(centre / k, cluster.reduce_bps)
    broadcast = seconds(centre, cluster.intra_bps) if group_size > 1 else 0.0
    if k == 1:   # the centre is mapped memory
        return 2 * seconds(centre, cluster.reduce_bps) + axpy + broadcast
    far = (k - 1) / k * centre
    link = cluster.nodes[node].link_bps
    return (far / _capped(link, cluster.get_bps) + far / _capped(link, cluster.put_bps)
            + 4 * cluster.nodes[node].latency_s + axpy + broadcast)


def elastic_mode(mode, cluster, workload, per_sample, tau, overlap=None, run_steps=None):
    """An elastic mode's throughput. ``overlap`` None: as EDDIS_EASGD_OVERLAP=auto (on when
    the centre crosses the network). ``run_steps``: also count the run's end (the last
    exchange and the centre's reads) spread over that many global batches, as
    bench/cluster.py's byte counts do."""
    if tau < 1:
        raise ConfigError(f"tau must be at least 1 (steps between two exchanges), got {tau}")
    k, n = cluster.num_nodes, cluster.size
    overlap = k > 1 if overlap is None else bool(overlap)
    global_batch = workload.local_batch * n
    batches = [workload.local_batch] * n
    workers = []   # (node, samples a step, step seconds)
    for members, node in _groups(cluster, mode):
        times = [per_sample[i] for i in members]
        if mode.balanced and len(members) > 1:
            split = split_batch(workload.local_batch * len(members), times)
            for i, b in zip(members, split):
                batches[i] = b
        local = [batches[i] for i in members]
        if len(members) == 1:
            compute = local[0] * times[0]
        else:   # the group's sync on its node
            compute, _, _ = lockstep(MODES["eddis-sync"], cluster, workload, times, local,
                                     nodes=[cluster.nodes[node]])
        exchange = exchange_seconds(cluster, node, workload, len(members))
        step = max(compute, exchange / tau) if overlap else compute + exchange / tau
        workers.append((node, sum(local), step))
    throughput = sum(samples / step for _, samples, step in workers)
    # exchanges per second of each node's workers; the links must carry what they ask
    per_second = [0.0] * k
    for node, samples, step in workers:
        per_second[node] += 1.0 / (step * tau)
    load = traffic.elastic(per_second, workload.gradient_bytes)
    scale = max([1.0] + [b_s / node.link_bps for b_s, node in zip(load, cluster.nodes)])
    throughput /= scale
    step_s = global_batch / throughput
    per_batch = [b_s / scale * step_s for b_s in load]
    pairs = [(b, b) for b in per_batch]
    if run_steps:
        members = [len(node.ranks) for node in cluster.nodes]
        workers_on = [sum(1 for _, j in _groups(cluster, mode) if j == m) for m in range(k)]
        end = traffic.final_model(workers_on, members, workload.gradient_bytes)
        pairs = [(o + eo / run_steps, i + ei / run_steps) for (o, i), (eo, ei) in zip(pairs, end)]
    busy = max([0.0] + [b_s / scale / node.link_bps for b_s, node in zip(load, cluster.nodes)])
    return Step(mode.name, step_s, throughput, global_batch, batches, pairs, link_busy=min(1.0, busy),
                tau=tau, overlap=overlap, details={"link_bound": scale > 1.0})


def solo(cluster, workload, per_sample):
    """The ideal: every rank alone at its own speed, nothing communicated."""
    n = cluster.size
    global_batch = workload.local_batch * n
    throughput = sum(1.0 / c for c in per_sample)
    return Step("solo", global_batch / throughput, throughput, global_batch, [workload.local_batch] * n,
                [(0.0, 0.0)] * cluster.num_nodes, link_busy=0.0)
