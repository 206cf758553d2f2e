"""Elastic continuation of easgd and hybrid runs (EDDIS_ELASTIC=1): who is still alive.

easgd workers meet only through the centre variable, so a worker that dies
takes nothing with it but its own progress; the others can train on. What
would stop them are the few places where every rank waits for every other: the
centre's initialization, the final model ("every worker did its last
exchange"), the staleness bound and the shutdown. Under EDDIS_ELASTIC those
wait for the *live* ranks only, over SMB (an MPI collective with a dead member
never completes, and Open MPI's fault tolerance is not what the launchers
give us).

Liveness is a heartbeat in SMB: one int64 pool, slot 0 the ranks' beats (a
thread of every rank writes a growing count every BEAT_SECONDS), slot 1 the
ranks' barrier phases. An observer counts a rank as lost once its beat has not
moved for EDDIS_ELASTIC_LOST_AFTER seconds of the observer's own clock (no
clocks are compared); a rank that leaves on purpose writes DONE and is gone,
not lost. A heartbeat rather than the launcher's records: it needs no file
system shared by the ranks' nodes, and it also sees a rank whose supervisor died
with it. A node lost as a whole also takes its smb-server: with more than one
server the heartbeats, the centre and the counters are mirrored (:func:`mirroring`,
:mod:`eddis.smb.mirror`), so the survivors go on with the other copies. A hybrid
group whose member died cannot finish its synchronous
reductions: its other members watch their group mates' beats (``depend_on``)
and end themselves (GROUP_LOST_STATUS) once one is lost, instead of sitting
out EDDIS_COMM_TIMEOUT in a reduction; the group is lost as a whole and the
other groups train on.

    members = elastic.join(mode)          # collective (easgd/hybrid set-up); None when not elastic
    members.barrier("final model")        # waits for every rank that is neither there nor gone
    members.exchange(obj, "what")         # the same barrier, passing small objects: {rank: obj}
    members.lost()                        # ranks counted lost so far

What passes through :meth:`Membership.exchange` (a checkpoint's folder, every rank's
position, the outcome of its commit) lies in a second pool of bytes, a fixed part for each
rank, written before the rank's barrier phase and read once every rank has passed it or is
gone. The pool has two buffers, the barrier's phase deciding which: a rank cannot write the
buffer of phase p again before phase p + 2, and it cannot pass phase p + 1 before every
live rank has read phase p's.
"""
import logging
import os
import pickle
import sys
import threading
import time

import numpy as np

from ... import settings
from ...errors import ConfigError, MembershipTimeoutError, UsageError
from . import collectives, connection, runtime

log = logging.getLogger("eddis.core.elastic")

ELASTIC_MODES = ("easgd", "hybrid")
BEAT_SECONDS = 0.5
DONE = 1 << 60        # the beat of a rank that left on purpose
BEATS, PHASES = 0, 1  # the pool's slots
POLL_SECONDS = 0.05
OBJECT_BYTES = 1024   # one rank's part of an exchange: an 8-byte length, then the pickle
LENGTH_BYTES = 8
# A hybrid rank that ends because a member of its group was lost: EX_UNAVAILABLE, not 75
# (eddis.errors.REQUEUE_EXIT_STATUS), which the launcher takes for a checkpointed stop.
GROUP_LOST_STATUS = 69

_members = [None]


def requested(mode):
    """Whether this run is elastic: EDDIS_ELASTIC, in a mode that allows it (else a ConfigError)."""
    if not settings.get("EDDIS_ELASTIC"):
        return False
    if str(mode).lower() not in ELASTIC_MODES:
        raise ConfigError(
            f"EDDIS_ELASTIC=1 lets easgd and hybrid runs train on without a lost rank, but mode "
            f"{mode!r} steps every rank together: a lost rank stops it, and it restarts from its last "
            "checkpoint instead (EDDIS_MAX_RESTARTS). Unset EDDIS_ELASTIC, or use mode easgd or hybrid.")
    return True


class _View:
    """What one thread saw of the ranks' beats and phases, and whom it counts lost."""

    def __init__(self, rank, size, lost_after):
        self.rank, self.lost_after = rank, lost_after
        self.table = np.zeros((2, size), dtype=np.int64)
        self.last_beat = np.full(size, -1, dtype=np.int64)
        self.moved_at = np.full(size, time.monotonic())
        self.lost = set()

    def refresh(self, pool, timeout):
        phases = pool.read_nb(self.table[PHASES], slot=PHASES)
        pool.read(out=self.table[BEATS], slot=BEATS, timeout=timeout)
        phases.wait(timeout)
        now = time.monotonic()
        beats = self.table[BEATS]
        self.moved_at[beats != self.last_beat] = now
        self.last_beat[:] = beats
        new = [int(r) for r in np.flatnonzero((now - self.moved_at > self.lost_after) & (beats != DONE))
               if r != self.rank and int(r) not in self.lost]
        self.lost.update(new)
        return new

    def gone(self, rank):
        return rank in self.lost or self.table[BEATS, rank] == DONE


