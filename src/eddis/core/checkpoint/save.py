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

Elastic runs (EDDIS_ELASTIC, :mod:`eddis.core.comm.elastic`): a checkpoint is a collective of the
live ranks, not of every rank: each of its waits and exchanges is a barrier of the live ranks
over SMB (``Membership.exchange``), which a lost rank holds up for EDDIS_ELASTIC_LOST_AFTER at
most and then leaves out, never an MPI collective, which would wait for a dead rank until
EDDIS_COMM_TIMEOUT and fail. The lowest rank present commits (rank 0 unless it was lost; if
the committer is lost during the save, the next lowest writes it again), and the manifest
names the ranks in the checkpoint (``ranks``) and the lost ones (``lost_ranks``). Once every
rank below it was lost, the lowest live rank asks for the periodic checkpoints. A resume takes
a checkpoint that lost ranks as one of fewer workers: in easgd/hybrid the centre variable
carries on and every worker starts from it, and the global learning counter continues from
what the checkpoint consumed, the iterations a lost rank had claimed and not run included.

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

from ... import settings
from ...errors import CheckpointError, CheckpointStop, SMBTimeoutError, UsageError
from ..comm import collectives, connection, elastic, groups, runtime
from ..progress import counter as progress, driver
from . import folders as layout
from . import state as cstate
from . import verify

log = logging.getLogger("eddis.core.checkpoint")

STOP = 1 << 32          # a request counter's increment for checkpoint-and-stop (periodic: 1)
CLOSED = 1 << 40        # the saves counter's increment by each unit whose training ended
END = 1 << 62           # on a unit's counter: its leader's word at the unit's end (+1: save)
SYNC_MODES = ("sync", "allreduce")


def before_commit(tmp_folder):
    """Called on the committing rank (rank 0, or in an elastic run that lost it the lowest
    live rank) between the last file written and the rename (tests replace it to crash a run
    exactly there)."""


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
        return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    return None


MAX_ERROR_CHARS = 400   # of one rank's error, so that it fits its part of an exchange


# ---------------------------------------------------------------- who takes part
class EveryRank:
    """The ranks a checkpoint waits for and exchanges with: all of them, over MPI."""

    def barrier(self, what):
        """Wait for the others; returns the ranks present."""
        collectives.barrier(what=what)
        return list(range(runtime.size()))

    def gather(self, obj, what, sources=None):
        """``{rank: obj}`` of every rank (of ``sources`` only, when given)."""
        values = collectives.allgather_object(obj, what=what)
        return {r: v for r, v in enumerate(values) if sources is None or r in sources}


class LiveRanks:
    """In an elastic run: the live ranks, over SMB (:meth:`eddis.core.comm.elastic.Membership.exchange`);
    a rank lost before or during a checkpoint holds nobody up and is left out of it."""

    def __init__(self, members):
        self.members = members

    def barrier(self, what):
        self.members.barrier(what)
        return self.members.arrived()

    def gather(self, obj, what, sources=None):
        return self.members.exchange(obj, what, sources)


def taking_part():
    """Who a checkpoint of this run is a collective of: the live ranks in an elastic run."""
    members = elastic.current()
    return EveryRank() if members is None else LiveRanks(members)


def committer_of(present):
    """The rank that creates, completes and commits a checkpoint: the lowest of those in it
    (rank 0, unless an elastic run lost it)."""
    return min(present)


# ---------------------------------------------------------------- checkpoint
def save(directory, state, participant, extra=None, reason="explicit", epoch=None, batch=None, keep=None):
    """Collective: write a checkpoint of the run into ``directory`` (a folder of checkpoints),
    as ``ckpt-<step>``; returns its path. Every rank must be at a step boundary. In an elastic
    run a collective of the live ranks: the checkpoint holds those, and its manifest names them
    (``ranks``) and the lost ones (``lost_ranks``)."""
    return _save(directory, state, participant, extra, reason, epoch, batch, keep)[0]


