"""SMB (Soft Memory Box): memory lent by smb-server daemons, pooled by clients over UCX.

    from eddis.smb import Client
    with Client(run_dir) as client:
        pool = client.pool("params", 1 << 20, dtype="float32", slots=4)
        pool.write(array, slot=0)
        pool.weighted_sum(3, [0, 1, 2], [0.5, 0.25, 0.25])

See docs/smb-programming.md.
"""
import importlib

# Attributes load on first use, so `python -m eddis.smb.server` / `-m eddis.smb.rundir`
# do not import their own module twice.
_EXPORTS = {
    "Server": "server", "Client": "client", "Request": "requests", "Counter": "counter",
    "Barrier": "client", "Event": "client", "Pool": "pool",
    "create_run_dir": "rundir", "default_run_dir": "rundir", "read_token": "rundir",
    "wait_for_servers": "rundir",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'eddis.smb' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
