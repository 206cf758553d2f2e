"""Process-wide runtime state: ranks, topology, the SMB connection, shutdown.

    init()                  # collective; idempotent
    rank(), size()          # MPI COMM_WORLD
    local_rank(), local_size()   # ranks on this node (EDDIS_HOSTNAME, else MPI processor name)
    group(), num_groups()   # EDDIS_GROUP (hetjob component) else one group per node
    hostname(), comm()      # comm(): the runtime's private duplicate of COMM_WORLD
    smb_client()            # collective on first call: the eddis.smb.Client of the job
    shutdown()              # collective; also run at interpreter exit

Ranks come from MPI (mpi4py); when the launcher exported EDDIS_RANK/EDDIS_SIZE
they must agree with MPI, which catches ``srun`` without ``--mpi=pmix``.

SMB: when the run directory (EDDIS_RUN_DIR) holds published servers (the
Slurm job script and ``eddis-train --local`` start them), the client connects
to those. Otherwise, for a plain ``mpirun`` on one node, rank 0 creates a run
directory, starts an in-process ``eddis.smb.Server`` (memory: SMB_MEMORY) and
tells the others where it is; ``shutdown()`` stops it and removes the
directory. Set EDDIS_EMBEDDED_SERVER=0 to make a missing server an error.
"""
import atexit
import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

from .. import identity, settings
from ..errors import ConfigError, ParameterDriftError, UsageError

log = logging.getLogger("eddis.core")

_state = None
_state_lock = threading.RLock()


class _Runtime:
    def __init__(self):
        import mpi4py

        mpi4py.rc.thread_level = getattr(mpi4py.rc, "thread_level", "multiple") or "multiple"
        if _skips_mpi_finalize():
            mpi4py.rc.finalize = False
        from mpi4py import MPI

        self.MPI = MPI
        world = MPI.COMM_WORLD
        self.comm = world.Dup()
        # the script's collectives (eddis.core.engine) run on a thread of their own: on this
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
        self.departure = None   # replaces shutdown()'s MPI barriers (elastic runs: core/elastic.py)
        self._check_launcher_ranks()
        self.hostname = identity.node_name()
        from . import collectives

        hosts = collectives.allgather_object(self.hostname, comm=self.comm, what="eddis.init (topology)")
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
    ranks have already left together through SMB (core/elastic.py) by then."""
    env = settings.environ(environ)
    return bool(settings.get("EDDIS_ELASTIC", env) and settings.get("EDDIS_LAUNCHED", env)
                and "OMPI_COMM_WORLD_RANK" in env)


def require(what="this call"):
    if _state is None:
        raise UsageError(f"{what} needs the EDDIS runtime: call eddis.init() first "
                         "(once per process, before creating the DistributedOptimizer).")
    return _state


def init():
    """Start the runtime (collective over COMM_WORLD). Calling it again is a no-op."""
    global _state
    with _state_lock:
        if _state is not None:
            return
        settings.check_environment()
        logging.getLogger("eddis").setLevel(settings.get("EDDIS_LOG_LEVEL"))
        _state = _Runtime()
        from ..timeline import trace
        from . import observe  # EDDIS_TIMELINE / EDDIS_PROFILE (collective)

        trace.set_default_comm(comm)
        observe.on_init(_state.comm, _state.rank, _state.size, _state.hostname, _state.group)
        if settings.get("EDDIS_CHECKPOINT_DIR") is not None:
            from . import checkpoint

            checkpoint.interval_from_settings()   # a malformed interval fails here, not later
            checkpoint.install_signal_handler()   # SIGUSR1: checkpoint at the next step, then stop
            if settings.get("EDDIS_CHECKPOINT_ON_SIGTERM"):
                checkpoint.install_signal_handler(signal.SIGTERM)   # Slurm's preemption notice
            checkpoint.request_from_run_dir()     # a request sent before the handler was in place
        atexit.register(_exit_hook)
        from ..smb import rundir

        rundir.note_initialized()
        if sys.excepthook is _previous_excepthook:
            sys.excepthook = _excepthook


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
    """The communicator of the collectives a script calls (eddis.core.engine)."""
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


# ------------------------------------------------------------------ SMB
def _published_servers(run_dir):
    if not run_dir:
        return 0
    servers = Path(run_dir) / "servers"
    return len(list(servers.glob("*.json"))) if servers.is_dir() else 0


def smb_client():
    """The job's SMB client, connected on first use (collective on that first call)."""
    st = require("the SMB connection")
    with _state_lock:
        if st.client is None:
            st.client = _connect(st)
        return st.client


def _connect(st):
    from . import collectives
    from .. import smb

    timeout = settings.get("SMB_CONNECT_TIMEOUT")
    configured = settings.get("EDDIS_RUN_DIR")
    decision = None
    if st.rank == 0:
        decision = ("servers", configured) if _published_servers(configured) else ("embedded", None)
        if decision[0] == "embedded":
            decision = _start_embedded(st, configured)
    decision = collectives.broadcast_object(decision, comm=st.comm, timeout=timeout + 60,
                                            what="eddis SMB connection")
    kind, value = decision
    if kind == "error":
        raise ConfigError(value)
    st.run_dir = value
    return smb.Client(run_dir=value, timeout=settings.get("SMB_TIMEOUT"))


