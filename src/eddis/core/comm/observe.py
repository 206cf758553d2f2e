"""The wiring of the runtime and its reducers into the timeline and the profile.

The timeline's trace writer and the profile (:mod:`eddis.timeline`) are leaves
that know nothing of the runtime; this module, in ``core``, feeds them:

    on_init(comm, rank, size, hostname, group)   # eddis.init(): EDDIS_TIMELINE / EDDIS_PROFILE
    attach_reducer(reducer)                  # a gradient reducer was built
    reducer_waited(reducer, start_ns)        # the training thread waited in reducer.wait()
    train_step_done(reducer)                 # a step of several reductions ended (closures)
    on_shutdown(comm)                        # eddis.shutdown(): close, merge the profile

and rank 0's automatic progress display (EDDIS_PROGRESS, see
:mod:`eddis.timeline.progress`). A framework adapter that can see more (the
torch module hooks of :mod:`eddis.torch.timeline_hooks`) plugs in through
:func:`on_timeline_start` and :func:`on_backward_finished`, so that core names
no framework.

Everything here costs nothing measurable when both are off: the reducer
observer and ``reducer_waited`` return after two global lookups.

From the reducer's events (``ready``, ``push_start``, ``push_end``, ``done``) the
observer records BUCKET_READY (instant), PUSH (or ALLREDUCE in mode allreduce:
the collective itself), and PULL: the finish thread's time on the bucket, from
the later of its push end and the previous bucket's completion. Their durations
and bytes also feed the profile's ``t_comm``, ``bytes_sent`` and ``bytes_recv``.
One profile row, and one step of the progress line, per training step of the
first reducer: its ``reducer.wait()`` (the step's gradient synchronisation), or,
for a step of several reductions (a closure's evaluations, ``counted=False``),
the adapter's ``train_step_done``. ``t_step`` runs from the previous one, so it
holds the whole iteration (data, forward, backward, optimizer).
"""
import logging

from ... import identity, settings
from ...timeline import trace
from ...timeline.events import ALLREDUCE, BUCKET_READY, PULL, PUSH, WAIT

log = logging.getLogger("eddis.timeline")

_profiler = None
_progress = None
_primary = None  # the reducer whose wait() closes profile rows
_batch = [0]     # samples of the current step noted by the adapter or module hooks (0: unknown)
_size = 1
_timeline_start_hooks = []  # called once a rank's timeline has started
_backward_finished_hooks = []  # called when the last bucket of the primary reducer's step is ready


def on_timeline_start(hook):
    """Call ``hook()`` whenever eddis.init() starts this rank's timeline (EDDIS_TIMELINE)."""
    if hook not in _timeline_start_hooks:
        _timeline_start_hooks.append(hook)


def on_backward_finished(hook):
    """Call ``hook()`` when every bucket of the step's gradient is ready (backward is over)."""
    if hook not in _backward_finished_hooks:
        _backward_finished_hooks.append(hook)


def profiler():
    """The active :class:`~eddis.timeline.profile.StepProfiler`, or None."""
    return _profiler


def note_samples(n):
    """The current step's sample count on this rank, as the adapter saw it (torch: the
    batch dimension of the model's forward inputs); ``set_sample_count`` comes first."""
    _batch[0] = int(n)


def on_init(comm, rank, size, hostname=None, group=0, run_dir=None):
    """Start the timeline (EDDIS_TIMELINE; collective clock sync over ``comm``) and the profile."""
    global _profiler, _progress, _size

    _size = size
    if rank == 0 and settings.get("EDDIS_PROGRESS") != "off":
        from ...timeline import progress

        _progress = progress.Progress(rank=rank, final_line=False)
        progress._active = _progress if _progress.mode != "off" else None

    if settings.get("EDDIS_TIMELINE"):
        trace.start_timeline(rank=rank, comm=comm, metadata={"size": size, "hostname": hostname})
        for hook in _timeline_start_hooks:
            hook()
    if settings.get("EDDIS_PROFILE") and _profiler is None:
        from ...timeline.profile import StepProfiler

        run_dir = run_dir or settings.get("EDDIS_RUN_DIR")
        if not run_dir:
            # Without EDDIS_RUN_DIR each rank's default differs (local-<pid>): take rank 0's,
            # where the embedded SMB server of a plain mpirun run puts its files too.
            from ...smb import rundir

            run_dir = rundir.default_run_dir() if rank == 0 else None
            if comm is not None and size > 1:
                from . import collectives

                run_dir = collectives.broadcast_object(str(run_dir) if run_dir else None, comm=comm,
                                                       what="eddis profile (run directory)")
        # the mode is the primary reducer's, known once the optimizer builds it (attach_reducer)
        _profiler = StepProfiler(run_dir, rank, size=size, host=hostname, node=hostname,
                                 gpu_type=identity.gpu_type(), group=group)


def on_shutdown(comm=None):
    """Close the timeline; close the profile and (collective) let rank 0 merge it."""
    global _profiler, _primary, _progress
    trace.stop_timeline()
    if _progress is not None:
        from ...timeline import progress

        _progress.close()
        _progress = progress._active = None
    prof, _profiler = _profiler, None
    _primary = None
    if prof is not None:
        path = prof.finalize(comm)
        if path is not None:
            log.info("profile written to %s (eddis prof report %s)", path, path)
        return path
    return None


