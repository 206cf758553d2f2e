"""Collectives over MPI that never wait forever.

Each call starts the non-blocking MPI operation and polls it (:mod:`eddis.core.comm.waits`) until
it completes or ``timeout`` seconds (default ``EDDIS_COMM_TIMEOUT``) pass; then it raises
:class:`CollectiveTimeoutError`, naming the call, so a rank that crashed or
skipped a collective turns into an error instead of a hang. After such a
timeout the communicator is unusable; :func:`eddis.core.shutdown` aborts the
MPI job instead of finalizing it.

- ``broadcast_array(array, root=0)``: in place, any numpy dtype MPI knows.
- ``allreduce_array(array, op="sum"|"average"|"min"|"max", out=None)``.
- ``broadcast_object(obj, root=0)``, ``allgather_object(obj)``: pickled.
- ``allgatherv_bytes(payload, lengths)``: bytes of known lengths, concatenated.
- ``barrier()``.
- ``check_same(text, what)``: raise ConfigError on every rank unless ``text``
  is identical everywhere (naming the ranks and the first line that differs).
"""
import pickle

import numpy as np

from ... import settings, timeline
from ...errors import ConfigError
from . import adasum, runtime
from .ops import resolve_op
from .waits import start, wait_request


def _timeout(timeout):
    return settings.get("EDDIS_COMM_TIMEOUT") if timeout is None else float(timeout)


def _comm(comm):
    return runtime.comm() if comm is None else comm


_MPI_OPS = {"sum": "SUM", "average": "SUM", "min": "MIN", "max": "MAX"}  # average: SUM, then / size


def allreduce_array(array, op="sum", out=None, comm=None, timeout=None, what="allreduce"):
    """Reduce a numpy array over all ranks; in place when ``out`` is ``array``.

    ``op``: sum, average (sum divided by the number of ranks), min or max.
    Returns the result array (``out``, or a new array when ``out`` is None).
    """
    from mpi4py import MPI

    key = resolve_op(op).name  # one spelling of the ops for every caller
    comm = _comm(comm)
    if key == "adasum":
        src = np.asarray(array)
        if src.dtype.kind != "f":
            raise ConfigError(f"{what}: Adasum combines float tensors by their directions; "
                              f"{src.dtype.name} is not one: reduce a float tensor, or use op=Sum")
        result = adasum.allreduce_array(src, comm, _timeout(timeout), what).astype(src.dtype, copy=False)
        if out is None:
            return result
        np.copyto(out, result)
        return out
    src = np.ascontiguousarray(array)
    if out is None:
        out = src.copy()
    elif out is not src:
        np.copyto(out, src)
    req = start(comm.Iallreduce, MPI.IN_PLACE, out, getattr(MPI, _MPI_OPS[key]))
    wait_request(req, _timeout(timeout), what)
    if key == "average":
        if np.issubdtype(out.dtype, np.integer):
            raise ConfigError("average of an integer array: use op='sum' or a float array")
        out /= comm.Get_size()
    return out


def broadcast_array(array, root=0, comm=None, timeout=None, what="broadcast"):
    """Overwrite ``array`` (C-contiguous, writable) with root's values; returns it."""
    comm = _comm(comm)
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise ConfigError("broadcast_array needs a writable C-contiguous numpy array; "
                          "pass np.ascontiguousarray(x) and copy the result back")
    wait_request(start(comm.Ibcast, array, root=root), _timeout(timeout), what)
    return array


def broadcast_object(obj, root=0, comm=None, timeout=None, what="broadcast_object"):
    """Root's ``obj`` on every rank (pickled)."""
    comm = _comm(comm)
    t = _timeout(timeout)
    is_root = comm.Get_rank() == root
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if is_root else b""
    length = np.array([len(payload)], dtype=np.int64)
    wait_request(start(comm.Ibcast, length, root=root), t, what)
    data = np.frombuffer(payload, dtype=np.uint8).copy() if is_root else np.empty(int(length[0]), np.uint8)
    wait_request(start(comm.Ibcast, data, root=root), t, what)
    return obj if is_root else pickle.loads(data.tobytes())


def allgather_object(obj, comm=None, timeout=None, what="allgather_object"):
    """List of every rank's ``obj``, in rank order."""
    comm = _comm(comm)
    t = _timeout(timeout)
    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    lengths = np.empty(comm.Get_size(), dtype=np.int64)
    mine = np.array([payload.size], dtype=np.int64)
    wait_request(start(comm.Iallgather, mine, lengths), t, what)
    data, offsets = allgatherv_bytes(payload, lengths, comm=comm, timeout=t, what=what)
    return [pickle.loads(data[d:d + n].tobytes()) for d, n in zip(offsets, lengths)]


def allgatherv_bytes(payload, lengths, comm=None, timeout=None, what="allgather"):
    """Every rank's ``payload`` (uint8, ``lengths[rank]`` bytes; every rank knows all the
    lengths) concatenated in rank order, and where each rank's part starts."""
    from mpi4py import MPI

    comm = _comm(comm)
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    data = np.empty(int(lengths.sum()), dtype=np.uint8)
    wait_request(start(comm.Iallgatherv, [payload, MPI.BYTE], [data, (lengths, offsets), MPI.BYTE]),
                 _timeout(timeout), what)
    return data, offsets


def barrier(comm=None, timeout=None, what="barrier"):
    comm = _comm(comm)
    with timeline.span(timeline.BARRIER, args={"what": what}):
        wait_request(start(comm.Ibarrier), _timeout(timeout), what)


def check_same(text, what, fix, comm=None, timeout=None):
    """Raise ConfigError on every rank unless ``text`` is the same on all ranks.

    Compares digests first (one small allgather), and only on a mismatch gathers
    the texts to name the ranks and the first differing line.
    """
    import hashlib

    comm = _comm(comm)
    digest = hashlib.sha256(text.encode()).hexdigest()
    digests = allgather_object(digest, comm=comm, timeout=timeout, what=f"{what} check")
    if len(set(digests)) == 1:
        return
    texts = allgather_object(text, comm=comm, timeout=timeout, what=f"{what} check")
    ref = texts[0].splitlines()
    for r, t in enumerate(texts):
        lines = t.splitlines()
        if lines == ref:
            continue
        for i in range(max(len(ref), len(lines))):
            a = ref[i] if i < len(ref) else "<nothing>"
            b = lines[i] if i < len(lines) else "<nothing>"
            if a != b:
                raise ConfigError(
                    f"{what} differs between ranks: rank 0 has {a!r} where rank {r} has {b!r} "
                    f"(entry {i}). {fix}")
    raise ConfigError(f"{what} differs between ranks. {fix}")
