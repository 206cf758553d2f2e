"""Progress control: the global learning counter and the staleness bound.

Training length is a number of *iterations*, one local mini-batch of one rank
each, counted for the whole job in one 64-bit SMB counter (``Counter.fetch_add``,
atomic on the server). Before each step a rank takes an iteration from a chunk
it claimed from the counter; when the counter has reached the total, the rank
stops. So fast ranks simply do more iterations than slow ones, and the job
does exactly the total::

    while not eddis.should_stop():       # claims, waits for the staleness bound
        ...one training step...
    eddis.global_step()                  # iterations started job-wide before this step

Lockstep units. Ranks that step together must stop together: in ``sync`` (and
``allreduce``) all ranks form one unit, in ``hybrid`` the ranks of one group
(EDDIS_GROUP) do, in ``easgd`` each rank is its own unit. A unit's leader
claims ``chunk`` unit steps (``chunk x unit size`` iterations) and tells the
other members through two SMB counters of the unit that they poll (the claim's
counter value and how many claims were posted; not an MPI broadcast, which would
hold every member at each step until the leader's claim came back). A unit of all ranks, the only user of its counter,
posts only its first claim: from then on every member knows what the leader's
next claim finds, and the leader checks that it does. A unit step uses ``unit
size`` iterations. With a total that is not a multiple of a unit's size, that unit
leaves the remainder to smaller units (it warns at start).

Exactness. A claim ``fetch_add(n)`` that crosses the total keeps only the
iterations below it and gives the surplus back (``fetch_add(-surplus)``); a
claim that finds the total reached gives all of it back. The first crossing
claim always sees the counter without any surplus, so the iterations handed out
are exactly ``[0, total)``, each once, and once every rank has stopped the
counter reads exactly the total.

Staleness bound ``s`` (EDDIS_STALENESS, -1: off). No rank starts its step t
while another rank has completed fewer than ``t - s`` steps. Each rank
publishes its completed steps in its own SMB counter (and a huge value when it
stops, so finished ranks never hold anyone back); a rank about to start step t
reads the others' counters only when the smallest value it saw so far is too
low, and then polls them with a growing delay (0.1 ms to 10 ms) until the bound
holds or EDDIS_COMM_TIMEOUT passes (:class:`ProgressTimeoutError`, naming the
ranks it waited for). With ``s = 0`` ranks advance in lockstep.

``record=True`` keeps ``(time.monotonic_ns(), event, step)`` for ``start``
(a step starts, after any staleness wait), ``done`` (a step completed, logged
before it is published) and ``finish`` (the rank stopped): enough to check the
bound afterwards from every rank's log (the monotonic clock is shared by the
processes of one host).

Module API (what ``eddis.torch`` exposes): ``configure(total=None, chunk=None,
staleness=None, mode=None, record=False)`` (collective; otherwise the first
``should_stop()`` configures from the settings), ``should_stop()``,
``global_step()``, ``controller()``, ``reset()``.

Settings: EDDIS_TOTAL_ITERATIONS, EDDIS_CLAIM_CHUNK, EDDIS_STALENESS,
EDDIS_COMM_TIMEOUT.
"""
import itertools
import logging
import time
import warnings

from .. import settings, timeline
# ProgressError, ProgressTimeoutError: also importable from here, their old address
from ..errors import ConfigError, ProgressError, ProgressTimeoutError, SMBTimeoutError, UsageError
from . import collectives, elastic, runtime

log = logging.getLogger("eddis.core.progress")

DONE = 1 << 60   # the progress a finished rank publishes: larger than any step
LOCKSTEP_MODES = ("sync", "allreduce")


def usable_iterations(old, requested, total, unit=1):
    """How many of ``requested`` iterations claimed at counter value ``old`` lie
    below ``total``, in whole units of ``unit`` iterations."""
    usable = min(int(requested), max(0, int(total) - int(old)))
    return usable - usable % int(unit)


