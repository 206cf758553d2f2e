"""What a checkpoint holds besides the framework's tensors, captured and restored framework-free.

- per rank (``rank-NNNNN.h5``): Python's and numpy's global RNG states, the optimizer's step
  count, the easgd worker's measured throughput, the data position (epoch, batches of it done);
- for the job (``training.h5``, the committing rank): the easgd/hybrid centre variable and the workers'
  published throughputs (SMB pools), the global learning counter's value less the iterations
  claimed but not run, every rank's completed steps (the staleness counters) and the balanced
  shares of the global batch.

A run whose optimizer is not EDDIS's (a plain one beside TensorFlow's DistributedGradientTape)
has none of the job's part: :class:`PlainOptimizerRun` stands for its state.

Everything is read at a consistent cut: every rank waits at a step boundary (:mod:`.save`)
and its last centre update is applied before the committing rank (rank 0, or in an elastic run
the lowest live one) reads the pools.
"""
import random

import numpy as np

from ...errors import ConfigError
from ..progress import counter as progress, driver

# ---------------------------------------------------------------- the data position
# The epoch the EDDIS samplers were last set to and the optimizer step it began at (after a
# resume: the step it would have begun at, so batches done before the resume count).
_epoch = {"epoch": 0, "start_step": 0}


def _current_step():
    state = driver.current()
    return state.step if state is not None else 0


def note_epoch(epoch):
    """An EDDIS sampler's ``set_epoch(epoch)``: remember where that epoch began (in optimizer
    steps), so a checkpoint knows how many of its batches are done. Setting the current
    epoch again (a resumed loop's first ``set_epoch``) keeps where it began."""
    if int(epoch) != _epoch["epoch"]:
        _epoch.update(epoch=int(epoch), start_step=_current_step())


def data_position(step):
    """``(epoch, batches of it done)`` after ``step`` optimizer steps."""
    return _epoch["epoch"], max(0, int(step) - _epoch["start_step"])


def batches_done(epoch):
    """Batches of ``epoch`` done so far (0 for another epoch than the current one)."""
    return data_position(_current_step())[1] if int(epoch) == _epoch["epoch"] else 0


def set_position(epoch, batch, step):
    """After a resume: ``batch`` batches of ``epoch`` were done by optimizer step ``step``."""
    _epoch.update(epoch=int(epoch), start_step=int(step) - int(batch))


def reset_position():
    _epoch.update(epoch=0, start_step=0)


# ---------------------------------------------------------------- per rank
def write_rank(h5, state, epoch, batch):
    """This rank's RNG states, step and data position into the open HDF5 file ``h5``."""
    version, internal, gauss = random.getstate()
    g = h5.create_group("rng")
    g.create_dataset("python", data=np.asarray(internal, dtype=np.int64))
    g.attrs["python_version"] = version
    g.attrs["python_gauss"] = "none" if gauss is None else repr(float(gauss))
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    g.create_dataset("numpy", data=keys)
    g.attrs.update(numpy_kind=kind, numpy_pos=pos, numpy_has_gauss=has_gauss, numpy_cached=cached)
    h = h5.create_group("hetero")
    h.attrs["step"] = state.step if state is not None else 0
    averager = None if state is None else state.averager
    h.attrs["rate"] = averager.rate if averager is not None else 0.0
    h.attrs["mass"] = averager.mass if averager is not None else 1.0
    d = h5.create_group("data")
    d.attrs.update(epoch=int(epoch), batch=int(batch))


def read_rank(h5, state, restore_step=True):
    """Restore what :func:`write_rank` saved; returns ``(step, epoch, batch)``."""
    g = h5["rng"]
    gauss = g.attrs["python_gauss"]
    random.setstate((int(g.attrs["python_version"]), tuple(int(v) for v in g["python"][()]),
                     None if gauss == "none" else float(gauss)))
    np.random.set_state((str(g.attrs["numpy_kind"]), g["numpy"][()], int(g.attrs["numpy_pos"]),
                         int(g.attrs["numpy_has_gauss"]), float(g.attrs["numpy_cached"])))
    step = int(h5["hetero"].attrs["step"])
    if state is not None and restore_step:
        state.step = step
        if state.averager is not None:
            state.averager.rate = float(h5["hetero"].attrs["rate"])
            state.averager.mass = float(h5["hetero"].attrs["mass"])
    return step, int(h5["data"].attrs["epoch"]), int(h5["data"].attrs["batch"])


def progress_of_rank():
    """This rank's part of the global learning counter at a step boundary:
    ``(steps completed, iterations claimed for its unit but not run, or 0 if not its leader)``."""
    ctl = progress.controller()
    if ctl is None:
        return None
    ctl.settle_claim()   # a claim under way: counted here, before the committer reads the counter
    done = ctl.steps_done + (1 if ctl.started else 0)
    unused = ctl.reserved * ctl.unit if ctl.leader and not ctl.finished else 0
    return done, unused


# ---------------------------------------------------------------- the job (the committing rank)
LOST_STEPS = -1   # steps_done of a rank lost before the checkpoint (its count went with it)


