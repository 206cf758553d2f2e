"""The modes the planner compares, named as ``bench/cluster.py`` names its contenders.

A mode is a *path* (how its bytes travel: docs/plan.md has the equations of each),
the bytes an element takes on the wire, and whether the global batch is split by the
ranks' speeds. Modes of one big batch (the gradient of the whole global batch every
step: DDP, MPI allreduce, sync in every form) need the same samples to a target; the
elastic ones (easgd, hybrid) need what was measured for them.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    name: str
    path: str           # ring, mpi, sync (auto: smb-ring or hierarchical), hierarchical, smb-ring,
                        # flat, easgd, hybrid
    wire: int = 4       # bytes of one gradient element on the wire
    balanced: bool = False
    description: str = ""
    listed: bool = True     # in the planner's table by default (not: a route sync may be forced on)

    @property
    def elastic(self):
        return self.path in ("easgd", "hybrid")

    @property
    def whole_update(self):
        """DDP steps its optimizer once the whole gradient is in; EDDIS bucket by bucket."""
        return self.path == "ring"


MODES = {m.name: m for m in (
    Mode("ddp", "ring", description="ring allreduce: DDP (gloo, NCCL), the peers' stand-in"),
    Mode("ddp-fp16", "ring", 2, description="ring allreduce, fp16 on the wire (DDP's fp16 hook)"),
    Mode("eddis-allreduce", "mpi", description="MPI allreduce (EDDIS_MODE=allreduce), the baseline"),
    Mode("eddis-sync", "sync", description="sync: a node sum, then 2(k-1)/k S across the nodes (the mesh; "
                                           "the ring at one rank on each of 3 or more nodes)"),
    Mode("eddis-sync-fp16", "sync", 2, description="sync, fp16 on the wire"),
    Mode("eddis-sync-bf16", "sync", 2, description="sync, bf16 on the wire"),
    Mode("eddis-sync-mesh", "hierarchical", listed=False,
         description="sync by the mesh whatever the layout (EDDIS_SYNC_REDUCE=hierarchical)"),
    Mode("eddis-sync-fp16-mesh", "hierarchical", 2, listed=False, description="the mesh, fp16 on the wire"),
    Mode("eddis-sync-ring", "smb-ring", listed=False,
         description="sync by a ring through the servers, one rank a node (EDDIS_SYNC_REDUCE=ring)"),
    Mode("eddis-sync-fp16-ring", "smb-ring", 2, listed=False, description="the ring, fp16 on the wire"),
    Mode("eddis-sync-flat", "flat", description="sync, every rank's slot to the servers "
                                                "(EDDIS_SYNC_REDUCE=server)"),
    Mode("eddis-balanced", "sync", balanced=True, description="balanced sync: the global batch "
                                                                      "split by the ranks' speeds"),
    Mode("eddis-easgd", "easgd", description="easgd: every rank a worker, exchanges every tau steps"),
    Mode("eddis-hybrid", "hybrid", description="hybrid: sync in a node's group, easgd between groups"),
    Mode("eddis-hybrid-balanced", "hybrid", balanced=True, description="hybrid, a group's batch split by "
                                                                       "its ranks' speeds"),
)}
LISTED = [name for name, m in MODES.items() if m.listed]
SOLO = "solo"   # the ideal: every rank alone, nothing communicated
RING = "ddp"


def get(name):
    from ..errors import ConfigError

    try:
        return MODES[name]
    except KeyError:
        raise ConfigError(f"unknown mode {name!r}; the modes are {', '.join(MODES)}") from None