def _save(directory, state, participant, extra, reason, epoch, batch, keep):
    """:func:`save`; returns ``(path, the rank that committed it)``."""
    rt = runtime.require("eddis.checkpoint()")
    _remember(state, participant)
    ranks = taking_part()
    ctl = progress.controller()
    if ctl is not None:
        ctl.publish_completed()   # no rank may wait for this one's progress while it waits here
    ranks.barrier("checkpoint: every rank at a step boundary")
    if state is not None and state.averager is not None:   # (a plain optimizer's run has none)
        state.settle_exchange()   # this worker's last move and centre update are in
    directory = os.path.abspath(os.fspath(directory))
    step = state.step if state is not None else 0
    data_epoch, data_batch = cstate.data_position(step)
    position = {"step": step, "epoch": data_epoch if epoch is None else int(epoch),
                "batch": data_batch if batch is None else int(batch)}
    # a rank that was to commit and was lost during the save leaves it to the next lowest
    for _ in range(rt.size):
        written = _write(ranks, rt.rank, rt.size, directory, state, participant, position, extra, reason, keep)
        if written is not None:
            return written
    raise CheckpointError(f"eddis.checkpoint() into {directory}: every rank that began to commit it "
                          "was lost during it")


def _write(ranks, rank, size, directory, state, participant, position, extra, reason, keep):
    """One attempt of rank ``rank`` (of ``size``) at a checkpoint by the ranks present:
    ``(path, committer)``, or None when the committing rank was lost before it said how its
    commit went."""
    import h5py

    present = ranks.barrier("checkpoint: every worker's last centre update applied")
    committer = committer_of(present)
    mode = _mode(state)
    step = position["step"]
    named = None
    if rank == committer:
        try:
            os.makedirs(directory, exist_ok=True)
            number = layout.number_for(directory, step, after_newest=mode not in SYNC_MODES)
            named = (layout.temporary_name(number, uuid.uuid4().hex[:8]), layout.folder_name(number), None)
            os.mkdir(os.path.join(directory, named[0]))
        except OSError as exc:
            named = (None, None, f"cannot create a checkpoint folder in {directory}: {exc}"[:MAX_ERROR_CHARS])
    told = ranks.gather(named, "checkpoint: folder", sources=[committer])
    if committer not in told:
        return _committer_lost(rank, committer, "creating the folder")
    tmp_name, final_name, error = told[committer]
    if error is not None:
        raise CheckpointError(f"eddis.checkpoint(): {error}")
    folder = os.path.join(directory, tmp_name)
    include_model = rank == 0 or mode not in SYNC_MODES
    checksums = {}

    def write_mine():
        names = (layout.rank_file(rank, ".h5"), layout.rank_file(rank, participant.ext))
        with h5py.File(os.path.join(folder, names[0]), "w") as h5:
            cstate.write_rank(h5, state, position["epoch"], position["batch"])
        participant.write(os.path.join(folder, names[1]), include_model)
        checksums.update(verify.seal_all(folder, names))   # every rank its own, in parallel

    error = _attempt(write_mine)
    mine = {"rank": rank, **position, "model": include_model, "progress": cstate.progress_of_rank(),
            "checksums": checksums, "error": error}
    # only the committer reads every rank's part; it tells the others how it went
    per_rank = ranks.gather(mine, "checkpoint: every rank's files and position",
                            sources=None if rank == committer else [committer])
    outcome = None
    if rank == committer:
        failed = [(r, p["error"]) for r, p in sorted(per_rank.items()) if p["error"] is not None]
        if failed:
            outcome = "writing the files failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed[:2])
        else:
            outcome = _attempt(_write_job, folder, os.path.join(directory, final_name), state, participant,
                               position, per_rank, size, extra, reason, keep)
            if outcome is not None:
                outcome = f"completing it failed on rank {rank}: {outcome}"
    told = ranks.gather(outcome, "checkpoint: commit", sources=[committer])
    if committer not in told:
        return _committer_lost(rank, committer, "completing it")
    if told[committer] is not None:
        raise CheckpointError(f"eddis.checkpoint() into {directory}: {told[committer]}")
    path = os.path.join(directory, final_name)
    log.info("checkpoint %s written (%s)", path, reason)
    return path, committer