class ProgressController:
    """One rank's view of the global learning counter (see the module docstring).

    ``lockstep_comm``: an MPI communicator of the ranks that step together
    (None: this rank alone); its rank 0 claims for all of them.
    """

    def __init__(self, client, total, rank, size, chunk=None, staleness=None, lockstep_comm=None,
                 name="eddis.progress", timeout=None, record=False, mirrored=False):
        self.total = int(total)
        if self.total < 0:
            raise ConfigError(f"the total number of iterations must be >= 0, got {total}; "
                              "set EDDIS_TOTAL_ITERATIONS or pass total=")
        self.chunk = settings.get("EDDIS_CLAIM_CHUNK") if chunk is None else int(chunk)
        if self.chunk < 1:
            raise ConfigError(f"EDDIS_CLAIM_CHUNK must be >= 1, got {self.chunk}")
        self.staleness = settings.get("EDDIS_STALENESS") if staleness is None else int(staleness)
        if self.staleness < -1:
            raise ConfigError(f"EDDIS_STALENESS must be -1 (off) or >= 0, got {self.staleness}")
        self.timeout = settings.get("EDDIS_COMM_TIMEOUT") if timeout is None else float(timeout)
        self.rank = int(rank)
        self.size = int(size)
        self.name = name
        self.unit = 1 if lockstep_comm is None else lockstep_comm.Get_size()
        self.leader = lockstep_comm is None or lockstep_comm.Get_rank() == 0
        # One unit of all ranks (sync, allreduce) has the counter to itself: after the first
        # claim every member can tell what the leader's next fetch_add returns, so claims
        # need no message (a broadcast per step cost the members up to several ms).
        self._exclusive = lockstep_comm is not None and self.unit == self.size
        self._predicted = None        # the counter value the next claim finds (exclusive unit)
        # a resumed run starts from the iterations its checkpoint had used (eddis.resume)
        start = _resume_point or {"consumed": 0, "steps_done": None}
        # mirrored (elastic runs): every counter on two servers, so that it outlives a lost node
        self.counter = client.counter(f"{name}.counter", initial=start["consumed"], mirrored=mirrored)
        # where a unit's leader posts its claims for the members: (claims posted, newest's value)
        self._posted = self._posted_value = None
        self._last_posted_value = 0
        self._claims_seen = 0
        if self.unit > 1:
            self.unit_leader = collectives.broadcast_object(
                self.rank, root=0, comm=lockstep_comm, timeout=self.timeout,
                what="progress control set-up (the unit's leader)")
            unit_name = f"{name}.unit{self.unit_leader}"
            self._posted = client.counter(f"{unit_name}.claims", initial=0, mirrored=mirrored)
            self._posted_value = client.counter(f"{unit_name}.value", initial=0, mirrored=mirrored)
        else:
            self.unit_leader = self.rank
        self._mine = None
        self._others = []
        if self.staleness >= 0:
            done = start["steps_done"] or [0] * self.size
            peers = [client.counter(f"{name}.rank{r}", initial=int(done[r]), mirrored=mirrored)
                     for r in range(self.size)]
            self._mine = peers[self.rank]
            self._others = [(r, c) for r, c in enumerate(peers) if r != self.rank]
        self.steps_done = 0           # steps this rank completed (in this run)
        self._published_early = False  # the running step's completion is published already
        self.started = False          # a step is running (should_stop returned False)
        self.finished = False
        self.reserved = 0             # unit steps left in the current claim
        self.position = 0             # counter position of the current step
        self._next_position = 0
        self._min_seen = -1           # lowest progress of the others seen so far
        self.claims = 0
        self.waited = 0.0             # seconds spent waiting for the staleness bound
        self.history = [] if record else None
        self.lost_ranks = None        # elastic runs: () -> ranks counted lost, not waited for
        self.mode = None              # the training mode it was set up for (module API)
        if self.leader and self.total % self.unit:
            warnings.warn(f"the total of {self.total} iterations is not a multiple of the {self.unit} "
                          f"ranks that step together here; they leave the last "
                          f"{self.total % self.unit} iteration(s) to others (or unused)", stacklevel=3)

    # ------------------------------------------------------------ the loop
    def should_stop(self):
        """True when training is over for this rank; else this rank may run one step."""
        if self.finished:
            return True
        if self.started:
            self._complete_step()
        if self.reserved == 0:
            self._claim()
            if self.reserved == 0:
                self._finish()
                for hook in _end_of_training_hooks:
                    hook()
                return True
        if self.staleness >= 0:
            self._wait_for_bound(self.steps_done)
        self.reserved -= 1
        self.position = self._next_position
        self._next_position += self.unit
        self.started = True
        self._log("start", self.steps_done)
        return False

    def global_step(self):
        """Iterations started job-wide before this rank's current (or next) step."""
        return self.position if self.started else self._next_position

    def close(self):
        """Stop taking part (training loop left early, or shutdown)."""
        if not self.finished:
            if self.started:
                self._complete_step()
            self._finish()

    # ------------------------------------------------------------ internals
    def _log(self, event, step):
        if self.history is not None:
            self.history.append((time.monotonic_ns(), event, step))

    def _complete_step(self):
        self.started = False
        self._log("done", self.steps_done)
        self.steps_done += 1
        if self._mine is not None and not self._published_early:
            self._mine.fetch_add(1)
        self._published_early = False

    def publish_completed(self):
        """Publish the running step as completed now (it is, at a step boundary) to the
        staleness bound, so that no rank waits for this one while it waits in a collective
        checkpoint for them."""
        if self._mine is not None and self.started and not self._published_early:
            self._mine.fetch_add(1)
            self._published_early = True

    def _finish(self):
        self.finished = True
        self._log("finish", self.steps_done)
        if self._mine is not None:
            self._mine.fetch_add(DONE)

    def _claim(self):
        with timeline.span(timeline.COUNTER_CLAIM, args={"step": self.steps_done}):
            requested = self.chunk * self.unit
            if self.leader:
                old = self.counter.fetch_add(requested)
                usable = usable_iterations(old, requested, self.total, self.unit)
                if usable < requested:
                    self.counter.fetch_add(usable - requested)
                if self._predicted is not None and old != self._predicted:
                    raise ProgressError(
                        f"the global learning counter {self.counter.name!r} read {old} where this job's "
                        f"ranks, which step together and are its only users, left it at "
                        f"{self._predicted}: something else changed it. Give each training run its own "
                        "eddis.configure_progress() and do not write its counter.")
                if self._posted is not None and self._predicted is None:
                    # the value first: a member that sees the new count reads it after
                    self._posted_value.fetch_add(old - self._last_posted_value)
                    self._last_posted_value = old
                    self._posted.fetch_add(1)
            else:
                old = self._predicted if self._predicted is not None else self._await_posted_claim()
                usable = usable_iterations(old, requested, self.total, self.unit)
        if self._exclusive:
            self._predicted = old + usable
        self.claims += 1
        self.reserved = usable // self.unit
        self._next_position = old

    def _await_posted_claim(self):
        """The counter value of the unit leader's next claim, once it is posted.
        The leader cannot post the claim after it before this member has taken its
        part in the steps of this one, so the value read belongs to this claim."""
        self._claims_seen += 1
        try:
            self._posted.wait_for(self._claims_seen, self.timeout)
        except SMBTimeoutError as exc:
            raise ProgressTimeoutError(
                f"rank {self.rank} waited {self.timeout:g} s for rank {self.unit_leader}, the leader "
                "of the ranks that step with it, to claim iterations from the global learning "
                "counter: that rank died or stalls; raise EDDIS_COMM_TIMEOUT if it is only slow.") from exc
        return self._posted_value.read()

    def _wait_for_bound(self, step):
        need = step - self.staleness
        if need <= self._min_seen:
            return
        start = time.monotonic()
        deadline = start + self.timeout
        delay = 1e-4
        with timeline.span(timeline.WAIT, args={"reason": "staleness", "step": step}):
            while True:
                values = [(r, c.read()) for r, c in self._others]
                low = min((v for _, v in values), default=DONE)
                self._min_seen = low
                if low >= need:
                    break
                if self.lost_ranks is not None and self._forget_lost(values, need):
                    continue
                if time.monotonic() > deadline:
                    behind = ", ".join(f"rank {r} at step {v}" for r, v in values if v < need)
                    raise ProgressTimeoutError(
                        f"rank {self.rank} waited {self.timeout:g} s to start step {step} under the "
                        f"staleness bound {self.staleness}: {behind} did not progress. A rank died or "
                        "stalls; raise EDDIS_STALENESS or EDDIS_COMM_TIMEOUT if it is only slow.")
                time.sleep(delay)
                delay = min(delay * 2, 0.01)
        self.waited += time.monotonic() - start


    def _forget_lost(self, values, need):
        """Stop waiting for the lost ones of the ranks behind; True when some were."""
        lost = set(self.lost_ranks()) & {r for r, v in values if v < need}
        if lost:
            log.warning("rank %d: the staleness bound no longer waits for lost rank(s) %s", self.rank,
                        ", ".join(map(str, sorted(lost))))
            self._others = [(r, c) for r, c in self._others if r not in lost]
        return bool(lost)


