"""Mode ``hybrid``: synchronous inside a group, elastic averaging between groups.

A *group* is a set of ranks of one kind: one hetjob component (one partition,
one GPU generation; the launcher exports EDDIS_GROUP), or, without a launcher,
one node. Inside a group, GPUs are alike, so synchronous data parallelism loses
nothing; between groups they are not, so the groups never wait for each other:

- every step, the ranks of a group average their gradients through SMB (the
  sync reduction: each rank writes its slot, the server computes the
  sample-weighted average once all the group's contributions are in) and step
  their optimizers alike, so a group's ranks hold the same parameters;
- every ``tau`` steps the group's *leader* (its lowest rank) does one EASGD
  exchange with the centre variable (``eddis.core.hetero.easgd``) for the whole group,
  and broadcasts the move ``d = pull (x - centre)`` to the group over MPI, so
  every member applies the same ``x -= d`` and the group stays identical (the
  group's mass in the throughput weighting counts all its ranks' iterations).

Why one leader instead of every member exchanging with alpha / group size: the
members would read the centre at different moments (other groups move it in
between), apply different moves, and the group's copies would drift apart;
the broadcast keeps them bit-identical and costs one intra-group message per
exchange. The exchanging workers are therefore the groups: alpha defaults to
0.9 / number of groups.

The reducer of mode ``hybrid`` (the sync reduction among a group's ranks) is
:mod:`eddis.core.reduce.group`; the groups' communicators and members are
:mod:`eddis.core.comm.groups`.
"""
import numpy as np

from ... import settings
from ...errors import ConfigError
from ..comm import collectives


def check_groups(members):
    """Groups must be numbered 0..G-1: they index the centre's per-worker slots."""
    ids = sorted(members)
    if ids != list(range(len(ids))):
        raise ConfigError(f"hybrid needs groups numbered 0..G-1, got {ids}; EDDIS_GROUP (the hetjob "
                          "component) sets them, or unset it for one group per node")


def default_alpha(workers):
    """EASGD's moving rate: beta = workers x alpha = 0.9 (Zhang, Choromanska, LeCun 2015)."""
    alpha = settings.get("EDDIS_EASGD_ALPHA")
    return 0.9 / max(1, int(workers)) if alpha is None else float(alpha)


def share_group_move(averager, move, comm, start=0, count=None):
    """Overlapped exchanges (EDDIS_EASGD_OVERLAP): the leader's ``move`` of the exchange it
    began (of ``count`` elements from ``start``: a stripe), to every member of the group
    (collective over ``comm``); the members get it in that part of ``averager.scratch``."""
    if comm.Get_rank() != 0:
        count = averager.scratch.size - start if count is None else count
        move = averager.scratch[start:start + count]
    if comm.Get_size() > 1:
        collectives.broadcast_array(move, root=0, comm=comm, what="hybrid exchange (group broadcast)")
    return move


def exchange_group(averager, x, comm):
    """One hybrid exchange: the group leader moves ``x`` (flat float32) and the centre,
    then every member applies the leader's move (kept in ``averager.scratch``).
    Collective over ``comm``."""
    leader = comm.Get_rank() == 0
    move = share_group_move(averager, averager.exchange(x) if leader else None, comm)
    if not leader:
        np.subtract(x, move, out=x)
    return move
