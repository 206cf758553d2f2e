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
    path: str           # ring, mpi, hierarchical, flat, easgd, hybrid
    wire: int = 4       # bytes of one gradient element on the wire
    balanced: bool = False
    description: str = ""

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
    Mode("eddis-sync", "hierarchical", description="sync: a node sum, then 2(k-1)/k S across the nodes"),
    Mode("eddis-sync-fp16", "hierarchical", 2, description="sync, fp16 on the wire"),
    Mode("eddis-sync-bf16", "hierarchical", 2, description="sync, bf16 on the wire"),
    Mode("eddis-sync-flat", "flat", description="sync, every rank's slot to the servers "
                                                "(EDDIS_SYNC_REDUCE=server)"),
    Mode("eddis-balanced", "hierarchical", balanced=True, description="balanced sync: the global batch "
                                                                      "split by the ranks' speeds"),
    Mode("eddis-easgd", "easgd", description="easgd: every rank a worker, exchanges every tau steps"),
    Mode("eddis-hybrid", "hybrid", description="hybrid: sync in a node's group, easgd between groups"),
    Mode("eddis-hybrid-balanced", "hybrid", balanced=True, description="hybrid, a group's batch split by "
                                                                       "its ranks' speeds"),
)}
SOLO = "solo"   # the ideal: every rank alone, nothing communicated
RING = "ddp"


def get(name):
    from ..errors import ConfigError

    try:
        return MODES[name]
    except KeyError:
        raise ConfigError(f"unknown mode {name!r}; the modes are {', '.join(MODES)}") from None