# ---------------------------------------------------------------- module API
_end_of_training_hooks = []   # called when a rank's training ends, before should_stop() says so


def on_end_of_training(hook):
    """Call ``hook()`` on each rank where ``should_stop()`` finds the total reached (not where a
    loop is left early): what must still happen at that rank's last step boundary (a checkpoint
    that other ranks have begun) happens before the script's own end-of-training calls."""
    if hook not in _end_of_training_hooks:
        _end_of_training_hooks.append(hook)


_controller = None
_resume_point = None   # {"consumed": iterations, "steps_done": per rank or None}, from a checkpoint
_instance = itertools.count()
_mode_hint = None


def set_mode_hint(mode):
    """The training mode of the job's DistributedOptimizer (decides the lockstep units)."""
    global _mode_hint
    mode = str(mode).lower()
    ctl = _controller
    if ctl is not None and not ctl.finished and ctl.mode != mode and runtime.is_initialized() \
            and runtime.size() > 1:
        raise UsageError(f"the global learning counter was set up for mode {ctl.mode!r} (the first "
                         f"should_stop() or configure_progress() came before this optimizer), but the "
                         f"optimizer trains with mode {mode!r}. Create the DistributedOptimizer first.")
    _mode_hint = mode


def _lockstep_comm(mode):
    if runtime.size() == 1 or mode == "easgd":
        return None
    from . import hybrid

    if mode == "hybrid":
        return hybrid.group_comm()
    if mode in LOCKSTEP_MODES:
        return hybrid.world_comm()
    raise ConfigError(f"progress control does not know mode {mode!r}")