def attach_reducer(reducer):
    """Observe ``reducer``'s bucket events. The observer returns at once while the
    timeline and the profile are off, and picks them up when a window starts later."""
    global _primary
    if _primary is None:
        _primary = reducer
        if _profiler is not None:
            _profiler.set_mode(reducer.mode)  # what the optimizer was given, not EDDIS_MODE
    reducer.add_listener(_ReducerObserver(reducer))


def reducer_built(reducer, mode):
    """``reducer`` serves training mode ``mode`` (a 1-rank job's local reducer serves any)."""
    if reducer is _primary and _profiler is not None:
        _profiler.set_mode(mode)


def reducer_waited(reducer, start_ns, counted=True):
    """``reducer.wait()`` blocked the training thread from ``start_ns`` until now; ``counted``:
    that reduction ended a training step (else the adapter calls :func:`train_step_done`)."""
    _record_wait(start_ns, {"step": reducer.step - 1, "mode": reducer.mode})
    if counted:
        train_step_done(reducer)


def train_step_done(reducer, samples=None):
    """A training step of ``reducer``'s optimizer ended (one row of the progress and profile);
    ``samples``: the global batch's, when the adapter counted them over the ranks."""
    if reducer is _primary and _progress is not None:
        _progress.update(samples=_global_samples(reducer) if samples is None else samples)
    if _profiler is not None and reducer is _primary:
        _profiler.step_end(_samples(reducer))


def _global_samples(reducer):
    """The samples of every rank in the reducer's last step: the sum of the sample counts the
    scripts gave, where the mode's reduction adds them up (``total_weight``), else this rank's
    count times the ranks (right for equal shares, the case without set_sample_count), or None."""
    total = getattr(reducer, "total_weight", None)
    if getattr(reducer, "weight_given", False) and total is not None:
        return int(round(total))
    samples = _known_samples(reducer)
    return None if samples is None else samples * _size


def reducer_waited_bucket(reducer, bucket, start_ns):
    """``reducer.wait_bucket(bucket)`` blocked the training thread from ``start_ns`` until now
    (an update applied bucket by bucket: the step's waits are these and the final wait())."""
    _record_wait(start_ns, {"step": reducer.step, "mode": reducer.mode, "bucket": bucket})


def _record_wait(start_ns, args):
    """The training thread's wait from ``start_ns`` until now, on the timeline and in the profile."""
    tl, prof = trace._timeline, _profiler
    if tl is None and prof is None:
        return
    end_ns = trace.perf_ns()
    if tl is not None:
        tl.record("X", WAIT, None, start_ns, end_ns - start_ns, args)
    if prof is not None:
        prof.add_wait((end_ns - start_ns) / 1e9)


def _known_samples(reducer):
    """This rank's samples in the reducer's last step: the count the script gave
    (``set_sample_count``, balanced shares), else what the adapter saw, else None."""
    if getattr(reducer, "weight_given", False):
        return int(round(reducer._step_weight))
    return _batch[0] or None


def _samples(reducer):
    known = _known_samples(reducer)
    return max(1, int(round(getattr(reducer, "_step_weight", 1.0)))) if known is None else known


class _ReducerObserver:
    """Turns one reducer's events into timeline events and profile figures."""

    def __init__(self, reducer):
        self.reducer = reducer
        self.push_name = ALLREDUCE if reducer.mode == "allreduce" else PUSH
        self.push_start = {}
        self.push_end = {}
        self.last_done = 0
        self.ready = 0

    def __call__(self, event, step, bucket, nbytes, t_ns):
        tl, prof = trace._timeline, _profiler
        if tl is None and prof is None:
            return
        if event == "ready":
            if tl is not None:
                tl.record("i", BUCKET_READY, None, t_ns, 0, {"step": step, "bucket": bucket})
            self.ready += 1
            if self.ready == self.reducer.num_buckets:
                self.ready = 0
                if self.reducer is _primary:
                    for hook in _backward_finished_hooks:
                        hook()
        elif event == "push_start":
            self.push_start[bucket] = t_ns
        elif event == "push_end":
            start = self.push_start.pop(bucket, t_ns)
            self.push_end[bucket] = t_ns
            if tl is not None:
                tl.record("X", self.push_name, None, start, t_ns - start,
                          {"step": step, "bucket": bucket, "bytes": nbytes})
            if prof is not None:
                prof.add_comm((t_ns - start) / 1e9, bytes_sent=nbytes)
        elif event == "done":
            start = max(self.push_end.pop(bucket, t_ns), self.last_done)
            self.last_done = t_ns
            r = self.reducer
            nbytes = nbytes or r.plan.buckets[bucket].count * r.codec.itemsize
            if tl is not None:
                tl.record("X", PULL, None, start, t_ns - start, {"step": step, "bucket": bucket, "bytes": nbytes})
            if prof is not None:
                prof.add_comm((t_ns - start) / 1e9, bytes_recv=nbytes)
