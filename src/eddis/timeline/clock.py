"""Clock offsets between ranks, so every trace lands on rank 0's time axis.

NTP-style: a rank sends its monotonic time t0, rank 0 answers with its own time
t1, the rank reads t2 on arrival. If the message took as long each way, rank 0's
clock reads ``local + offset`` with ``offset = t1 - (t0 + t2) / 2``; whatever the
split, the true offset lies within ``RTT / 2`` of that. Of several rounds the one
with the smallest round trip wins, and its ``RTT / 2`` is the uncertainty written
into the trace.

Processes on the same running kernel share CLOCK_MONOTONIC exactly (same clock
domain, see :func:`clock_domain`); the merge uses offset 0 for those and the
measurement only across domains (nodes).

The timeline's clock (``perf_ns``), its domain and its anchor to the wall clock live here too,
below the trace writer (:mod:`eddis.timeline.trace`) that stamps every event with them.
"""
import socket
import time
import warnings

from ..errors import EddisWarning

CLOCK_TAG = 0x7E11
perf_ns = time.perf_counter_ns


class TimelineWarning(EddisWarning):
    """The timeline could not be written; it was turned off and training went on."""


def clock_domain():
    """Processes with equal domains read the same CLOCK_MONOTONIC (same running kernel)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "host:" + socket.gethostname()


def clock_anchor(samples=5):
    """A (monotonic ns, wall ns) pair read as close together as this machine allows."""
    best = None
    for _ in range(samples):
        a = perf_ns()
        wall = time.time_ns()
        b = perf_ns()
        if best is None or b - a < best[2]:
            best = ((a + b) // 2, wall, b - a)
    return best[0], best[1]


def _wait(req, deadline):
    """Spin on an MPI request until it completes or ``deadline`` (perf ns) passes."""
    while not req.Test():
        if perf_ns() > deadline:
            try:
                req.Cancel()
                req.Wait()
            except Exception:  # an already-matched request cannot be cancelled: nothing to undo
                pass
            return False
    return True


def measure_offsets_mpi(comm, rounds=16, root=0, timeout=30.0):
    """Collective over ``comm``: each rank's (offset_ns, uncertainty_ns, rounds) to ``root``.

    ``root``'s clock reads ``local + offset_ns``. A peer that does not answer within
    ``timeout`` seconds gets ``(None, None, 0)`` and one warning; nothing hangs.
    """
    import numpy as np
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    buf = np.zeros(1, dtype=np.int64)
    deadline = perf_ns() + int(timeout * 1e9)
    if rank == root:
        missing = []
        for peer in range(size):
            if peer == root:
                continue
            for _ in range(rounds):
                if not _wait(comm.Irecv([buf, MPI.INT64_T], source=peer, tag=CLOCK_TAG), deadline):
                    missing.append(peer)
                    break
                buf[0] = perf_ns()
                comm.Send([buf, MPI.INT64_T], dest=peer, tag=CLOCK_TAG)
        if missing:
            warnings.warn(f"clock offset not measured for ranks {missing}: no answer within {timeout}s; "
                          f"their timeline events are placed by wall clock", TimelineWarning, stacklevel=2)
        return 0, 0, rounds
    best_offset, best_rtt = None, None
    for _ in range(rounds):
        t0 = perf_ns()
        buf[0] = t0
        comm.Send([buf, MPI.INT64_T], dest=root, tag=CLOCK_TAG)
        if not _wait(comm.Irecv([buf, MPI.INT64_T], source=root, tag=CLOCK_TAG), deadline):
            warnings.warn(f"rank {rank}: rank {root} did not answer the clock ping within {timeout}s; "
                          f"timeline events of this rank are placed by wall clock", TimelineWarning, stacklevel=2)
            return None, None, 0
        t2 = perf_ns()
        rtt = t2 - t0
        if best_rtt is None or rtt < best_rtt:
            best_rtt = rtt
            best_offset = int(buf[0]) - (t0 + t2) // 2
    return best_offset, (best_rtt + 1) // 2, rounds


def sync_clock_mpi(comm, timeline, rounds=16, timeout=30.0):
    """Measure this rank's offset to rank 0 of ``comm`` and write it into ``timeline``.

    Collective: every rank of ``comm`` must call it (``timeline`` may be None on a
    rank whose timeline is off; it still answers the others).
    """
    start = time.perf_counter()
    offset, uncertainty, samples = measure_offsets_mpi(comm, rounds=rounds, timeout=timeout)
    if timeline is not None and offset is not None:
        method = "reference" if comm.Get_rank() == 0 else "mpi ping-pong, min RTT of %d" % samples
        timeline.set_clock_offset(offset, uncertainty, method, samples=samples)
        timeline.instant("clock_sync", cat="eddis", args={
            "offset_to_rank0_ns": offset, "uncertainty_ns": uncertainty,
            "seconds": round(time.perf_counter() - start, 6)})
    return offset, uncertainty
