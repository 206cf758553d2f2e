"""Elastic runs: a node lost before its ranks' training started fails the start, not hangs it.

An elastic run goes on without a rank lost after its training started (the SMB
heartbeats of :mod:`eddis.core.elastic` find it). Before that, the other ranks may
be waiting for it in ``MPI_Init`` or another start-up collective, which has no
timeout; a rank whose trainer alone dies is recorded by its supervisor and stops
them (:mod:`.supervisor`). A node lost as a whole takes the supervisors with it,
records nothing, and ``srun --kill-on-bad-exit=0`` (or ``mpirun``) keeps the step
alive: the survivors would wait until the job's time limit.

So, until its trainer notes that its training started (``launch/<key>/training/``),
every supervisor of an elastic run beats in ``launch/<key>/beats/<rank>.json`` every
BEAT_SECONDS, and the launcher's trainer guard on the batch host
(:func:`eddis.launch.jobsteps.guard_trainer_step`) watches those beats. A rank that
has not started, has not ended, and whose beat stood still for EDDIS_ELASTIC_LOST_AFTER
seconds (the same bound as the SMB heartbeats after the start; at most half of
EDDIS_LIVENESS_TIMEOUT, see :func:`silence_bound`) is recorded as a failure on its behalf (``why: vanished``): every other supervisor then stops its
trainer as after any failure before the start, and the report names the rank.

Why the guard and not every supervisor: one reader of N small files every
WATCH_SECONDS, not N readers of N files, on a shared file system. Why file contents
and this host's monotonic clock, not modification times: an NFS client may cache
attributes for a minute, while a file opened anew is read afresh (close-to-open),
and the hosts' clocks need not agree.
"""
import time

from .. import settings
from .report import VANISHED, read_records, write_json_atomic

BEAT_SECONDS = 2.0    # between two beats of a supervisor
WATCH_SECONDS = 5.0   # between two looks of the guard at the beats
_NEVER_READ = object()


class StartBeat:
    """A supervisor's beat until its trainer's training started (elastic runs only)."""

    def __init__(self, records, rank, enabled):
        self.records = records
        self.rank = rank
        self.active = enabled
        self.count = 0
        self.last = None

    def beat(self, now=None):
        if not self.active:
            return
        now = time.monotonic() if now is None else now
        if self.last is not None and now - self.last < BEAT_SECONDS:
            return
        if self.records.has_started(self.rank):
            self.active = False   # from here the SMB heartbeats say whether it lives
            return
        self.count += 1
        self.last = now
        try:
            write_json_atomic(self.records.beat_file(self.rank), {"rank": self.rank, "beat": self.count,
                                                                   "time": time.time()})
        except OSError:
            pass   # a full or failing file system: the guard then counts it silent, as it should


class StartWatch:
    """The guard's view of the beats of one launch's ranks."""

    def __init__(self, records, lost_after=None, env=None):
        self.records = records
        self.lost_after = silence_bound(env) if lost_after is None else lost_after
        self.seen = {}          # rank: (last beat read, when it changed, by this host's clock)
        self.next_look = 0.0
        self.done = False
        self.vanished = set()

    def look(self, starts, exits, size, now=None):
        """The start records of the ranks found silent at this look (recorded as failed), or []."""
        now = time.monotonic() if now is None else now
        if self.done or not size or now < self.next_look:
            return []
        self.next_look = now + WATCH_SECONDS
        ended = {e.get("rank") for e in exits}
        waiting = [r for r in range(size) if r not in ended and not self.records.has_started(r)]
        if not waiting:
            self.done = True   # every rank started (or ended): the SMB heartbeats take over
            return []
        beats = {b.get("rank"): b.get("beat") for b in read_records(self.records.beats)}
        by_rank = {s.get("rank"): s for s in starts}
        silent = []
        for rank in waiting:
            beat = beats.get(rank)
            if beat is None:
                # not seen alive yet: its supervisor may still be starting (Python on a cold shared
                # file system); a node lost before that fails srun's launch there
                continue
            last, since = self.seen.get(rank, (_NEVER_READ, now))
            if beat != last:
                self.seen[rank] = (beat, now)
                continue
            if now - since >= self.lost_after:
                silent.append(rank)
        if not silent:
            return []
        self.done = True   # one verdict: the start has failed, the supervisors stop the rest
        records = []
        for rank in silent:
            record = dict(by_rank.get(rank) or {"rank": rank, "host": None})
            waited = now - self.seen[rank][1]
            # its time is when it was last seen alive: survivors the liveness watch finds hung in
            # MPI_Init meanwhile waited for it, and the root cause is the first failure's
            record.update(why=VANISHED, code=None, signal=None, time=time.time() - waited, lost=False,
                          waited=round(waited), traceback=None, tail=[])
            self.records.fail(rank, record)
            self.vanished.add(rank)
            records.append(record)
        return records


def silence_bound(env=None):
    """Seconds a supervisor's beat may stand still: EDDIS_ELASTIC_LOST_AFTER, but at most half
    of EDDIS_LIVENESS_TIMEOUT, so that the lost rank is found before the liveness watch kills
    the survivors waiting for it in MPI_Init (which holds their trainers' heartbeat thread)."""
    bound = settings.get("EDDIS_ELASTIC_LOST_AFTER", env)
    liveness = settings.get("EDDIS_LIVENESS_TIMEOUT", env)
    return min(bound, liveness / 2) if liveness > 0 else bound


def announce(records):
    """The launcher's line for the ranks found silent, grouped by host."""
    lines = []
    for host in sorted({r.get("host") for r in records}, key=str):
        ranks = sorted(r["rank"] for r in records if r.get("host") == host)
        waited = max(r.get("waited", 0) for r in records if r.get("host") == host)
        theirs, them = ("its", "it") if len(ranks) == 1 else ("their", "them")
        lines.append(f"eddis-train: rank {', '.join(map(str, ranks))} on host {host} gave no sign of life "
                     f"for {waited} s before {theirs} training started (lost with {theirs} node?); failing the "
                     f"start: the other ranks may be waiting for {them} in a start-up collective")
    return lines