class Membership:
    """This rank's heartbeat and its view of the others' (see the module docstring)."""

    def __init__(self, client, rank, size, name="eddis.elastic", lost_after=None, timeout=None,
                 mirrored=False):
        self.rank, self.size, self.name = int(rank), int(size), name
        self.lost_after = settings.get("EDDIS_ELASTIC_LOST_AFTER") if lost_after is None else float(lost_after)
        if self.lost_after <= 0:
            raise ConfigError(f"EDDIS_ELASTIC_LOST_AFTER must be > 0 seconds, got {self.lost_after:g}")
        self.timeout = settings.get("EDDIS_COMM_TIMEOUT") if timeout is None else float(timeout)
        self.pool = client.pool(name, self.size, dtype="int64", slots=2, mirrored=mirrored)
        # the beat thread's handle
        self._beat_pool = client.pool(name, self.size, dtype="int64", slots=2, mirrored=mirrored)
        # set up with the heartbeats, while every server lives: a mirrored pool spans them all
        self.objects = client.pool(f"{name}.objects", self.size * OBJECT_BYTES, dtype="uint8", slots=2,
                                   mirrored=mirrored)
        self._view = _View(self.rank, self.size, self.lost_after)
        self.phase = 0
        self._one = np.zeros(1, dtype=np.int64)
        self._mates = None   # hybrid: the ranks without which this rank cannot go on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="eddis-elastic-beat", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ this rank
    def depend_on(self, ranks, what):
        """This rank cannot go on without ``ranks`` (its hybrid group): once one is lost, it
        ends itself (status GROUP_LOST_STATUS), since its synchronous reductions never could."""
        self._mates = (sorted(set(int(r) for r in ranks) - {self.rank}), str(what))

    def _beat(self):
        beat, mine = 0, np.zeros(1, dtype=np.int64)
        view = _View(self.rank, self.size, self.lost_after)   # this thread's own
        while True:
            beat += 1
            mine[0] = beat
            try:
                self._beat_pool.write(mine, slot=BEATS, start=self.rank, timeout=self.timeout)
                if self._mates is not None:
                    self._check_mates(view)
            except Exception as exc:  # the server is gone: the others will count us lost
                log.warning("rank %d: heartbeat stopped: %s", self.rank, exc)
                return
            if self._stop.wait(BEAT_SECONDS):
                return

    def _check_mates(self, view):
        view.refresh(self._beat_pool, self.timeout)
        mates, what = self._mates
        lost = [r for r in mates if r in view.lost]
        if lost:
            # The main thread may sit in a reduction that can never complete: end the process
            # now rather than after EDDIS_COMM_TIMEOUT, so the others stop waiting for it sooner.
            sys.stderr.write(
                f"eddis: rank {self.rank}: rank {', '.join(map(str, lost))} of {what} was lost (no "
                f"heartbeat for {self.lost_after:g} s); {what} cannot finish its synchronous reductions "
                "and stops with it (EDDIS_ELASTIC: the other groups train on)\n")
            sys.stderr.flush()
            os._exit(GROUP_LOST_STATUS)

    def _write(self, slot, value):
        self._one[0] = value
        self.pool.write(self._one, slot=slot, start=self.rank, timeout=self.timeout)

    def close(self):
        """Leave on purpose: stop beating and say DONE, so nobody waits for or mourns this rank."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=self.timeout)
        self._write(BEATS, DONE)

    # ------------------------------------------------------------ the others
    def _refresh(self):
        for r in self._view.refresh(self.pool, self.timeout):
            log.warning("rank %d: rank %d has been counted lost (no heartbeat for %g s); training "
                        "goes on without it", self.rank, r, self.lost_after)

    def lost(self):
        """The ranks counted lost so far (sorted); a lost rank stays lost."""
        self._refresh()
        return sorted(self._view.lost)

    def counted_lost(self):
        """The ranks counted lost as of this rank's last look at the heartbeats (no SMB read)."""
        return sorted(self._view.lost)

    def arrived(self):
        """The ranks at (or past) this rank's latest barrier, as of the last look, sorted."""
        return [int(r) for r in np.flatnonzero(self._view.table[PHASES] >= self.phase)]

    def barrier(self, what):
        """Wait until every rank has reached this barrier or is gone (bounded by EDDIS_COMM_TIMEOUT)."""
        self.phase += 1
        self._write(PHASES, self.phase)
        deadline = time.monotonic() + self.timeout
        view = self._view
        while True:
            self._refresh()
            waiting = [r for r in range(self.size) if view.table[PHASES, r] < self.phase and not view.gone(r)]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise MembershipTimeoutError(
                    f"{what}: rank {self.rank} waited {self.timeout:g} s for rank(s) "
                    f"{', '.join(map(str, waiting))}, which neither arrived nor stopped beating for "
                    f"EDDIS_ELASTIC_LOST_AFTER={self.lost_after:g} s (they are alive but stall). Raise "
                    "EDDIS_COMM_TIMEOUT if they are only slow.")
            time.sleep(POLL_SECONDS)

    def exchange(self, obj, what, sources=None):
        """A :meth:`barrier` that also passes objects: every rank gives ``obj`` (picklable, at
        most OBJECT_BYTES pickled) and gets ``{rank: obj}`` of the ranks that reached this
        barrier, the lost ones left out; with ``sources`` (ranks), of those among them only
        (the others' parts are not read). Bounded as :meth:`barrier`."""
        phase = self.phase + 1
        buffer = phase % 2
        self._put(buffer, encode_part(phase, what, obj))
        self.barrier(what)
        arrived = self.arrived()
        if sources is None:   # every part, in one read
            raw = np.empty(self.size * OBJECT_BYTES, dtype=np.uint8)
            self.objects.read(out=raw, slot=buffer, timeout=self.timeout)
            return {r: decode_part(raw[r * OBJECT_BYTES:(r + 1) * OBJECT_BYTES], r, phase, what)
                    for r in arrived}
        parts = {}
        for r in sorted(set(arrived) & {int(s) for s in sources}):
            raw = np.empty(OBJECT_BYTES, dtype=np.uint8)
            self.objects.read(out=raw, slot=buffer, start=r * OBJECT_BYTES, count=OBJECT_BYTES,
                              timeout=self.timeout)
            parts[r] = decode_part(raw, r, phase, what)
        return parts

    def _put(self, buffer, part):
        self.objects.write(part, slot=buffer, start=self.rank * OBJECT_BYTES, timeout=self.timeout)