def _start_embedded(st, configured):
    """On rank 0: start an in-process SMB server. Returns the broadcast decision."""
    from .. import smb
    from ..smb import rundir

    if not settings.get("EDDIS_EMBEDDED_SERVER"):
        return ("error", f"no SMB server has published itself in the run directory "
                f"{configured or '(EDDIS_RUN_DIR unset)'} and EDDIS_EMBEDDED_SERVER=0. Start "
                "the job with eddis_job.sh / `eddis-train`, or allow the embedded server.")
    if st.num_nodes > 1:
        return ("error", f"no SMB server has published itself in the run directory "
                f"{configured or '(EDDIS_RUN_DIR unset)'}, and the ranks span {st.num_nodes} "
                "nodes, so an embedded server cannot serve them. Launch with eddis_job.sh or "
                "`srun eddis-train` (one smb-server per node), or use mode='allreduce'.")
    path = Path(configured) if configured else rundir.default_run_dir()
    created = not path.exists()
    try:
        rundir.create_run_dir(path)
        server = smb.Server(path, index=0, memory=settings.get("SMB_MEMORY"))
        server.start()
    except Exception as exc:  # every rank must hear about it, not only rank 0
        if created:
            shutil.rmtree(path, ignore_errors=True)
        return ("error", f"could not start the embedded SMB server: {type(exc).__name__}: {exc}")
    # The runtime stops it at exit, after the barrier that lets every rank finish
    # with it; the server's own exit hook would run first and pull it from under them.
    atexit.unregister(getattr(server, "_stop_at_exit", None) or (lambda: None))
    st.server = server
    st.owned_run_dir = path if created else None
    log.info("started an embedded SMB server in %s", path)
    return ("servers", str(path))


# ------------------------------------------------------------------ shutdown
def shutdown():
    """Stop reducers, disconnect from SMB, stop an embedded server (collective)."""
    global _state
    with _state_lock:
        st = _state
        if st is None:
            return
        if st.broken is not None:
            _abort(st)
        from . import agreement, checkpoint, collectives

        checkpoint.ignore_signal_requests()   # a checkpoint request from now on must not kill it

        errors = []
        try:
            agreement.check_at_shutdown()  # while the reducers and the parameters are still there
        except Exception as exc:  # shut down all the same, then raise it
            errors.append(exc)
        agreement.reset()
        for obj in reversed(list(st.closables)):
            try:
                obj.close()
            except Exception as exc:  # keep shutting down the rest
                errors.append(exc)
        st.closables.clear()
        try:
            from ..timeline import trace
            from . import observe  # closes the timeline; rank 0 merges the profile

            observe.on_shutdown(st.comm)
            trace.set_default_comm(None)
        except Exception as exc:
            errors.append(exc)
        try:
            # smb_client() is collective, so either every rank has a client or none has;
            # only rank 0 knows whether it also runs the embedded server
            connected = st.client is not None or st.server is not None
            if connected and st.departure is not None:
                st.departure()   # elastic: the live ranks only; no embedded server to wait for
            elif connected:
                collectives.barrier(comm=st.comm, what="eddis.shutdown")
            if st.client is not None:
                st.client.close()
                st.client = None
            if connected and st.departure is None:
                # every client must have left before an embedded server goes away
                collectives.barrier(comm=st.comm, what="eddis.shutdown (server)")
        except Exception as exc:
            errors.append(exc)
        finally:
            if st.server is not None:
                st.server.stop()
                st.server = None
            if st.owned_run_dir is not None:
                shutil.rmtree(st.owned_run_dir, ignore_errors=True)
            for communicator in (st.api_comm, st.comm):
                try:
                    communicator.Free()
                except Exception:
                    pass
            _state = None
        if errors:
            raise errors[0]


def _abort(st):
    sys.stderr.write(f"eddis: aborting the MPI job after a failed collective ({st.broken})\n")
    sys.stderr.flush()
    if st.server is not None:
        st.server.stop()
    if st.owned_run_dir is not None:
        shutil.rmtree(st.owned_run_dir, ignore_errors=True)
    st.MPI.COMM_WORLD.Abort(1)


_uncaught = []


def _excepthook(kind, value, tb):
    _uncaught.append(value)
    _previous_excepthook(kind, value, tb)


_previous_excepthook = sys.excepthook


def _exit_hook():
    if _state is None:
        return
    if _uncaught and _state.size > 1:
        # The other ranks may wait for this one in a collective: end the job now
        # (after the traceback is out) rather than let them time out.
        mark_broken(f"uncaught {type(_uncaught[0]).__name__} on rank {_state.rank}")
    try:
        shutdown()
    except ParameterDriftError as exc:
        # Python ignores the failure of an exit hook, so the run would end as a success:
        # every rank saw the same check, so each ends MPI itself and exits with status 1
        sys.stderr.write(f"eddis: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        try:
            from mpi4py import MPI

            MPI.Finalize()
        finally:
            os._exit(1)
    except Exception as exc:  # at exit there is no caller left to tell
        sys.stderr.write(f"eddis: shutdown at exit failed: {exc}\n")
