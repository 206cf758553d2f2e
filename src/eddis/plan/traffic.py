"""Which bytes cross which node's link: the closed forms of docs/plan.md, "Bytes".

Every function gives bytes *per node*, as ``(out, in)`` pairs where the two directions
can differ, for one bucket (lockstep modes) or one global batch (elastic modes).
``W`` is a bucket's bytes on the wire (fp32 S, or S/2 in fp16/bf16); ``k`` nodes,
``r_j`` ranks on node j, ``n`` ranks in all; each node has one smb-server, and a pool
spreads its columns evenly over the servers (a server holds 1/k of every bucket).
"""


def hierarchical_phase(k, wire):
    """Hierarchical sync, each of its two phases: a node puts its sum of the other servers'
    columns ((k-1)/k W out) while the others put theirs of its server's columns into it
    ((k-1)/k W in); then the results come back the same way. 2(k-1)/k W a node and way."""
    return (k - 1) / k * wire


def flat_phases(ranks_per_node, wire):
    """Flat sync (every rank's slot to the servers), per node: ((out, in) of the puts,
    (out, in) of the gets). Each rank puts the (k-1)/k of its bucket that other servers
    hold; every other rank puts 1/k into this node's server; the gets mirror the puts."""
    k, n = len(ranks_per_node), sum(ranks_per_node)
    out = []
    for r in ranks_per_node:
        mine, theirs = r * (k - 1) / k * wire, (n - r) / k * wire
        out.append(((mine, theirs), (theirs, mine)))
    return out


def ring(n, k, wire):
    """A ring over n ranks placed node by node: each node has one ring edge out and one in,
    each carrying 2(n-1) chunks of W/n; nothing crosses a link on one node."""
    return 0.0 if k <= 1 else 2 * (n - 1) / n * wire


def halving_doubling(k, wire):
    """Open MPI's allreduce of large buckets with the ranks placed node by node (recursive
    halving, then doubling, the near partners first): after the node's own steps each rank
    holds 1/r of the bucket, and the steps across nodes move 2(k-1)/k of that per rank, so
    2(k-1)/k W a node and way (measured: 1.00 S at 2x2, 1.50 S at 4x1)."""
    return 0.0 if k <= 1 else 2 * (k - 1) / k * wire


def elastic(exchanges_by_node, centre_bytes):
    """Elastic exchanges, per node and way: ``exchanges_by_node[j]`` exchanges of the
    workers on node j. An exchange reads the centre and writes the worker's move (fp32,
    spread over all k servers; the servers' axpy moves nothing across): (k-1)/k S out and
    in on the worker's node, S/k out and in on every other node. Equal in both ways."""
    k = len(exchanges_by_node)
    if k <= 1:
        return [0.0] * k
    total = sum(exchanges_by_node)
    return [e * (k - 1) / k * centre_bytes + (total - e) / k * centre_bytes for e in exchanges_by_node]


def final_model(workers_by_node, ranks_by_node, centre_bytes):
    """The run's end (``eddis.final_model``): every worker's last whole exchange, then every
    rank reads the centre. Per node (out, in); what ``bench/cluster.py`` counts in its
    measured steps besides the steady exchanges."""
    k, n = len(ranks_by_node), sum(ranks_by_node)
    if k <= 1:
        return [(0.0, 0.0)] * k
    exchange = elastic(workers_by_node, centre_bytes)
    return [(x + (n - r) / k * centre_bytes, x + r * (k - 1) / k * centre_bytes)
            for x, r in zip(exchange, ranks_by_node)]
