"""Collective checkpoint and resume of a training run, and the step-boundary agreement on when.

The adapters bind this (``eddis.torch.checkpoint``/``resume``, ``eddis.tensorflow``'s) and
give a *participant*, the framework's side, with two methods::

    participant.framework, participant.ext      # "torch", ".pt"
    participant.write(path, include_model)       # this rank's framework RNG, and the model's
                                                 # and optimizer's state when include_model
    participant.read(model_file, rng_file)       # either may be None

Which ranks write the model: in ``sync``/``allreduce`` every rank's parameters and optimizer
state are the same (the same averaged gradients, the same update; the parameter agreement
check holds them to it), so rank 0's suffice and a checkpoint's size does not grow with the
ranks; in ``easgd``/``hybrid`` the workers differ, so every rank writes its own. Every rank
writes its RNG states, since they differ in every mode.

Changed number of ranks on resume: in ``sync``/``allreduce`` each step's data depends on the
number of ranks (a DistributedSampler shards by rank, a rank's batch is a share of the global
one), so the run would not continue the same math: refused, unless the checkpoint was trained
on a fixed global batch (``BalancedBatchSampler``/``balanced_slice``: the same permutation in
the same global batches, the gradient weighted by sample counts is the global batch's whatever
the ranks). In ``easgd``/``hybrid`` the centre variable is the shared state: it is restored and
every worker starts from it, with a fresh optimizer state.

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
import os
import time
import uuid

from .. import settings
from ..errors import CheckpointError, CheckpointStop, SMBTimeoutError, UsageError
from . import checkpoint as layout
from . import checkpoint_state as cstate
from . import collectives, elastic, progress, runtime

log = logging.getLogger("eddis.core.checkpoint")

STOP = 1 << 32          # a request counter's increment for checkpoint-and-stop (periodic: 1)
CLOSED = 1 << 40        # the saves counter's increment by each unit whose training ended
END = 1 << 62           # on a unit's counter: its leader's word at the unit's end (+1: save)
SYNC_MODES = ("sync", "allreduce")


def before_commit(tmp_folder):
    """Called on rank 0 between the last file written and the rename (tests replace it to
    crash a run exactly there)."""


class Start:
    """What :func:`resume` found: where the training loop continues.

    ``step`` (optimizer steps done), ``epoch`` and ``batch`` (batches of that epoch done),
    ``global_step`` (iterations job-wide), ``extra`` (the keyword values given to checkpoint),
    ``path`` (None: nothing to resume, everything 0). A loop written once works both ways::

        start = eddis.resume(ckpt_dir, model, optimizer)
        for epoch in range(start.epoch, epochs):
            sampler.set_epoch(epoch)
            for i, batch in enumerate(loader):
                if start.done(epoch, i):
                    continue
    """

    def __init__(self, path=None, step=0, epoch=0, batch=0, global_step=0, extra=None, manifest=None):
        self.path, self.step, self.epoch, self.batch = path, int(step), int(epoch), int(batch)
        self.global_step = int(global_step)
        self.extra = dict(extra or {})
        self.manifest = manifest

    @property
    def resumed(self):
        return self.path is not None

    def done(self, epoch, batch):
        """Whether batch ``batch`` of ``epoch`` was trained before the checkpoint."""
        return (int(epoch), int(batch)) < (self.epoch, self.batch)

    def __getitem__(self, key):
        return self.as_dict()[key]

    def as_dict(self):
        return {"path": self.path, "step": self.step, "epoch": self.epoch, "batch": self.batch,
                "global_step": self.global_step, "extra": self.extra}

    def __repr__(self):
        return f"Start({self.as_dict()!r})"


# ---------------------------------------------------------------- what decides the math
def math_settings(state):
    """The settings a resumed run must share to continue the same computation."""
    reducer = None if state is None else state.reducer
    codec = getattr(reducer, "codec", None)
    averager = None if state is None else state.averager
    return {"mode": "sync" if state is None else state.mode,
            "compression": codec.name if codec is not None else settings.get("EDDIS_COMPRESSION"),
            "global_batch": None if state is None else state.global_batch,
            "balance": state is not None and state.balancer is not None,
            "tau": averager.tau if averager is not None else settings.get("EDDIS_EASGD_TAU"),
            "alpha": averager.alpha if averager is not None else settings.get("EDDIS_EASGD_ALPHA"),
            "total_iterations": progress.controller().total if progress.controller() is not None
            else settings.get("EDDIS_TOTAL_ITERATIONS"),
            "staleness": settings.get("EDDIS_STALENESS")}


def _mode(state):
    return "sync" if state is None else state.mode


def _share_error(what, error):
    """Every rank's ``error`` (a string or None); a CheckpointError on all if any failed."""
    errors = collectives.allgather_object(error, what=what)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError(f"{what} failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed[:4]))


def _attempt(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # every rank must hear of it, or the others wait forever
        return f"{type(exc).__name__}: {exc}"
    return None


# ---------------------------------------------------------------- checkpoint
def save(directory, state, participant, extra=None, reason="explicit", epoch=None, batch=None, keep=None):
    """Collective: write a checkpoint of the run into ``directory`` (a folder of checkpoints),
    as ``ckpt-<step>``; returns its path. Every rank must be at a step boundary."""
    import h5py

    rt = runtime.require("eddis.checkpoint()")
    rank, size = rt.rank, rt.size
    _remember(state, participant)
    ctl = progress.controller()
    if ctl is not None:
        ctl.publish_completed()   # no rank may wait for this one's progress while it waits here
    collectives.barrier(what="checkpoint: every rank at a step boundary")
    if state is not None and state.averager is not None:
        state.averager.finish()   # this worker's last centre update is in the pool
    collectives.barrier(what="checkpoint: every worker's last centre update applied")
    directory = os.path.abspath(os.fspath(directory))
    step = state.step if state is not None else 0
    data_epoch, data_batch = cstate.data_position(step)
    epoch = data_epoch if epoch is None else int(epoch)
    batch = data_batch if batch is None else int(batch)
    include_model = rank == 0 or _mode(state) not in SYNC_MODES
    folder = None
    error = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            folder = os.path.join(directory, layout.temporary_name(step, uuid.uuid4().hex[:8]))
            os.mkdir(folder)
        except OSError as exc:
            error = f"cannot create a checkpoint folder in {directory}: {exc}"
    folder, error = collectives.broadcast_object((folder, error), root=0, what="checkpoint: folder")
    if error is not None:
        raise CheckpointError(f"eddis.checkpoint(): {error}")

    def write_mine():
        with h5py.File(os.path.join(folder, layout.rank_file(rank, ".h5")), "w") as h5:
            cstate.write_rank(h5, state, epoch, batch)
        participant.write(os.path.join(folder, layout.rank_file(rank, participant.ext)), include_model)

    mine = {"rank": rank, "step": step, "epoch": epoch, "batch": batch, "model": include_model,
            "progress": cstate.progress_of_rank()}
    _share_error("checkpoint: writing every rank's files", _attempt(write_mine))
    per_rank = collectives.allgather_object(mine, what="checkpoint: every rank's position")
    result = None
    if rank == 0:
        def write_job():
            with h5py.File(os.path.join(folder, layout.TRAINING_STATE), "w") as h5:
                cstate.write_training(h5, state, [r["progress"] for r in per_rank])
            files = sorted(os.listdir(folder))
            manifest = layout.make_manifest(
                framework=participant.framework, world_size=size, mode=_mode(state), step=step,
                epoch=epoch, batch=batch, global_step=progress.global_step(),
                settings_used=math_settings(state), files=files, extra=extra, reason=reason,
                per_rank=[{k: v for k, v in r.items() if k != "progress"} for r in per_rank])
            layout.write_manifest(folder, manifest)
            before_commit(folder)
            layout.commit(folder, os.path.join(directory, layout.folder_name(step)))
            kept = settings.get("EDDIS_CHECKPOINT_KEEP") if keep is None else int(keep)
            layout.prune(directory, kept)

        result = _attempt(write_job)
    result = collectives.broadcast_object(result, root=0, what="checkpoint: commit")
    if result is not None:
        raise CheckpointError(f"eddis.checkpoint() into {directory} failed on rank 0: {result}")
    path = os.path.join(directory, layout.folder_name(step))
    log.info("checkpoint %s written (%s)", path, reason)
    return path


# ---------------------------------------------------------------- resume
def resume(path_or_dir, state, participant):
    """Collective: restore the newest complete checkpoint ``path_or_dir`` names (or that one);
    returns a :class:`Start` (all zeros when there is none)."""
    import h5py

    rt = runtime.require("eddis.resume()")
    rank, size = rt.rank, rt.size
    _remember(state, participant)
    found = error = manifest = None
    if rank == 0:
        try:
            found = layout.resolve(path_or_dir)
            manifest = None if found is None else layout.read_manifest(found)
        except CheckpointError as exc:
            error = str(exc)
    found, manifest, error = collectives.broadcast_object((found, manifest, error), root=0,
                                                          what="resume: finding the checkpoint")
    if error is not None:
        raise CheckpointError(error)
    if found is None:
        return Start()
    mode = _mode(state)
    _check_fits(found, manifest, mode, size, participant.framework, state)
    same_size = manifest["world_size"] == size
    saved_rank = rank if rank < manifest["world_size"] else None
    model_rank = 0 if mode in SYNC_MODES else saved_rank if same_size else None

    # this rank's own place (easgd/hybrid workers differ); a rank the checkpoint did not have
    # starts where rank 0 was in the data
    position = [(manifest["step"], manifest["epoch"], manifest["batch"])]

    def restore_mine():
        if saved_rank is not None:
            with h5py.File(os.path.join(found, layout.rank_file(saved_rank, ".h5")), "r") as h5:
                position[0] = cstate.read_rank(h5, state, restore_step=same_size or mode in SYNC_MODES)
        elif state is not None and mode in SYNC_MODES:
            state.step = manifest["step"]    # a new rank of a fixed-global-batch run: in step
        participant.read(
            None if model_rank is None else os.path.join(found, layout.rank_file(model_rank, participant.ext)),
            None if saved_rank is None else os.path.join(found, layout.rank_file(saved_rank, participant.ext)))
        with h5py.File(os.path.join(found, layout.TRAINING_STATE), "r") as h5:
            return cstate.read_training(h5, state, same_size)

    centre = []

    def restore():
        centre.append(restore_mine())

    _share_error("resume: reading the checkpoint", _attempt(restore))
    saved_centre, rates = centre[0]
    if saved_centre is not None and state is not None:
        state.on_attached(lambda s: _restore_centre(s, saved_centre, rates, rank, same_size))
    step, epoch, batch = position[0]
    if state is not None and state.step != step:   # easgd on another number of workers: afresh
        step, epoch, batch = state.step, 0, 0
    cstate.set_position(epoch, batch, step)
    collectives.barrier(what="resume: every rank restored")
    log.info("resumed from %s at step %d", found, step)
    return Start(found, step, epoch, batch, manifest["global_step"], manifest.get("extra"), manifest)


def _restore_centre(state, centre, rates, rank, same_size):
    """Collective (the barrier): the saved centre into this job's pool; with another number
    of workers, every worker starts from it."""
    if state.averager is None:
        return
    if len(centre) != state.averager.length:
        raise CheckpointError(f"the checkpoint's centre variable has {len(centre)} values, this model "
                              f"{state.averager.length}: resume with the model that was trained")
    cstate.restore_centre(state, centre, rates, rank)
    if not same_size:
        state.scatter(centre)
    collectives.barrier(what=f"resume: {state.mode} centre variable restored")


def _check_fits(found, manifest, mode, size, framework, state):
    old_size, old_mode = manifest["world_size"], manifest["mode"]
    if manifest["framework"] != framework:
        raise CheckpointError(f"checkpoint {found} was written by eddis.{manifest['framework']}, not "
                              f"eddis.{framework}: resume it with the framework that wrote it")
    if old_mode != mode:
        raise CheckpointError(f"checkpoint {found} was trained in mode {old_mode!r}, this run uses mode "
                              f"{mode!r}: resume with EDDIS_MODE={old_mode} (or mode={old_mode!r}), or "
                              "start a new run in a new checkpoint folder")
    fixed_batch = manifest["settings"].get("global_batch") is not None
    if old_size != size and mode in SYNC_MODES and not fixed_batch:
        raise CheckpointError(
            f"checkpoint {found} was written by {old_size} ranks in mode {mode}, this job has {size}: "
            "in synchronous training each step's data and batch depend on the number of ranks, so "
            f"the run would not continue the same computation. Resume with {old_size} ranks, or train "
            "on a fixed global batch (eddis.BalancedBatchSampler / balanced_slice), which resumes "
            "on any number of ranks.")
    now = math_settings(state)
    for key in ("compression", "tau", "alpha", "total_iterations", "staleness"):
        then = manifest["settings"].get(key)
        if then is not None and now.get(key) is not None and then != now[key]:
            log.warning("checkpoint %s was trained with %s=%s, this run uses %s=%s: the resumed run "
                        "does not continue the same computation", found, key, then, key, now[key])


# ---------------------------------------------------------------- when: the step boundary
class Schedule:
    """Periodic and requested checkpoints at step boundaries (see the module docstring).

    The counters are named after the optimizer's serial, which every rank knows, so a rank
    sets them up by itself whenever it first needs them: at its first step boundary, or at its
    end of training when it has no step left (a resumed run), with no collective either way.
    """

    def __init__(self, state, directory, interval=None, keep=None):
        from . import hybrid

        rt = runtime.require("periodic checkpoints")
        self.state = state
        self.directory = directory
        self.interval = layout.interval_from_settings() if interval is None else interval
        self.keep = keep
        self.rank = rt.rank
        mode = _mode(state)
        if mode in SYNC_MODES:
            unit = list(range(rt.size))
        elif mode == "hybrid":
            unit = hybrid.group_members()[runtime.group()]
        else:
            unit = [self.rank]
        name = f"eddis.checkpoint.h{state.serial}"
        client = runtime.smb_client()
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
        self.saves_done = 0      # saves this rank took part in
        self.posted = 0          # what the leader posted on the unit's counter: the step, or END + ...
        self.taken = 0           # the post this rank has acted on
        self.sent_request = False
        self.ended = False
        self.last_time = time.monotonic()
        self.last_periodic = 0

    def _periodic_due(self, completed):
        if self.rank != 0 or self.interval is None:
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
        """Collective, in every save: the request counter as the units' leaders saw it, the
        largest of them, decides whether the ranks stop after this save, the same on all."""
        mine = self.requests.read() if self.leader else None
        seen = [v for v in collectives.allgather_object(mine, what="checkpoint: the requests every unit saw")
                if v is not None]
        value = max(seen, default=self.agreed)
        stop = value // STOP > self.agreed // STOP
        self.agreed = self.seen = value
        self.saves_done += 1
        return stop


_schedules = {}      # id(state) -> Schedule
_participants = {}   # id(state) -> (state, the participant eddis.resume or eddis.checkpoint gave)
_warned = []


def _remember(state, participant):
    """What a save at a rank's end of training writes: that rank may have no step boundary
    left (a resumed run), only the eddis.resume that gave the participant."""
    if state is not None and participant is not None:
        _participants[id(state)] = (state, participant)


def _participant_of(state):
    state_and_participant = _participants.get(id(state))
    return state_and_participant[1] if state_and_participant and state_and_participant[0] is state else None


def schedule_of(state, directory=None):
    """The checkpoint Schedule of ``state`` (a HeteroStep), set up when first asked for."""
    directory = settings.get("EDDIS_CHECKPOINT_DIR") if directory is None else directory
    schedule = _schedules.get(id(state))
    if schedule is None or schedule.state is not state:
        schedule = _schedules[id(state)] = Schedule(state, directory)
    return schedule


def at_step_boundary(state, participant):
    """The adapters' optimizer calls this after every step: writes a periodic or requested
    checkpoint when the ranks agreed on one for this step; after a requested one, raises
    :class:`CheckpointStop` on every rank."""
    directory = settings.get("EDDIS_CHECKPOINT_DIR")
    if directory is None or state is None:
        if layout.pending_request() is not None and not _warned:
            _warned.append(True)
            log.error("a checkpoint was requested (%s), but EDDIS_CHECKPOINT_DIR is not set: nothing "
                      "is written and training goes on", layout.pending_request())
        return None
    _remember(state, participant)
    schedule = schedule_of(state, directory)
    if not schedule.decide(state.step):
        return None
    return _scheduled_save(schedule, participant)


def _at_end_of_training():
    """A rank's training is over (progress control): join a save that others began, so that
    nobody waits in it while this rank goes on to the script's end-of-training collectives."""
    from . import hetero

    directory = settings.get("EDDIS_CHECKPOINT_DIR")
    state = hetero.current()
    if directory is None or state is None or not runtime.is_initialized():
        return
    schedule = schedule_of(state, directory)
    if schedule.end_of_training():
        _scheduled_save(schedule, _participant_of(state))


progress.on_end_of_training(_at_end_of_training)


def _scheduled_save(schedule, participant):
    state = schedule.state
    if participant is None:
        raise UsageError("a checkpoint is due, but the optimizer does not know the model to save: call "
                         "eddis.resume(EDDIS_CHECKPOINT_DIR, model, optimizer) (or eddis.checkpoint) "
                         "once before training")
    stop = schedule.agree()
    path = save(schedule.directory, state, participant, reason="requested" if stop else "periodic")
    if stop:
        terminated = layout.requested_by_sigterm()
        layout.clear_request()
        if runtime.rank() == 0:
            layout.answer_request(path, state.step, terminated)
        state.stopped_for_checkpoint = path
        raise CheckpointStop(f"stopped after step {state.step} for a requested checkpoint ({path}); "
                             f"exit status {CheckpointStop('').code}: requeue the job to continue", path)
    return path