def _committer_lost(rank, committer, doing):
    log.warning("rank %d: rank %d was lost while %s a checkpoint; the next lowest live rank writes it "
                "again", rank, committer, doing)
    return None


def _write_job(folder, final_folder, state, participant, position, per_rank, size, extra, reason, keep):
    """The committer: the job's state and the manifest into ``folder``, then the commit."""
    import h5py

    with h5py.File(os.path.join(folder, layout.TRAINING_STATE), "w") as h5:
        cstate.write_training(h5, state, {r: p["progress"] for r, p in per_rank.items()}, size)
    held = sorted(per_rank)
    # a rank that wrote its files, then was lost before it said so: not in the checkpoint
    mine = {layout.rank_file(r, ext) for r in held for ext in (".h5", participant.ext)}
    files = [name for name in os.listdir(folder) if not name.startswith("rank-") or name in mine]
    checksums = {name: entry for r in held for name, entry in per_rank[r]["checksums"].items()}
    checksums.update(verify.seal_all(folder, [name for name in files if name not in checksums]))
    manifest = layout.make_manifest(
        framework=participant.framework, world_size=size, mode=_mode(state), step=position["step"],
        epoch=position["epoch"], batch=position["batch"], global_step=progress.global_step(),
        settings_used=math_settings(state), files=files, extra=extra, reason=reason,
        per_rank=[{k: v for k, v in per_rank[r].items() if k not in ("progress", "error", "checksums")}
                  for r in held],
        ranks=held, checksums=checksums)
    layout.write_manifest(folder, manifest)
    before_commit(folder)
    layout.commit(folder, final_folder)
    kept = settings.get("EDDIS_CHECKPOINT_KEEP") if keep is None else int(keep)
    layout.prune(os.path.dirname(final_folder), kept)


# ---------------------------------------------------------------- resume
def resume(path_or_dir, state, participant):
    """Collective: restore the newest complete checkpoint ``path_or_dir`` names (or that one)
    whose files verify against their checksums (:mod:`eddis.core.checkpoint.verify`); returns a
    :class:`Start` (all zeros when there is none)."""
    import h5py

    rt = runtime.require("eddis.resume()")
    rank, size = rt.rank, rt.size
    _remember(state, participant)
    # the newest that verifies; a corrupt one is never loaded
    found, manifest = verify.choose(path_or_dir)
    if found is None:
        return Start()
    mode = _mode(state)
    _check_fits(found, manifest, mode, size, participant.framework, state)
    held = layout.ranks_held(manifest)
    # a checkpoint that lost ranks before it (elastic) is one of fewer workers: the centre
    # variable carries on, as on any change of their number
    same_size = manifest["world_size"] == size and len(held) == size
    saved_rank = rank if rank in held else None
    model_rank = 0 if mode in SYNC_MODES else saved_rank if same_size else None
    if rank == 0 and layout.lost_ranks(manifest):
        log.warning("checkpoint %s holds %d of the %d workers that wrote it (rank(s) %s were lost before "
                    "it): every worker of this job starts from its centre variable, with a fresh optimizer "
                    "state, and the global learning counter continues", found, len(held),
                    manifest["world_size"], ", ".join(map(str, layout.lost_ranks(manifest))))

    # this rank's own place (easgd/hybrid workers differ); a rank the checkpoint did not have
    # starts where its committer was in the data
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
    directory = settings.get("EDDIS_CHECKPOINT_DIR")
    state = driver.current()
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
    path, committer = _save(schedule.directory, state, participant, None,
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
