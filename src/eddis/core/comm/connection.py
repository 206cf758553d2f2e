"""The job's SMB connection: ``smb_client()``, collective on first use.

When the run directory (EDDIS_RUN_DIR) holds published servers (the Slurm job script and
``eddis-train --local`` start them), the client connects to those. Otherwise, for a plain
``mpirun`` on one node, rank 0 creates a run directory, starts an in-process
``eddis.smb.Server`` (memory: SMB_MEMORY) and tells the others where it is; ``eddis.shutdown()``
stops it (:func:`stop_embedded`) and removes the directory. Set EDDIS_EMBEDDED_SERVER=0 to
make a missing server an error.
"""
import atexit
import logging
import shutil
from pathlib import Path

from ... import settings, smb
from ...errors import ConfigError
from ...smb import rundir
from . import collectives, runtime

log = logging.getLogger("eddis.core")


def _published_servers(run_dir):
    if not run_dir:
        return 0
    servers = Path(run_dir) / "servers"
    return len(list(servers.glob("*.json"))) if servers.is_dir() else 0


def smb_client():
    """The job's SMB client, connected on first use (collective on that first call)."""
    st = runtime.require("the SMB connection")
    with runtime.lock:
        if st.client is None:
            st.client = _connect(st)
        return st.client


def _connect(st):
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


def stop_embedded(st):
    """Stop rank 0's embedded server, if it runs one, and remove the run directory it created."""
    if st.server is not None:
        st.server.stop()
        st.server = None
    if st.owned_run_dir is not None:
        shutil.rmtree(st.owned_run_dir, ignore_errors=True)
