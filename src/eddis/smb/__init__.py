"""SMB (Soft Memory Box): memory lent by smb-server daemons, pooled by clients over UCX.

    from eddis.smb import Client
    with Client(run_dir) as client:
        pool = client.pool("params", 1 << 20, dtype="float32", slots=4)
        pool.write(array, slot=0)
        pool.weighted_sum(3, [0, 1, 2], [0.5, 0.25, 0.25])

See docs/smb-programming.md.
"""
from .client import Barrier, Client, Counter, Event, Request
from .pool import Pool
from .rundir import create_run_dir, default_run_dir, read_token, wait_for_servers
from .server import Server

__all__ = ["Server", "Client", "Pool", "Counter", "Barrier", "Event", "Request",
           "create_run_dir", "default_run_dir", "read_token", "wait_for_servers"]
