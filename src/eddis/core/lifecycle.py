"""``init()`` and ``shutdown()``: the runtime's start and end, over every part of core.

    init()                  # collective; idempotent; also registers shutdown at interpreter exit
    shutdown()              # collective: the last parameter check, the reducers, the timeline,
                            # the SMB connection, an embedded server, the communicators

This module sits on top of core: it starts the process state (:mod:`eddis.core.comm.runtime`) and
the parts that hang off it (the timeline and profile, the checkpoint signals), and ends them
in the reverse order; nothing below it calls up into it.
"""
import atexit
import logging
import os
import signal
import sys

from .. import settings
from ..errors import ParameterDriftError
from ..smb import rundir
from ..timeline import trace
from .checkpoint import folders as checkpoint
from . import heap
from .comm import collectives, connection, observe, runtime
from .progress import agreement


def init():
    """Start the runtime (collective over COMM_WORLD). Calling it again is a no-op."""
    with runtime.lock:
        if runtime.is_initialized():
            return
        settings.check_environment()
        logging.getLogger("eddis").setLevel(settings.get("EDDIS_LOG_LEVEL"))
        if settings.get("EDDIS_KEEP_FREED_MEMORY"):
            heap.keep_freed_memory()
        st = runtime.Runtime()
        st.set_topology(collectives.allgather_object(st.hostname, comm=st.comm, what="eddis.init (topology)"))
        runtime.install(st)
        trace.set_default_comm(runtime.comm)
        observe.on_init(st.comm, st.rank, st.size, st.hostname, st.group)   # EDDIS_TIMELINE / EDDIS_PROFILE
        if settings.get("EDDIS_CHECKPOINT_DIR") is not None:
            checkpoint.interval_from_settings()   # a malformed interval fails here, not later
            checkpoint.install_signal_handler()   # SIGUSR1: checkpoint at the next step, then stop
            if settings.get("EDDIS_CHECKPOINT_ON_SIGTERM"):
                checkpoint.install_signal_handler(signal.SIGTERM)   # Slurm's preemption notice
            checkpoint.request_from_run_dir()     # a request sent before the handler was in place
        atexit.register(_exit_hook)
        rundir.note_initialized()
        if sys.excepthook is _previous_excepthook:
            sys.excepthook = _excepthook


def shutdown():
    """Stop reducers, disconnect from SMB, stop an embedded server (collective)."""
    with runtime.lock:
        st = runtime.state()
        if st is None:
            return
        if st.broken is not None:
            _abort(st)
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
            observe.on_shutdown(st.comm)   # closes the timeline; rank 0 merges the profile
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
            connection.stop_embedded(st)
            for communicator in (st.api_comm, st.comm):
                try:
                    communicator.Free()
                except Exception:
                    pass
            runtime.clear()
        if errors:
            raise errors[0]


def _abort(st):
    sys.stderr.write(f"eddis: aborting the MPI job after a failed collective ({st.broken})\n")
    sys.stderr.flush()
    connection.stop_embedded(st)
    st.MPI.COMM_WORLD.Abort(1)


_uncaught = []


def _excepthook(kind, value, tb):
    _uncaught.append(value)
    _previous_excepthook(kind, value, tb)


_previous_excepthook = sys.excepthook


def _exit_hook():
    st = runtime.state()
    if st is None:
        return
    if _uncaught and st.size > 1:
        # The other ranks may wait for this one in a collective: end the job now
        # (after the traceback is out) rather than let them time out.
        runtime.mark_broken(f"uncaught {type(_uncaught[0]).__name__} on rank {st.rank}")
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
