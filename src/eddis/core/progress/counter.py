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

Claims made ahead. A leader begins the claim of its next chunk, in a thread of its
own, as soon as it starts the last step of the current one, so the counter's round
trip overlaps that step: the counter lives on one server, and from any other node
the ``fetch_add`` waits behind whatever this process's connection to that server
carries (behind an elastic exchange's half-centre transfer at 1 Gbit/s it waited
0.4-0.8 s). A claim made ahead counts as reserved once it is in: a checkpoint waits
for it (:meth:`ProgressController.settle_claim`), and a loop left early gives it back.
Elastic runs do not claim ahead: a lost rank takes only the step it was running;
EDDIS_CLAIM_AHEAD=0 turns it off (claims then follow the steps exactly).
The claim counters of a unit (where its leader posts claims for the members) live on
a server of the leader's node, so the members' polls do not cross the network.

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

Settings: EDDIS_TOTAL_ITERATIONS, EDDIS_CLAIM_CHUNK, EDDIS_CLAIM_AHEAD, EDDIS_STALENESS,
EDDIS_COMM_TIMEOUT.
"""
import itertools
import logging
import threading
import time
import warnings

from ... import settings, timeline
# ProgressError, ProgressTimeoutError: also importable from here, their old address
from ...errors import ConfigError, ProgressError, ProgressTimeoutError, SMBTimeoutError, UsageError
from ..comm import collectives, connection, elastic, groups, runtime

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
                 name="eddis.progress", timeout=None, record=False, mirrored=False, claim_ahead=True):
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
            self.unit_leader, leader_host = collectives.broadcast_object(
                (self.rank, runtime.hostname()), root=0, comm=lockstep_comm, timeout=self.timeout,
                what="progress control set-up (the unit's leader)")
            unit_name = f"{name}.unit{self.unit_leader}"
            # on the leader's node: its posts and the members' polls there stay off the network
            # (by the name's hash, half the units would poll another node's server every step)
            home = (client.servers_on_hosts([leader_host]) or [None])[0]
            self._posted = client.counter(f"{unit_name}.claims", initial=0, server=home, mirrored=mirrored)
            self._posted_value = client.counter(f"{unit_name}.value", initial=0, server=home,
                                                mirrored=mirrored)
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
        self.claim_ahead = bool(claim_ahead)
        self._ahead = None            # the leader's claim of the next chunk, under way
        self._exhausted = False       # a claim found the total reached: no claim ahead
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
        if self.reserved == 0:
            self._claim_ahead()
        return False

    def global_step(self):
        """Iterations started job-wide before this rank's current (or next) step."""
        return self.position if self.started else self._next_position

    def close(self):
        """Stop taking part (training loop left early, or shutdown). A claim made ahead goes
        back to the counter: nobody else would run its iterations."""
        if not self.finished:
            if self.started:
                self._complete_step()
            self._give_back_ahead()
            self._finish()

    def settle_claim(self):
        """Wait for the claim made ahead, if one is under way, and count its iterations as
        reserved: at a checkpoint, the counter and every leader's unused iterations must
        agree (what :func:`eddis.core.checkpoint.state.progress_of_rank` reports)."""
        if self._ahead is not None and not self.finished:
            self._claim()

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

    def _claim_ahead(self):
        """Leader: begin the next chunk's claim now, in the background, so that it is in by
        the end of the step. A counter on another node's server answers behind whatever
        this process's connection to that server carries: behind an elastic exchange's
        half-centre transfer a claim waited 0.4-0.8 s at 1 Gbit/s, every fourth step."""
        if not (self.leader and self.claim_ahead) or self._exhausted or self._ahead is not None:
            return
        self._ahead = _AheadClaim(self.counter, self.chunk * self.unit, self.name)

    def _give_back_ahead(self):
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        try:
            ahead.result(self.timeout)
            self.counter.fetch_add(-ahead.requested)
        except Exception as exc:   # a lost server or a timeout: the job ends anyway
            log.warning("rank %d: could not give back the %d iteration(s) it claimed ahead from %r: %s",
                        self.rank, ahead.requested, self.counter.name, exc)

    def _fetch_claim(self, requested):
        """The leader's claim: the counter value it found (the one made ahead, else now)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return self.counter.fetch_add(requested)
        return ahead.result(self.timeout)

    def _claim(self):
        with timeline.span(timeline.COUNTER_CLAIM, args={"step": self.steps_done}):
            requested = self.chunk * self.unit
            if self.leader:
                old = self._fetch_claim(requested)
                usable = usable_iterations(old, requested, self.total, self.unit)
                if usable < requested:
                    self._exhausted = True
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


class _AheadClaim:
    """A claim's ``fetch_add`` in a thread of its own; :meth:`result` waits for its value."""

    def __init__(self, counter, requested, name):
        self.requested = requested
        self._done = threading.Event()
        self._value = self._error = None
        self._counter = counter
        threading.Thread(target=self._run, name=f"eddis-claim-ahead {name}", daemon=True).start()

    def _run(self):
        try:
            self._value = self._counter.fetch_add(self.requested)
        except BaseException as exc:   # raised again where the claim is taken
            self._error = exc
        finally:
            self._done.set()

    def result(self, timeout):
        if not self._done.wait(timeout):
            raise ProgressTimeoutError(
                f"a claim of {self.requested} iteration(s) from the global learning counter "
                f"{self._counter.name!r} (server {getattr(self._counter, 'server', '?')}) did not "
                f"complete within {timeout:g} s: the server stalls or the network failed; raise "
                "EDDIS_COMM_TIMEOUT if it is only slow.")
        if self._error is not None:
            raise self._error
        return self._value


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
    if mode == "hybrid":
        return groups.group_comm()
    if mode in LOCKSTEP_MODES:
        return groups.world_comm()
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
    client = connection.smb_client()
    # decided from the settings, not from elastic.current(): the optimizer may join later
    elastic_run = runtime.size() > 1 and mode in elastic.ELASTIC_MODES and bool(settings.get("EDDIS_ELASTIC"))
    # an elastic run claims only when it needs to: a lost rank then takes the one step it was
    # running with it, not also a claim made ahead
    _controller = ProgressController(client, total, runtime.rank(), runtime.size(),
                                      chunk=chunk, staleness=staleness, lockstep_comm=comm,
                                      name=name, record=record,
                                      claim_ahead=settings.get("EDDIS_CLAIM_AHEAD") and not elastic_run,
                                      mirrored=elastic_run and elastic.mirroring(client))
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
