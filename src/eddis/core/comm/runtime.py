"""Process-wide runtime state: ranks, topology, communicators, what shutdown closes.

    rank(), size()          # MPI COMM_WORLD
    local_rank(), local_size()   # ranks on this node (EDDIS_HOSTNAME, else MPI processor name)
    group(), num_groups()   # EDDIS_GROUP (hetjob component) else one group per node
    hostname(), comm()      # comm(): the runtime's private duplicate of COMM_WORLD

Ranks come from MPI (mpi4py); when the launcher exported EDDIS_RANK/EDDIS_SIZE
they must agree with MPI, which catches ``srun`` without ``--mpi=pmix``.

This module only holds the state; :mod:`eddis.core.lifecycle` starts it (``eddis.init()``:
MPI, then the topology, which takes a collective) and ends it (``eddis.shutdown()``), and
:mod:`eddis.core.comm.connection` connects it to the job's SMB servers.
"""
import contextlib
import logging
import threading

from ... import identity, settings
from ...errors import ConfigError, UsageError

log = logging.getLogger("eddis.core")

_state = None
lock = threading.RLock()   # held while the state is started, connected or ended


class Runtime:
    """The state of one eddis.init() .. eddis.shutdown(): built by :func:`eddis.core.lifecycle.init`."""

    def __init__(self):
        import mpi4py

        mpi4py.rc.thread_level = getattr(mpi4py.rc, "thread_level", "multiple") or "multiple"
        if _skips_mpi_finalize():
            mpi4py.rc.finalize = False
        from mpi4py import MPI

        self.MPI = MPI
        world = MPI.COMM_WORLD
        self.comm = world.Dup()
        # the script's collectives (eddis.core.comm.engine) run on a thread of their own: on this
        # communicator they keep their order whatever the runtime's other collectives do
        self.api_comm = world.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.thread_multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self._mpi_lock = None if self.thread_multiple else threading.RLock()
        self.broken = None
        self.client = None
        self.server = None
        self.owned_run_dir = None
        self.run_dir = None
        self.closables = []
        self.departure = None   # replaces shutdown()'s MPI barriers (elastic runs: core/comm/elastic.py)
        self._check_launcher_ranks()
        self.hostname = identity.node_name()
        self.hosts = None

    def set_topology(self, hosts):
        """Every rank's host name, in rank order (gathered by eddis.init())."""
        self.hosts = hosts
        unique = list(dict.fromkeys(hosts))
        self.node_index = unique.index(self.hostname)
        self.num_nodes = len(unique)
        same = [r for r, h in enumerate(hosts) if h == self.hostname]
        self.local_rank = same.index(self.rank)
        self.local_size = len(same)
        group, num_groups = identity.launcher_group(), identity.launcher_num_groups()
        self.group = self.node_index if group is None else group
        self.num_groups = self.num_nodes if num_groups is None else num_groups

    def _check_launcher_ranks(self):
        for name, text, value in (("EDDIS_RANK", identity.launcher_rank(), self.rank),
                                  ("EDDIS_SIZE", identity.launcher_size(), self.size)):
            if text is not None and text != value:
                raise ConfigError(
                    f"{name}={text} from the launcher, but MPI COMM_WORLD says {value} "
                    f"(rank {self.rank} of {self.size}). Under Slurm start the ranks with "
                    "`srun --mpi=pmix eddis-train ...` (without pmix every rank is a "
                    "1-process MPI job); outside Slurm use `eddis-train --local -n N` or mpirun.")


def _skips_mpi_finalize(environ=None):
    """Whether this rank ends without MPI_Finalize: an elastic rank that eddis-train started with
    mpirun. Open MPI's MPI_Finalize is a fence of every process, which never completes once a
    node's daemon has lost all its ranks (one rank a node, that rank lost); the launcher gives
    mpirun ``orte_allowed_exit_without_sync`` (eddis.launch.elastic.MPIRUN_OPTIONS), and the live
    ranks have already left together through SMB (core/comm/elastic.py) by then."""
    env = settings.environ(environ)
    return bool(settings.get("EDDIS_ELASTIC", env) and settings.get("EDDIS_LAUNCHED", env)
                and "OMPI_COMM_WORLD_RANK" in env)


def install(state):
    """Make ``state`` (a started :class:`Runtime`) the process's runtime."""
    global _state
    _state = state


def clear():
    """The runtime ended (eddis.shutdown())."""
    global _state
    _state = None


def state():
    """The process's :class:`Runtime`, or None before eddis.init()."""
    return _state


def require(what="this call"):
    if _state is None:
        raise UsageError(f"{what} needs the EDDIS runtime: call eddis.init() first "
                         "(once per process, before creating the DistributedOptimizer).")
    return _state


def is_initialized():
    return _state is not None


def rank():
    return require("eddis.rank()").rank


def size():
    return require("eddis.size()").size


def local_rank():
    return require("eddis.local_rank()").local_rank


def local_size():
    return require("eddis.local_size()").local_size


def group():
    return require("eddis.group()").group


def num_groups():
    return require("eddis.num_groups()").num_groups


def hostname():
    return require("eddis.hostname()").hostname


def comm():
    """The runtime's private communicator (a duplicate of MPI COMM_WORLD)."""
    return require("eddis collectives").comm


def api_comm():
    """The communicator of the collectives a script calls (eddis.core.comm.engine)."""
    return require("eddis collectives").api_comm


def thread_multiple():
    return require().thread_multiple


def mpi_lock():
    """Context manager that serializes MPI calls when MPI lacks THREAD_MULTIPLE."""
    st = _state
    if st is None or st._mpi_lock is None:
        return contextlib.nullcontext()
    return st._mpi_lock


def mark_broken(reason):
    """Record that a collective timed out: shutdown() then aborts instead of finalizing."""
    if _state is not None and _state.broken is None:
        _state.broken = reason


def register_closable(obj):
    """Objects with ``close()`` (reducers) closed by shutdown(), newest first."""
    require().closables.append(obj)


def set_departure(fn):
    """``fn()`` waits at shutdown() for the ranks still alive, in place of the MPI barriers
    (which a dead rank never joins); it runs while the SMB client is still connected."""
    require().departure = fn


def unregister_closable(obj):
    if _state is not None and obj in _state.closables:
        _state.closables.remove(obj)