def encode_part(phase, what, obj):
    """One rank's part of an exchange (uint8): its length, then ``(phase, what, obj)`` pickled;
    a UsageError when it does not fit in OBJECT_BYTES."""
    payload = pickle.dumps((int(phase), str(what), obj), protocol=pickle.HIGHEST_PROTOCOL)
    if len(payload) > OBJECT_BYTES - LENGTH_BYTES:
        raise UsageError(f"{what}: this rank's part of the exchange of the live ranks takes {len(payload)} "
                         f"bytes pickled, more than the {OBJECT_BYTES - LENGTH_BYTES} each rank has; "
                         "pass less (exchange small values, write large ones to files)")
    part = np.zeros(LENGTH_BYTES + len(payload), dtype=np.uint8)
    part[:LENGTH_BYTES] = np.frombuffer(np.array([len(payload)], dtype="<i8").tobytes(), dtype=np.uint8)
    part[LENGTH_BYTES:] = np.frombuffer(payload, dtype=np.uint8)
    return part


def decode_part(raw, rank, phase, what):
    """The object of rank ``rank``'s part ``raw`` of the exchange ``what`` at barrier ``phase``;
    a UsageError when that rank passed the barrier in another call (the ranks must make the
    same calls in the same order)."""
    raw = np.asarray(raw, dtype=np.uint8)
    length = int(np.frombuffer(raw[:LENGTH_BYTES].tobytes(), dtype="<i8")[0])
    found = None
    if 0 < length <= len(raw) - LENGTH_BYTES:
        try:
            found = pickle.loads(raw[LENGTH_BYTES:LENGTH_BYTES + length].tobytes())
        except Exception:   # a part of no exchange (zeros, or torn by a rank counted lost)
            found = None
    if not (isinstance(found, tuple) and len(found) == 3 and found[0] == phase):
        theirs = f"in {found[1]!r}" if isinstance(found, tuple) and len(found) == 3 else "without an exchange"
        raise UsageError(f"{what}: rank {rank} passed the live ranks' barrier {phase} {theirs}, not in "
                         "this exchange: the ranks must make the same collective calls in the same order")
    return found[2]


def join(mode):
    """Collective (part of the easgd/hybrid set-up): this rank's Membership when the run is
    elastic, else None. Refuses an embedded SMB server, which lives in rank 0 and would
    die with it."""
    if not requested(mode):
        return None
    st = runtime.require("eddis elastic training")
    client = connection.smb_client()
    if _members[0] is not None:
        return _members[0]
    # only rank 0 knows whether it runs the server itself
    embedded = collectives.broadcast_object(st.server is not None, root=0, what="elastic set-up")
    if embedded:
        raise ConfigError("EDDIS_ELASTIC=1 needs smb-servers of their own (eddis-train --local, or the "
                          "job script's), not the one embedded in rank 0, which dies with rank 0; "
                          "start the job with eddis-train, or unset EDDIS_ELASTIC")
    members = Membership(client, st.rank, st.size, mirrored=mirroring(client))
    _members[0] = members
    runtime.set_departure(_depart)
    return members


def mirroring(client):
    """Whether this elastic run keeps its training state in SMB on two servers each
    (:mod:`eddis.smb.mirror`): EDDIS_ELASTIC_MIRROR, with more than one server."""
    return bool(settings.get("EDDIS_ELASTIC_MIRROR")) and client.num_servers > 1


def current():
    """This rank's Membership, or None (not elastic, or not set up yet)."""
    return _members[0]


def _depart():
    """eddis.shutdown()'s wait for the others, elastic: the live ranks only, then leave."""
    members, _members[0] = _members[0], None
    if members is None:
        return
    try:
        members.barrier("eddis.shutdown")
    finally:
        members.close()