def configure(total=None, chunk=None, staleness=None, mode=None, record=False):
    """Set up the global learning counter (collective). Returns the controller."""
    global _controller, _resume_point
    runtime.require("eddis progress control")
    if total is None:
        total = settings.get("EDDIS_TOTAL_ITERATIONS")
        if total is None:
            raise ConfigError("progress control needs the total number of iterations: set "
                              "EDDIS_TOTAL_ITERATIONS or call configure_progress(total=N) first")
    mode = (mode or _mode_hint or settings.get("EDDIS_MODE")).lower()
    if _controller is not None and not _controller.finished:
        raise UsageError("progress control is already configured and training is not over; "
                         "call it once per training run (reset_progress() to start over)")
    comm = _lockstep_comm(mode)
    name = f"eddis.progress.{next(_instance)}"
    client = runtime.smb_client()
    # decided from the settings, not from elastic.current(): the optimizer may join later
    mirrored = (runtime.size() > 1 and mode in elastic.ELASTIC_MODES and bool(settings.get("EDDIS_ELASTIC"))
                and elastic.mirroring(client))
    _controller = ProgressController(client, total, runtime.rank(), runtime.size(),
                                      chunk=chunk, staleness=staleness, lockstep_comm=comm,
                                      name=name, record=record, mirrored=mirrored)
    _controller.mode = mode
    _resume_point = None   # used by this controller; a later run starts afresh
    members = elastic.current()
    if members is not None:
        _controller.lost_ranks = members.lost
    runtime.register_closable(_controller)
    collectives.barrier(what="progress control set-up")
    return _controller


def resume_from(consumed, steps_done=None):
    """The next controller starts at ``consumed`` iterations of the counter and, when given,
    every rank's completed steps (a resumed run; ``eddis.resume`` calls it on every rank)."""
    global _resume_point
    if _controller is not None and not _controller.finished:
        raise UsageError("eddis.resume() came after the global learning counter was set up (by "
                         "should_stop() or configure_progress()): resume before the training loop")
    _resume_point = {"consumed": int(consumed), "steps_done": None if steps_done is None else
                     [int(v) for v in steps_done]}


def controller():
    """The current :class:`ProgressController`, or None before configure()/should_stop()."""
    return _controller


def should_stop():
    """True when this rank should stop training (see the module docstring)."""
    ctl = _controller if _controller is not None else configure()
    return ctl.should_stop()


def global_step():
    """Iterations started job-wide before this rank's current step (0 before the first)."""
    return 0 if _controller is None else _controller.global_step()


def reset():
    """Forget the controller (after training), so that another run can configure anew."""
    global _controller, _resume_point
    if _controller is not None:
        _controller.close()
        try:
            runtime.unregister_closable(_controller)
        except Exception:
            pass
    _controller = None
    _resume_point = None


def progress_counts():
    """Collective: steps each rank did in this run, by rank (after training)."""
    ctl = controller()
    mine = 0 if ctl is None else ctl.steps_done
    return collectives.allgather_object(mine, what="progress counts")
