"""The framework-agnostic surface that ``eddis.torch`` and ``eddis.tensorflow`` both bind.

As Horovod's ``HorovodBasics``: one object holds every call whose meaning does
not depend on the framework (who am I, object collectives, the global learning
counter, the final model, rank 0's atomic save, which reduction ops a gradient
may use), and each adapter binds its methods as module functions::

    from ..core.basics import basics as _basics
    rank = _basics.rank
    should_stop = _basics.should_stop

so the two adapters cannot drift apart, and neither reaches into core's
private names. Tensor conversions stay in the adapters.
"""
import importlib
import functools
import os

from .. import settings, timeline
from ..errors import CheckpointError, ConfigError, UsageError
from . import lifecycle
from .checkpoint import folders, resume, save, schedule, state as checkpoint_state
from .comm import adasum, collectives, elastic, engine, runtime
from .comm.ops import Average, resolve_op
from .hetero import step as hetero
from .layout import sampler
from .progress import agreement, counter as progress, driver, join as _join
from .reduce.base import any_built


class EddisBasics:
    # ------------------------------------------------------------ the job and this rank
    init = staticmethod(lifecycle.init)
    shutdown = staticmethod(lifecycle.shutdown)
    is_initialized = staticmethod(runtime.is_initialized)
    rank = staticmethod(runtime.rank)
    size = staticmethod(runtime.size)
    local_rank = staticmethod(runtime.local_rank)
    local_size = staticmethod(runtime.local_size)
    group = staticmethod(runtime.group)
    num_groups = staticmethod(runtime.num_groups)
    hostname = staticmethod(runtime.hostname)

    @staticmethod
    def require(what):
        """The running runtime, or a UsageError saying ``what`` needs eddis.init() first."""
        return runtime.require(what)

    def cross_rank(self):
        """Index of this rank's node (Horovod's cross_rank)."""
        return self.require("eddis.cross_rank()").node_index

    def cross_size(self):
        """Number of nodes (Horovod's cross_size)."""
        return self.require("eddis.cross_size()").num_nodes

    def mpi_threads_supported(self):
        return runtime.thread_multiple()

    # ------------------------------------------------------------ what this installation uses
    # Horovod scripts ask these to choose options (e.g. a learning-rate scaler for NCCL).
    # EDDIS reduces over SMB and MPI on the host, so the GPU libraries Horovod can be
    # built with are never used: their answers are False, whatever the machine has.
    @staticmethod
    def mpi_built():
        """Whether MPI is usable: EDDIS's ``eddis._mpi`` extension, or mpi4py with an MPI
        library it can load (the runtime needs one of them to start)."""
        for module in ("eddis._mpi", "mpi4py.MPI"):
            try:
                importlib.import_module(module)
                return True
            except Exception:  # ImportError, or mpi4py's RuntimeError without an MPI library
                continue
        return False

    @staticmethod
    def mpi_enabled():
        """Whether this process runs over MPI: from eddis.init() on (the runtime is MPI's)."""
        return runtime.is_initialized()

    @staticmethod
    def cuda_built(framework_built_with_cuda):
        """Whether EDDIS can reduce CUDA tensors of the calling framework. EDDIS needs no CUDA
        of its own (gradients of CUDA tensors are staged through pinned host memory), so this
        is whether the framework was built with CUDA: a build property, like Horovod's, not
        whether this machine has a GPU (``torch.cuda.is_available()``)."""
        return bool(framework_built_with_cuda())

    @staticmethod
    def gloo_built():
        return False

    @staticmethod
    def gloo_enabled():
        return False

    @staticmethod
    def nccl_built():
        return False

    @staticmethod
    def rocm_built():
        return False

    @staticmethod
    def ddl_built():
        return False

    @staticmethod
    def ccl_built():
        return False

    # ------------------------------------------------------------ object collectives
    # The collectives a script calls run on eddis.core.comm.engine's thread, each announced
    # first: a rank inside join() takes part where Horovod's would, and every rank that
    # called one refuses it alike where it cannot run (eddis.core.comm.negotiate).
    def broadcast_object(self, obj, root_rank=0, name=None):
        self.require("eddis.broadcast_object()")
        return engine.broadcast_object(obj, root_rank, name).wait()

    def allgather_object(self, obj, name=None):
        self.require("eddis.allgather_object()")
        return engine.allgather_object(obj, name).wait()

    def barrier(self):
        self.require("eddis.barrier()")
        with timeline.span(timeline.BARRIER, args={"what": "eddis.barrier()"}):
            engine.barrier().wait()

    def announce(self, kind, root_rank=None):
        """Before a composite collective (``broadcast_parameters``...) moves its data over the
        runtime's communicator: returns once every rank made the same call; a UsageError on
        every caller while some rank is inside join()."""
        self.require(f"eddis.{kind}()")
        engine.announce(kind, root_rank)

    # ------------------------------------------------------------ shares of a batch
    # Pure functions of (sizes, weights): a script sizes its batches and cuts its
    # columns of a stream with them, whatever the framework.
    split_sizes = staticmethod(sampler.split_sizes)
    batch_slice = staticmethod(sampler.batch_slice)

    # ------------------------------------------------------------ tensor collectives
    # numpy in, a Handle out (eddis.core.comm.engine): ``.wait()`` for the blocking calls, a
    # handle number (``handle_number``) for Horovod's *_async ones.
    def allreduce_async(self, data, op=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
                        name=None):
        """``data`` (numpy) reduced over all ranks, in its dtype and shape: the numeric rules of
        every adapter's ``allreduce``. Floats are summed in float64 (metrics, not gradients:
        exactness over speed); an integer average is refused rather than truncated.
        op=Adasum combines the ranks' tensors in Adasum's tree (float64, the whole tensor
        one vector; a power-of-2 number of ranks), floats only."""
        self.require("eddis.allreduce()")
        op = resolve_op(op, average)
        return engine.allreduce(data, op.name, prescale_factor, postscale_factor, name)

    def allreduce_array(self, data, op=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
                        name=None):
        return self.allreduce_async(data, op, average, prescale_factor, postscale_factor, name).wait()

    def allgather_async(self, data, name=None):
        """Every rank's ``data`` concatenated along the first dimension."""
        self.require("eddis.allgather()")
        return engine.allgather(data, name)

    def broadcast_async(self, data, root_rank=0, name=None):
        """root_rank's ``data``, as a new array."""
        self.require("eddis.broadcast()")
        return engine.broadcast(data, root_rank, name)

    handle_number = staticmethod(engine.number)
    poll = staticmethod(engine.poll)
    synchronize = staticmethod(engine.synchronize)

    # ------------------------------------------------------------ uneven batches
    @staticmethod
    def join(device=-1):
        """Collective: this rank has no data left. Until every rank has joined it keeps
        taking part in the others' gradient reductions with zeros (and weight 0, so
        ``Average`` is the mean over the ranks that still had data) and steps its
        optimizer with their result, and in their ``allreduce`` and ``barrier`` calls
        (their allgather, broadcast... are refused on the ranks that make them); returns
        the rank that joined last, the same on every rank. ``device`` (Horovod's, for its
        zero tensors) is not needed: the reduction runs on the host. See eddis.core.progress.join."""
        return _join.join()

    # ------------------------------------------------------------ reduction ops
    @staticmethod
    def gradient_op(op, what, mode=None, sample_count=None):
        """The ReduceOp a gradient reduction may use (Average, Sum or Adasum), or a ConfigError
        naming ``what``. Adasum's rules, as Horovod's: no elastic modes (``mode``: easgd,
        hybrid; None: EDDIS_MODE), no sample counts, a power-of-2 number of ranks (the
        last two are checked again where the reducer is built and weighted)."""
        op = resolve_op(Average if op is None else op)
        if op.name not in ("average", "sum", "adasum"):
            raise ConfigError(f"{what} reduces gradients with op=Average, Sum or Adasum, not {op!r}")
        if op.name == "adasum":
            mode = settings.get("EDDIS_MODE") if mode is None else str(mode).lower()
            if mode in ("easgd", "hybrid"):
                raise ConfigError(f"{what}: op=Adasum combines every rank's gradients at every step, but "
                                  f"mode {mode!r} averages models elastically between groups: use mode "
                                  "'sync' or 'allreduce' with Adasum, or op=Average with this mode")
            if sample_count is not None:
                raise ConfigError(f"{what}: sample_count with op=Adasum: {adasum.ONE_WEIGHT_ONLY}")
            if runtime.is_initialized():
                adasum.check_ranks(runtime.size(), what)
        return op

    # ------------------------------------------------------------ the global learning counter
    def configure_progress(self, total=None, chunk=None, staleness=None, record=False):
        """Set up the global learning counter (collective; optional: the first
        should_stop() does it from EDDIS_TOTAL_ITERATIONS, EDDIS_CLAIM_CHUNK, EDDIS_STALENESS)."""
        state = driver.current()
        return progress.configure(total=total, chunk=chunk, staleness=staleness,
                                  mode=state.mode if state is not None else None, record=record)

    @staticmethod
    def should_stop():
        """True once the job's iterations (EDDIS_TOTAL_ITERATIONS) are used up; else this
        rank runs one more step. Call it once per step, as the loop condition."""
        return hetero.should_stop()  # notes when the loop's waiting ended: not compute time

    global_step = staticmethod(progress.global_step)
    progress_counts = staticmethod(progress.progress_counts)

    @staticmethod
    def reset_progress():
        """Forget the global learning counter after training, so another run can configure anew."""
        progress.reset()

    # ------------------------------------------------------------ the final model
    @staticmethod
    def training_state(state=None):
        """``state``, else the current DistributedOptimizer's heterogeneity state; None when
        only a synchronous reducer (a gradient tape) trains; a UsageError when nothing
        synchronises the ranks at all (their models would differ)."""
        if state is not None:
            return state
        state = driver.current()
        if state is None and not any_built():
            raise UsageError("no eddis.DistributedOptimizer (or DistributedGradientTape) was created, "
                             "so nothing trained across the ranks: wrap the optimizer with "
                             "eddis.DistributedOptimizer(...) before training")
        return state

    def final_model(self, state=None):
        """Collective: load the job's final model into the parameters on every rank
        (easgd/hybrid: the centre variable; sync: nothing to do)."""
        state = self.training_state(state)
        if state is not None:
            state.final_model()

    def save_on_rank0(self, path, write, what):
        """Collective: rank 0 calls ``write(temporary path)``, then renames it to ``path``, so a
        crash mid-write never leaves a file that looks complete; every rank learns how it went.
        The temporary name keeps ``path``'s extension (Keras picks the format by it)."""
        self.require(f"eddis.{what}()")
        path = os.fspath(path)
        members = elastic.current()
        if members is not None:
            return self._save_on_first_live_rank(members, path, write, what)
        engine.announce(what, 0)   # refused on every caller, before rank 0 writes, beside a joined rank
        error = None
        if runtime.rank() == 0:
            base, ext = os.path.splitext(path)
            tmp = f"{base}.tmp-{os.getpid()}{ext}"
            try:
                write(tmp)
                os.replace(tmp, path)
            except Exception as exc:  # the other ranks must hear about it too
                error = f"{type(exc).__name__}: {exc}"
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        error = collectives.broadcast_object(error, root=0, what=what)
        if error is not None:
            raise CheckpointError(f"{what}({path!r}) failed on rank 0: {error}")
        return path

    # ------------------------------------------------------------ checkpoints of a run
    def save_training(self, directory, state, participant, extra, epoch=None, batch=None):
        """Collective: a checkpoint of the whole run (every rank's part, the SMB state) into
        the folder of checkpoints ``directory`` (None: EDDIS_CHECKPOINT_DIR); returns the new
        checkpoint's path. The adapter's ``participant`` writes and reads the framework's
        tensors (:mod:`eddis.core.checkpoint`)."""
        self.require("eddis.checkpoint()")
        if directory is None:
            directory = settings.get("EDDIS_CHECKPOINT_DIR")
        if directory is None:
            raise ConfigError("eddis.checkpoint() needs a folder: pass one, or set EDDIS_CHECKPOINT_DIR")
        return save.save(directory, state, participant, extra=extra, epoch=epoch, batch=batch)

    def resume_training(self, path_or_dir, state, participant):
        """Collective: restore the checkpoint ``path_or_dir`` names (a checkpoint, or the newest
        complete one in a folder of them); a :class:`~eddis.core.checkpoint.resume.Start`, all
        zeros when there is nothing to resume."""
        self.require("eddis.resume()")
        if path_or_dir is None:
            path_or_dir = settings.get("EDDIS_CHECKPOINT_DIR")
            if path_or_dir is None:
                raise ConfigError("eddis.resume() needs a folder: pass one, or set EDDIS_CHECKPOINT_DIR")
        return resume.resume(path_or_dir, state, participant)

    @staticmethod
    def end_of_step(state):
        """The end of one optimizer step, the same in both adapters and in a joined rank's idle
        step (eddis.join()): the modes' work after the update (``state.after_step()``: an
        elastic exchange when due, rebalancing; the step count moves on), the parameter check
        of the synchronous modes, then the step boundary, where a periodic or requested
        checkpoint is written when the ranks agreed on one (after a requested one every rank
        raises CheckpointStop)."""
        state.after_step()
        agreement.tick()
        schedule.at_step_boundary(state)

    request_checkpoint = staticmethod(folders.request)
    note_epoch = staticmethod(checkpoint_state.note_epoch)
    batches_done = staticmethod(checkpoint_state.batches_done)

    @staticmethod
    def _save_on_first_live_rank(members, path, write, what):
        """Elastic runs: rank 0 may be lost, so the lowest rank at the barrier writes; an MPI
        broadcast of the outcome would never end, so only the writer hears of a failure
        (its exit then fails the job)."""
        members.barrier(f"{what}: who writes")
        if runtime.rank() == members.arrived()[0]:
            _write_atomically(path, write, what, runtime.rank())
        members.barrier(f"{what}: written")
        return path


    # What every adapter exports as module functions, the same objects in each.
    SHARED = ("init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "group",
              "num_groups", "hostname", "cross_rank", "cross_size", "mpi_threads_supported",
              "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "cuda_built",
              "rocm_built", "ddl_built", "ccl_built", "split_sizes", "batch_slice", "join",
              "request_checkpoint")

    def bindings(self, framework_built_with_cuda):
        """The adapter's module functions for :attr:`SHARED` (``globals().update(...)``);
        ``cuda_built`` asks the adapter's framework."""
        names = {name: getattr(self, name) for name in self.SHARED}
        names["cuda_built"] = functools.partial(self.cuda_built, framework_built_with_cuda)
        return names



def _write_atomically(path, write, what, rank):
    base, ext = os.path.splitext(path)
    tmp = f"{base}.tmp-{os.getpid()}{ext}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except Exception as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise CheckpointError(f"{what}({path!r}) failed on rank {rank}: {type(exc).__name__}: {exc}") from exc


basics = EddisBasics()
