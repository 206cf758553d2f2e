"""Collective resume of a training run from a checkpoint (:mod:`.save` writes them).

Changed number of ranks on resume: in ``sync``/``allreduce`` each step's data depends on the
number of ranks (a DistributedSampler shards by rank, a rank's batch is a share of the global
one), so the run would not continue the same math: refused, unless the checkpoint was trained
on a fixed global batch (``BalancedBatchSampler``/``balanced_slice``: the same permutation in
the same global batches, the gradient weighted by sample counts is the global batch's whatever
the ranks). In ``easgd``/``hybrid`` the centre variable is the shared state: it is restored and
every worker starts from it, with a fresh optimizer state.

A checkpoint that lost ranks before it (an elastic run) is resumed as one of fewer workers: in
easgd/hybrid the centre variable carries on and every worker starts from it, and the global
learning counter continues from what the checkpoint consumed, the iterations a lost rank had
claimed and not run included.
"""
import logging
import os

from ...errors import CheckpointError
from ..comm import collectives, runtime
from . import folders as layout
from . import state as cstate
from . import verify
from .save import SYNC_MODES, attempt, bind, math_settings, mode_of, share_error

log = logging.getLogger("eddis.core.checkpoint")


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


def resume(path_or_dir, state, participant):
    """Collective: restore the newest complete checkpoint ``path_or_dir`` names (or that one)
    whose files verify against their checksums (:mod:`eddis.core.checkpoint.verify`); returns a
    :class:`Start` (all zeros when there is none)."""
    import h5py

    rt = runtime.require("eddis.resume()")
    rank, size = rt.rank, rt.size
    bind(state, participant)
    # the newest that verifies; a corrupt one is never loaded
    found, manifest = verify.choose(path_or_dir)
    if found is None:
        return Start()
    mode = mode_of(state)
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

    share_error("resume: reading the checkpoint", attempt(restore))
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
