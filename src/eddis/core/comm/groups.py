"""The communicators of the groups (EDDIS_GROUP, else one per node) and who is in them.

``group_comm()`` (this rank's group, ranks in COMM_WORLD order) and ``world_comm()`` (a
private duplicate of the runtime's communicator) are created on first use (collective) and
freed by ``eddis.shutdown()``; ``group_members()`` maps every group to its world ranks.
"""
from . import collectives, runtime

_comms = {}


class _CommCloser:
    """Frees the cached communicators at eddis.shutdown()."""

    def close(self):
        comms = [comm for _, comm in _comms.values()]
        _comms.clear()
        for comm in comms:
            try:
                comm.Free()
            except Exception:
                pass


def _cached(key, make):
    st = runtime.require("eddis group communicators")
    entry = _comms.get(key)
    if entry is not None and entry[0] is st:
        return entry[1]
    if not _comms:
        runtime.register_closable(_CommCloser())
    comm = make()
    _comms[key] = (st, comm)
    return comm


def group_comm():
    """MPI communicator of the ranks of this rank's group (collective on first call)."""
    return _cached("group", lambda: runtime.comm().Split(runtime.group(), runtime.rank()))


def world_comm():
    """A private duplicate of the runtime's communicator (collective on first call)."""
    return _cached("world", lambda: runtime.comm().Dup())


def group_members():
    """World ranks of every group: ``{group: [ranks]}`` (collective)."""
    groups = collectives.allgather_object(runtime.group(), what="hybrid: group membership")
    members = {}
    for r, g in enumerate(groups):
        members.setdefault(g, []).append(r)
    return members


def group_ranks(comm):
    """World ranks of the members of ``comm`` (a group's communicator), in its order."""
    from mpi4py import MPI

    mine, world = comm.Get_group(), runtime.comm().Get_group()
    try:
        return list(MPI.Group.Translate_ranks(mine, list(range(comm.Get_size())), world))
    finally:
        mine.Free()
        world.Free()
