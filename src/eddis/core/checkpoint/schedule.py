"""When a checkpoint is taken: the step boundaries at which every rank agrees on one.

When (``Schedule``, at every optimizer step's end when EDDIS_CHECKPOINT_DIR is set): a request
(rank 0's interval, or any rank's :func:`eddis.core.checkpoint.request`) is one ``fetch_add``
on an SMB counter of the run; the leader of each set of ranks that step together (all ranks in
sync, a group in hybrid, each rank in easgd) reads that counter once per step and, when it
changed, begins the next save (or joins it, when another unit began it first) with one
compare-and-swap on the run's saves counter, and posts "after step c + 1" on its unit's
counter, which every member reads once per step. No member can finish step c + 1 before the
leader has contributed to it, which it does only after posting, so every member sees the post
by then: all take the checkpoint after the same step, with no MPI collective on steps without
one. In the save, the largest request count any leader saw decides, the same on every rank,
whether it is a periodic checkpoint or one to stop after.

The end of training. In easgd and hybrid the units end apart: one may have reached the total
and gone on to the script's final collectives (the final model, shutdown) while another still
steps. A unit whose training ends (``should_stop()`` finds the total reached) adds CLOSED to the
saves counter, one fetch_add: a save begun before it is joined there, at the unit's last step
boundary, as the others wait in it; a save not begun by then never begins, and a request that
finds the counter closed is refused as "training already complete, nothing to checkpoint"
(the job then ends, not requeued). So a request near the end either checkpoints every rank, or
none. A unit of every rank (sync) refuses a save only it had begun, for the step it never ran.
"""
import logging
import time

from ... import settings
from ...errors import CheckpointError, CheckpointStop, SMBTimeoutError, UsageError
from ..comm import connection, elastic, groups, runtime
from ..progress import counter as progress, driver
from . import folders as layout
from .save import SYNC_MODES, mode_of, participant_of, save_and_committer, taking_part

log = logging.getLogger("eddis.core.checkpoint")

STOP = 1 << 32          # a request counter's increment for checkpoint-and-stop (periodic: 1)
CLOSED = 1 << 40        # the saves counter's increment by each unit whose training ended
END = 1 << 62           # on a unit's counter: its leader's word at the unit's end (+1: save)


