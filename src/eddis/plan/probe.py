"""``eddis plan --calibrate``: short probes inside the job's allocation, on every rank.

Run it as the job's command (``eddis-train --job -- eddis plan --calibrate --out DIR``, or
``eddis-train --local -n 2 eddis plan --calibrate ...``): the servers are up, and every
rank takes part. What is measured:

- the link between two nodes: rank 0 and the first rank on another node stream
  ``repeats`` MPI messages of ``nbytes`` one way, then both ways at once (the figure kept:
  a link carries both ways at once in every step), and ping-pong a byte for the latency;
- MPI's allreduce of ``nbytes`` on every rank at once (on two nodes or more): what it
  carries a node and way in its own pattern;
- EDDIS's own paths, on two nodes or more: its ``allreduce`` and ``sync`` modes reduce
  ``nbytes`` on every rank at once (:func:`reduction_probe`); what each carries a node and
  way is the model's ``mpi_gbs`` and SMB's ``put_gbs``/``get_gbs``;
- SMB, from rank 0: put and get of ``nbytes`` into a pool on a server of another node
  (its own node's server, mapped, where there is no other), and the server's reduce: the
  weighted sum of 4 slots of ``nbytes`` each (bytes of input per second);
- the layout: the ranks of every node, with the GPU type the launcher named.

The ranks' speeds on the user's model are not probed (they need the model): they come
from a profile of a short run (``--from-profile``); without one every rank is written
with ``"speed": 1`` and the model needs ``compute_s_per_sample``. Every wait is bounded by
``timeout``.
"""
import time

import numpy as np

from .. import identity
from ..errors import CollectiveTimeoutError, ConfigError
from . import traffic
from .spec import TCP_PAYLOAD_SHARE, Cluster, Node, Rank

HOST_BYTES = 256
REDUCE_SLOTS = 4


def _wait(requests, deadline, what, pause=0.0):
    """Wait for every request, or raise at ``deadline``. A timed transfer polls without a
    pause, so that MPI progresses at full speed; a rank that only waits for the others
    pauses, so that it leaves the CPUs to their probes."""
    from mpi4py import MPI

    requests = list(requests)
    while not MPI.Request.Testall(requests):
        if pause:
            time.sleep(pause)
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(f"eddis plan --calibrate: {what} did not finish in time; a rank "
                                         "is stuck or the link is far slower (raise --probe-timeout)")


def _hosts(comm, deadline):
    from mpi4py import MPI

    mine = np.zeros(HOST_BYTES, dtype=np.uint8)
    name = identity.node_name().encode()[:HOST_BYTES]
    mine[:len(name)] = np.frombuffer(name, dtype=np.uint8)
    every = np.zeros(HOST_BYTES * comm.Get_size(), dtype=np.uint8)
    _wait([comm.Iallgather([mine, MPI.BYTE], [every, MPI.BYTE])], deadline, "the ranks' host names", pause=0.001)
    return [bytes(row).rstrip(b"\0").decode() for row in every.reshape(-1, HOST_BYTES)]


