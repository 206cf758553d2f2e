"""Collective checkpoint of a training run: who takes part, who writes what, who commits.

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

Elastic runs (EDDIS_ELASTIC, :mod:`eddis.core.comm.elastic`): a checkpoint is a collective of the
live ranks, not of every rank: each of its waits and exchanges is a barrier of the live ranks
over SMB (``Membership.exchange``), which a lost rank holds up for EDDIS_ELASTIC_LOST_AFTER at
most and then leaves out, never an MPI collective, which would wait for a dead rank until
EDDIS_COMM_TIMEOUT and fail. The lowest rank present commits (rank 0 unless it was lost; if
the committer is lost during the save, the next lowest writes it again), and the manifest
names the ranks in the checkpoint (``ranks``) and the lost ones (``lost_ranks``). Once every
rank below it was lost, the lowest live rank asks for the periodic checkpoints. A resume takes
a checkpoint that lost ranks as one of fewer workers (:mod:`.resume`).

When a checkpoint is taken is :mod:`.schedule`'s; reading one back is :mod:`.resume`'s.
"""
import logging
import os
import uuid

from ... import settings
from ...errors import CheckpointError
from ..comm import collectives, elastic, runtime
from ..progress import counter as progress
from . import folders as layout
from . import state as cstate
from . import verify

log = logging.getLogger("eddis.core.checkpoint")

SYNC_MODES = ("sync", "allreduce")
MAX_ERROR_CHARS = 400   # of one rank's error, so that it fits its part of an exchange


def before_commit(tmp_folder):
    """Called on the committing rank (rank 0, or in an elastic run that lost it the lowest
    live rank) between the last file written and the rename (tests replace it to crash a run
    exactly there)."""


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


def mode_of(state):
    return "sync" if state is None else state.mode


def share_error(what, error):
    """Every rank's ``error`` (a string or None); a CheckpointError on all if any failed."""
    errors = collectives.allgather_object(error, what=what)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError(f"{what} failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed[:4]))


def attempt(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # every rank must hear of it, or the others wait forever
        return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    return None


# ---------------------------------------------------------------- who saves the model
_participants = {}   # id(state) -> (state, the participant eddis.resume or eddis.checkpoint gave)


def bind(state, participant):
    """``participant`` saves the model of ``state``'s optimizer from now on: at its periodic and
    requested checkpoints, and at a save at a rank's end of training, where that rank may have
    no step boundary left (a resumed run), only the eddis.resume that gave the participant."""
    if state is not None and participant is not None:
        _participants[id(state)] = (state, participant)


def participant_of(state):
    """The participant bound to ``state`` (:func:`bind`), or None."""
    state_and_participant = _participants.get(id(state))
    return state_and_participant[1] if state_and_participant and state_and_participant[0] is state else None


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
    return save_and_committer(directory, state, participant, extra, reason, epoch, batch, keep)[0]


def save_and_committer(directory, state, participant, extra, reason, epoch, batch, keep):
    """:func:`save`; returns ``(path, the rank that committed it)``."""
    rt = runtime.require("eddis.checkpoint()")
    bind(state, participant)
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
    mode = mode_of(state)
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

    error = attempt(write_mine)
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
            outcome = attempt(_write_job, folder, os.path.join(directory, final_name), state, participant,
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
        framework=participant.framework, world_size=size, mode=mode_of(state), step=position["step"],
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