class Schedule:
    """Periodic and requested checkpoints at step boundaries (see the module docstring).

    The counters are named after the optimizer's serial, which every rank knows, so a rank
    sets them up by itself whenever it first needs them: at its first step boundary, or at its
    end of training when it has no step left (a resumed run), with no collective either way.
    """

    def __init__(self, state, directory, interval=None, keep=None):
        rt = runtime.require("periodic checkpoints")
        self.state = state
        self.directory = directory
        self.interval = layout.interval_from_settings() if interval is None else interval
        self.keep = keep
        self.rank = rt.rank
        mode = mode_of(state)
        if mode in SYNC_MODES:
            unit = list(range(rt.size))
        elif mode == "hybrid":
            unit = groups.group_members()[runtime.group()]
        else:
            unit = [self.rank]
        name = f"eddis.checkpoint.h{state.serial}"
        client = connection.smb_client()
        # elastic runs: on two servers, so that a node lost with its server leaves the schedule
        mirrored = state.members is not None and elastic.mirroring(client)
        self.requests = client.counter(f"{name}.requests", initial=0, mirrored=mirrored)
        # saves begun (+ CLOSED for each unit whose training ended): one compare-and-swap begins
        # a save or finds the run over, one fetch_add ends a unit's training and says whether a
        # save it must join was begun first
        self.saves = client.counter(f"{name}.saves", initial=0, mirrored=mirrored)
        self.leader = self.rank == unit[0]
        self.unit_size = len(unit)
        self.whole_run = len(unit) == rt.size   # nobody outside the unit could be in a save
        self.target = client.counter(f"{name}.unit{unit[0]}", initial=0,
                                     mirrored=mirrored) if len(unit) > 1 else None
        self.timeout = settings.get("EDDIS_COMM_TIMEOUT")
        self.seen = 0            # the request counter as the leader last saw it, or as agreed
        self.agreed = 0          # the request counter as the last save agreed (every rank)
        self.terminated = False  # whether SIGTERM asked a rank for the last save (agree())
        self.saves_done = 0      # saves this rank took part in
        self.posted = 0          # what the leader posted on the unit's counter: the step, or END + ...
        self.taken = 0           # the post this rank has acted on
        self.sent_request = False
        self.ended = False
        self.last_time = time.monotonic()
        self.last_periodic = 0
        self.asking = False      # a rank but 0 that asks for the periodic checkpoints (rank 0 lost)
        self.next_look = 0.0     # when it next looks whether every rank below it was lost

    def _asks_periodically(self):
        """Whether this rank asks for the periodic checkpoints: rank 0, or in an elastic run
        the lowest live rank once every rank below it was lost."""
        if self.rank == 0 or self.asking:
            return True
        members = self.state.members
        if members is None:
            return False
        if time.monotonic() >= self.next_look:   # a look reads the SMB heartbeats: not every step
            self.next_look = time.monotonic() + elastic.BEAT_SECONDS
            lost = members.lost()
        else:
            lost = members.counted_lost()        # as another wait of this rank last saw them
        self.asking = requester_of(self.rank, lost)
        if self.asking:
            log.warning("rank %d: rank(s) %s were lost; this rank asks for the periodic checkpoints now",
                        self.rank, ", ".join(map(str, range(self.rank))))
        return self.asking

    def _periodic_due(self, completed):
        if self.interval is None or not self._asks_periodically():
            return False
        unit, value = self.interval
        if unit == "seconds":
            if time.monotonic() - self.last_time < value:
                return False
            self.last_time = time.monotonic()
            return True
        at = completed + (1 if self.target is not None else 0)
        if at % value == 0 and at > self.last_periodic:
            self.last_periodic = at
            return True
        return False

    def _send_request(self):
        if layout.pending_request() is not None and not self.sent_request:
            self.requests.fetch_add(STOP)
            self.sent_request = True

    def _begin_save(self, value):
        """The leader saw new requests (the counter at ``value``): begin the next save, or join
        it when another unit began it; False when training has ended on some unit first (the
        requests are refused: nothing is saved after that, on any rank)."""
        before = self.saves.compare_swap(self.saves_done, self.saves_done + 1)
        if before == self.saves_done or before % CLOSED == self.saves_done + 1:
            return True
        if before % CLOSED != self.saves_done:
            raise CheckpointError(f"rank {self.rank}: the checkpoint counter {self.saves.name!r} reads "
                                  f"{before}, this rank took part in {self.saves_done} saves: another run "
                                  "uses the same SMB servers and names; give each run its own servers")
        self._refuse(value)
        return False

    def _refuse(self, value):
        # no save can begin any more, so what was agreed no longer needs to be the same on all
        stop = value // STOP > self.agreed // STOP or layout.pending_request() is not None
        self.seen = self.agreed = value
        if stop:
            log.warning("rank %d: a checkpoint was requested after training had ended on a rank: "
                        "training is complete, nothing to checkpoint", self.rank)
            layout.clear_request()
            layout.answer_training_complete(self.state.step)

    def decide(self, completed):
        """After step ``completed`` (steps done): whether this rank takes part in a save now."""
        self._send_request()
        if self._periodic_due(completed):
            self.requests.fetch_add(1)
        # a leader posts again only once its members have acted on the last post: a new post
        # before then could replace "after step c" while a member already took it at c
        if self.leader and not self.ended and (self.target is None or self.posted == self.taken):
            value = self.requests.read()
            if value != self.seen:
                if not self._begin_save(value):
                    return False
                self.seen = value
                if self.target is None:
                    return True
                post = completed + 1
                self.target.fetch_add(post - self.posted)
                self.posted = post
        if self.target is None:
            return False
        post = self.posted if self.leader else self.target.read()
        if post != self.taken and post == completed:
            self.taken = post
            return True
        return False

    def end_of_training(self):
        """This rank's unit has no step left: whether it takes part in a save now, as the last
        of its step boundaries. A unit ends its training with one fetch_add on the saves
        counter: a save begun before it must be joined (the others wait in it); every later
        request is refused. The unit's leader tells its members which."""
        if self.ended:
            return False
        self.ended = True
        self._send_request()
        if self.leader:
            begun = self.saves.fetch_add(CLOSED) % CLOSED > self.saves_done
            # a unit of every rank began it alone (the post for a step it did not reach): refuse
            join = begun and not self.whole_run
            if self.target is not None:
                self.target.fetch_add(END + int(join) - self.posted)
                self.posted = END + int(join)
            if not join:
                self._refuse(self.requests.read())
            return join
        try:
            join = bool(self.target.wait_for(END, self.timeout) - END)
        except SMBTimeoutError as exc:
            raise CheckpointError(f"rank {self.rank} waited {self.timeout:g} s at its end of training for "
                                  "the leader of the ranks that step with it to say whether a checkpoint "
                                  "is due: that rank died or stalls (EDDIS_COMM_TIMEOUT)") from exc
        if not join:
            self._refuse(self.seen)
        return join

    def agree(self):
        """Collective (of the live ranks in an elastic run), in every save: the request counter
        as the units' leaders saw it, the largest of them, decides whether the ranks stop after
        this save, the same on all; :attr:`terminated` whether SIGTERM asked any rank for it
        (a preemption may signal some ranks only: an elastic job's ranks under mpirun on the
        batch host get nothing)."""
        mine = (self.requests.read() if self.leader else None, layout.requested_by_sigterm())
        every = list(taking_part().gather(mine, "checkpoint: the requests every unit saw").values())
        seen = [value for value, _ in every if value is not None]
        value = max(seen, default=self.agreed)
        stop = value // STOP > self.agreed // STOP
        self.terminated = any(sigterm for _, sigterm in every)
        self.agreed = self.seen = value
        self.saves_done += 1
        return stop