def steps_and_consumed(counter, progress_parts, size):
    """``(steps done by rank, iterations consumed)`` at a checkpoint: ``progress_parts`` maps
    each rank in it to its :func:`progress_of_rank`; a rank lost before it has LOST_STEPS, and
    the iterations it had claimed and not run count as consumed (nobody runs them)."""
    steps = [progress_parts[r][0] if r in progress_parts else LOST_STEPS for r in range(size)]
    return steps, int(counter) - sum(unused for _, unused in progress_parts.values())


def write_training(h5, state, progress_parts, size):
    """The SMB pools and counters of the run into ``h5`` (the committing rank, after every
    rank's last centre update is in). ``progress_parts``: ``{rank: progress_of_rank()}`` of the
    ranks in the checkpoint, of ``size`` ranks in all."""
    averager = None if state is None else state.averager
    if averager is not None and state.centre_ready:
        h5.create_dataset("centre", data=averager.read_center())
        if averager.rates is not None:
            h5.create_dataset("rates", data=averager.rates.read(out=np.empty(averager.workers), slot=0))
    ctl = progress.controller()
    if ctl is not None and all(p is not None for p in progress_parts.values()):
        p = h5.create_group("progress")
        value = ctl.counter.read()
        steps, consumed = steps_and_consumed(value, progress_parts, size)
        p.attrs["counter"] = value
        p.attrs["consumed"] = consumed
        p.attrs["total"] = ctl.total
        p.create_dataset("steps_done", data=np.asarray(steps, dtype=np.int64))
    balancer = None if state is None else state.balancer
    # a hybrid group's shares are its own (rank 0 knows only its group's): they are measured
    # again within EDDIS_BALANCE_WARMUP steps of a resume
    if balancer is not None and state.mode != "hybrid":
        b = h5.create_group("balance")
        b.create_dataset("shares", data=np.asarray(balancer.shares_for(state.step), dtype=np.float64))
        b.attrs["global_batch"] = -1 if balancer.global_batch is None else balancer.global_batch
    if state is not None and state.global_batch is not None:
        h5.attrs["global_batch"] = state.global_batch


def read_training(h5, state, same_size):
    """Restore the SMB state into this job (every rank calls it; rank 0 writes the pools).
    Returns the parts that need a collective step after it (nothing here blocks)."""
    if "progress" in h5:
        p = h5["progress"]
        steps = p["steps_done"][()].tolist() if same_size else None
        progress.resume_from(int(p.attrs["consumed"]), steps)
    if state is not None and state.balancer is not None and "balance" in h5 and same_size \
            and len(h5["balance"]["shares"]) == state.balancer.size:
        shares = h5["balance"]["shares"][()]
        state.balancer.shares = shares.copy()
        state.balancer.schedule = [(0, shares.copy())]
        gb = int(h5["balance"].attrs["global_batch"])
        if gb > 0 and state.balancer.global_batch is None:
            state.balancer.global_batch = gb
    centre = h5["centre"][()] if "centre" in h5 else None
    rates = h5["rates"][()] if "rates" in h5 and same_size else None
    return centre, rates


def restore_centre(state, centre, rates, rank):
    """Rank 0 writes the saved centre (and throughputs) into this job's pools; no rank
    initialises the centre from its parameters any more. Collective barrier by the caller."""
    averager = state.averager
    if rank == 0:
        averager.initialize(centre)
        if rates is not None and averager.rates is not None and len(rates) == averager.workers:
            averager.rates.write(np.ascontiguousarray(rates, dtype=np.float64), slot=0)
    state.centre_restored()


# ---------------------------------------------------------------- a run without EDDIS's optimizer
PLAIN_OPTIMIZER_MODES = ("sync", "allreduce")


class PlainOptimizerRun:
    """What a checkpoint cuts of a run whose optimizer is not EDDIS's: a plain optimizer beside
    a gradient reduction (TensorFlow's ``DistributedGradientTape``), which trains in ``sync`` or
    ``allreduce`` only. Every rank then holds the same parameters, nothing of the training lives
    in SMB, and the optimizer counts its own steps: ``step`` reads and restores that count
    (``get_step()``, ``set_step(n)``), which names the checkpoint."""

    averager = balancer = reducer = global_batch = None
    centre_ready = False

    def __init__(self, mode, get_step, set_step):
        if mode not in PLAIN_OPTIMIZER_MODES:
            raise ConfigError(
                f"a checkpoint of a plain optimizer (not an eddis.DistributedOptimizer) needs mode sync or "
                f"allreduce, where a DistributedGradientTape averages the gradients; this run is in mode "
                f"{mode!r}, whose state only EDDIS's optimizer holds: wrap the optimizer, "
                "optimizer = eddis.DistributedOptimizer(optimizer)")
        self.mode = mode
        self._get_step, self._set_step = get_step, set_step

    @property
    def step(self):
        return int(self._get_step())

    @step.setter
    def step(self, value):
        self._set_step(int(value))