def link_probe(comm, peer, nbytes, repeats, deadline):
    """On rank 0 and ``peer`` (both measure): (one way, each way of both at once, latency),
    bytes/s and s; None elsewhere."""
    rank = comm.Get_rank()
    if rank not in (0, peer):
        return None
    other = peer if rank == 0 else 0
    out = np.ones(nbytes // 8, dtype=np.float64)
    into = np.empty_like(out)
    one = np.zeros(1, dtype=np.uint8)

    def ping(count):
        for _ in range(count):
            if rank == 0:
                _wait([comm.Isend(one, other, 1)], deadline, "the latency ping")
                _wait([comm.Irecv(one, other, 2)], deadline, "the latency pong")
            else:
                _wait([comm.Irecv(one, other, 1)], deadline, "the latency ping")
                _wait([comm.Isend(one, other, 2)], deadline, "the latency pong")

    ping(3)
    start = time.perf_counter()
    ping(50)
    latency = (time.perf_counter() - start) / 100
    # one way: rank 0 sends, the peer answers once it has all
    ping(1)
    start = time.perf_counter()
    for _ in range(repeats):
        if rank == 0:
            _wait([comm.Isend(out, other, 3)], deadline, "the one-way stream")
        else:
            _wait([comm.Irecv(into, other, 3)], deadline, "the one-way stream")
    ping(1)
    one_way = repeats * out.nbytes / max(time.perf_counter() - start - 2 * latency, 1e-9)
    ping(1)
    start = time.perf_counter()
    for _ in range(repeats):
        _wait([comm.Isend(out, other, 4), comm.Irecv(into, other, 4)], deadline, "the two-way stream")
    ping(1)
    both = repeats * out.nbytes / max(time.perf_counter() - start - 2 * latency, 1e-9)
    return one_way, both, latency


def allreduce_probe(comm, nodes, nbytes, repeats, deadline):
    """MPI's allreduce of ``nbytes`` on every rank at once: what it carries a node and way
    across the link in its own pattern (the model's ``mpi_bps``: 2(k-1)/k of the bytes
    over its time), bytes/s on every rank; None on one node."""
    from mpi4py import MPI

    if nodes < 2:
        return None
    mine = np.ones(nbytes // 4, dtype=np.float32)
    total = np.empty_like(mine)
    _wait([comm.Iallreduce(mine, total, op=MPI.SUM)], deadline, "the warm-up allreduce")
    _wait([comm.Ibarrier()], deadline, "the start of the allreduce probe", pause=0.001)
    start = time.perf_counter()
    for _ in range(repeats):
        _wait([comm.Iallreduce(mine, total, op=MPI.SUM)], deadline, "the allreduce probe")
    took = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    return traffic.halving_doubling(nodes, mine.nbytes) * repeats / max(took, 1e-9)


# what each of EDDIS's paths moves a node and way for a bucket of W bytes on k nodes
PATH_BYTES = {"allreduce": traffic.halving_doubling, "sync": lambda k, w: 2 * traffic.hierarchical_phase(k, w)}


def reduction_probe(comm, mode, nodes, nbytes, repeats, timeout):
    """EDDIS's own reduction in ``mode`` (``allreduce``, ``sync``) of ``nbytes`` of float32 on
    every rank at once, with its own threads and traffic pattern, as a training step runs it:
    bytes/s a node and way across the link, the slowest rank's. The runtime must be up
    (``eddis.core.lifecycle.init``). The raw MPI figure of :func:`allreduce_probe` can be
    far from it (docs/benchmarks-cluster.md, "The planner beside the bench")."""
    from mpi4py import MPI

    from ..core.layout.buckets import BucketPlan
    from ..core.reduce.registry import make_reducer

    reducer = make_reducer(mode, BucketPlan([("probe", (nbytes // 4,))]), timeout=timeout,
                           name=f"eddis-plan-probe-{mode}")
    try:
        reducer.reduce(1.0)   # the warm-up: connections, the pools on the servers
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            reducer.reduce(1.0)
        took = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    finally:
        reducer.close()
    return PATH_BYTES[mode](nodes, 4 * (nbytes // 4)) * repeats / max(took, 1e-9)


def smb_probe(client, me, nbytes, repeats, timeout):
    """(put, get, reduce) bytes/s, and whether put/get crossed a link, from this process."""
    far = [s for s, info in enumerate(client.servers) if info.get("hostname") != me]
    near = [s for s, info in enumerate(client.servers) if info.get("hostname") == me]
    target = (far or near or [0])[0]
    count = nbytes // 4
    data = np.ones(count, dtype=np.float32)
    back = np.empty_like(data)
    pool = client.pool(f"eddis.plan.probe.{me}.{time.time_ns()}", count, "float32", slots=1, servers=[target])
    try:
        pool.write(data, timeout=timeout)
        pool.read(out=back, timeout=timeout)   # warm both ways
        start = time.perf_counter()
        for _ in range(repeats):
            pool.write(data, timeout=timeout)
        put = repeats * nbytes / (time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(repeats):
            pool.read(out=back, timeout=timeout)
        get = repeats * nbytes / (time.perf_counter() - start)
    finally:
        pool.free()
    server = (near or [target])[0]
    slots = client.pool(f"eddis.plan.probe.reduce.{me}.{time.time_ns()}", count, "float32",
                        slots=REDUCE_SLOTS + 1, servers=[server])
    try:
        for s in range(REDUCE_SLOTS):
            slots.write(data, slot=s, timeout=timeout)
        weights = [1.0 / REDUCE_SLOTS] * REDUCE_SLOTS
        slots.weighted_sum(REDUCE_SLOTS, list(range(REDUCE_SLOTS)), weights)
        start = time.perf_counter()
        for _ in range(repeats):
            slots.weighted_sum(REDUCE_SLOTS, list(range(REDUCE_SLOTS)), weights)
        reduce = repeats * REDUCE_SLOTS * nbytes / (time.perf_counter() - start)
    finally:
        slots.free()
    return put, get, reduce, bool(far)


def run(nbytes=64 << 20, repeats=4, timeout=120.0, link_bits=None, ranks=None):
    """The probes on every rank of the job; returns the :class:`Cluster` on rank 0, None
    elsewhere. ``ranks``: [(node name, [Rank])] from a profile, used for the layout and
    speeds when given. ``link_bits``: the link's line rate where there is no second node."""
    from mpi4py import MPI

    from ..smb.client import Client

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    deadline = time.monotonic() + timeout
    hosts = _hosts(comm, deadline)
    nodes = list(dict.fromkeys(hosts))
    peer = next((r for r, h in enumerate(hosts) if h != hosts[0]), None)
    if peer is None and link_bits is None:   # known to every rank: rank 0 says it, the others end
        if rank == 0:
            raise ConfigError("eddis plan --calibrate: the job has one node, so there is no link to measure; "
                              "give its rate (--link 200gbit) or run the probes on two nodes or more")
        return None
    link = None if peer is None else link_probe(comm, peer, nbytes, repeats, deadline)
    allreduce = allreduce_probe(comm, len(nodes), nbytes, repeats, deadline)
    smb = None
    if rank == 0:
        client = Client(timeout=timeout)
        try:
            smb = smb_probe(client, hosts[0], nbytes, repeats, timeout)
        finally:
            client.close()
    _wait([comm.Ibarrier()], deadline, "the end of the probes", pause=0.01)
    paths = dict.fromkeys(PATH_BYTES)   # EDDIS's paths cross a link on two nodes or more only
    if len(nodes) > 1:
        from ..core import lifecycle

        lifecycle.init()
        paths = {mode: reduction_probe(comm, mode, len(nodes), nbytes, repeats, timeout) for mode in PATH_BYTES}
        lifecycle.shutdown()   # collective: the reducers' pools and the SMB connection of the probes
    if rank != 0:
        return None
    if link is not None:
        one_way, both, latency = link
        link_bps, latency_s = both, latency
        measured = (f"link {nodes[0]}<->{hosts[peer]}: {one_way / 1e6:.1f} MB/s one way, {both / 1e6:.1f} MB/s "
                    f"each way both at once, latency {latency * 1e6:.1f} us")
    else:
        link_bps, latency_s = link_bits * TCP_PAYLOAD_SHARE / 8, 0.0
        measured = f"link not measured (one node): {link_bits / 1e9:g} Gbit/s given"
    put, get, reduce, crossed = smb
    measured += (f"; SMB {'across the link' if crossed else 'on the own node (mapped)'}: put {put / 1e9:.3f} GB/s, "
                 f"get {get / 1e9:.3f} GB/s; server reduce {reduce / 1e9:.3f} GB/s of input "
                 f"({REDUCE_SLOTS} slots); "
                 + (f"MPI allreduce {allreduce / 1e9:.3f} GB/s a node and way; " if allreduce else "")
                 + "".join(f"EDDIS {mode} {rate / 1e9:.3f} GB/s a node and way; " for mode, rate in paths.items()
                           if rate)
                 + f"{nbytes} bytes x {repeats}, "
                 f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if ranks is None:
        gpu = identity.gpu_type() or "rank"
        ranks = [(node, [Rank(speed=1.0, kind=gpu)] * hosts.count(node)) for node in nodes]
    built = tuple(Node(name, tuple(rs), link_bps, latency_s) for name, rs in ranks)
    # across a link the SMB rates are capped by it already; mapped ones say nothing of the network
    # the model's caps: each path's own rate where it crossed a link (sync's covers SMB's put
    # and get under every node's traffic at once), else the single transfers'
    put = paths["sync"] or (put if crossed else None)
    get = paths["sync"] or (get if crossed else None)
    return Cluster(nodes=built, put_bps=put, get_bps=get, reduce_bps=reduce,
                   mpi_bps=paths["allreduce"] or allreduce, source=measured)
