"""Which path mode sync's ``EDDIS_SYNC_REDUCE=auto`` takes for a placement of ranks on nodes.

A pure function of the ranks on each node, in the base layer so that the reducer factory
(:func:`eddis.core.reduce.sync.make_sync_reducer`) and the planner (:mod:`eddis.plan.timing`),
which may not import core, answer the question the same way.
"""

# With two nodes the ring's two steps and the mesh's put and get carry the same, and only
# the mesh was measured there; from three nodes of one rank each the ring's one stream a
# link beats the mesh's k-1 senders into every server (docs/benchmarks-cluster.md).
RING_FROM_NODES = 3


def auto_route(ranks_per_node):
    """``"ring"`` for one rank on each of RING_FROM_NODES or more nodes, else
    ``"hierarchical"`` (the node's sum, then the mesh between the nodes' servers)."""
    ranks = list(ranks_per_node)
    if len(ranks) >= RING_FROM_NODES and all(r == 1 for r in ranks):
        return "ring"
    return "hierarchical"