def requester_of(rank, lost):
    """Whether ``rank`` asks for the periodic checkpoints when ``lost`` ranks were lost: it is
    the lowest rank not lost."""
    lost = set(lost)
    return all(r in lost for r in range(rank))


_schedules = {}      # id(state) -> Schedule
_warned = []


def schedule_of(state, directory=None):
    """The checkpoint Schedule of ``state`` (a HeteroStep), set up when first asked for."""
    directory = settings.get("EDDIS_CHECKPOINT_DIR") if directory is None else directory
    schedule = _schedules.get(id(state))
    if schedule is None or schedule.state is not state:
        schedule = _schedules[id(state)] = Schedule(state, directory)
    return schedule


def at_step_boundary(state):
    """The end of every optimizer step (:meth:`eddis.core.basics.EddisBasics.end_of_step`):
    writes a periodic or requested checkpoint of the model bound to ``state`` (by eddis.resume
    or eddis.checkpoint: :func:`eddis.core.checkpoint.save.bind`) when the ranks agreed on one
    for this step; after a requested one, raises :class:`CheckpointStop` on every rank."""
    directory = settings.get("EDDIS_CHECKPOINT_DIR")
    if directory is None or state is None:
        if layout.pending_request() is not None and not _warned:
            _warned.append(True)
            log.error("a checkpoint was requested (%s), but EDDIS_CHECKPOINT_DIR is not set: nothing "
                      "is written and training goes on", layout.pending_request())
        return None
    schedule = schedule_of(state, directory)
    if not schedule.decide(state.step):
        return None
    return _scheduled_save(schedule, participant_of(state))


def _at_end_of_training():
    """A rank's training is over (progress control): join a save that others began, so that
    nobody waits in it while this rank goes on to the script's end-of-training collectives."""
    directory = settings.get("EDDIS_CHECKPOINT_DIR")
    state = driver.current()
    if directory is None or state is None or not runtime.is_initialized():
        return
    schedule = schedule_of(state, directory)
    if schedule.end_of_training():
        _scheduled_save(schedule, participant_of(state))


progress.on_end_of_training(_at_end_of_training)


def _scheduled_save(schedule, participant):
    state = schedule.state
    if participant is None:
        raise UsageError("a checkpoint is due, but the optimizer does not know the model to save: call "
                         "eddis.resume(EDDIS_CHECKPOINT_DIR, model, optimizer) (or eddis.checkpoint) "
                         "once before training")
    stop = schedule.agree()
    path, committer = save_and_committer(schedule.directory, state, participant, None,
                            "requested" if stop else "periodic", None, None, None)
    if stop:
        terminated = schedule.terminated
        layout.clear_request()
        if runtime.rank() == committer:
            layout.answer_request(path, state.step, terminated)
        state.stopped_for_checkpoint = path
        raise CheckpointStop(f"stopped after step {state.step} for a requested checkpoint ({path}); "
                             f"exit status {CheckpointStop('').code}: requeue the job to continue", path)
    return path
