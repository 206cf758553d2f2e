"""Mode ``allreduce``: every bucket reduced by an MPI allreduce, the baseline to compare SMB
against."""
import numpy as np

from ..comm import adasum, runtime
from ..comm.waits import start, wait_request
from ..layout.compression import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from .base import Reducer, check_total

INT_MAX = 2 ** 31 - 1   # MPI-3 counts are int


class AllreduceReducer(Reducer):
    """An MPI allreduce of each bucket (the baseline to compare SMB against).

    With THREAD_MULTIPLE, fp32 and fp64 buckets are posted as non-blocking Iallreduce
    from the submit thread as soon as each is ready, and the finish thread waits for
    them in order, so several buckets are on the wire at once, as one Waitall on all
    of them would have them (one blocking Allreduce after the other left the link idle
    between them: docs/benchmarks-cluster.md); buckets of more than INT_MAX elements
    go through ``eddis._mpi.allreduce_sum_inplace`` (GIL released), in pieces. Without
    THREAD_MULTIPLE each bucket is a polled non-blocking in-place Iallreduce under the
    MPI lock (fp64 summed in float64 by MPI_DOUBLE). fp16/bf16
    buckets travel compressed and are summed by a user-defined MPI operation
    (fp16 accumulation for fp16, fp32 per pairwise sum for bf16). ``op="adasum"``
    swaps whole buckets with recursive doubling instead (``eddis.core.comm.adasum``).
    """

    mode = "allreduce"

    def __init__(self, plan, compression="none", op="average", timeout=None, name="grads"):
        super().__init__(plan, compression, op, timeout, name)
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = runtime.comm().Dup()
        self._scale = 1.0
        self._wire = None if self.codec.is_identity else self.codec.empty(plan.total)
        self._native = None
        self._received = None   # the non-blocking allreduces' results, as big as the plan's buffer
        if runtime.thread_multiple():
            try:
                from ... import _mpi
                self._native = _mpi.allreduce_sum_inplace
            except ImportError:
                self._native = None
        self._mpi_op = None
        self._adasum = None
        if self.op == "adasum":
            self._adasum = adasum.PairwiseExchange(self.comm, self.codec, self.timeout,
                                                   f"{self.mode} reduction", plan.total)
        elif not self.codec.is_identity:
            self._mpi_op = MPI.Op.Create(_half_sum if self.codec.name == "fp16" else _bf16_sum, commute=True)
        self._start_threads()

    def _allreduce(self, buf, mpi_type, op):
        MPI = self.MPI
        if self._native is not None and op is MPI.SUM and buf.dtype == np.float32:
            self._native(self.comm, buf)
            return
        if runtime.thread_multiple():
            self.comm.Allreduce(MPI.IN_PLACE, [buf, mpi_type], op)
            return
        req = start(self.comm.Iallreduce, MPI.IN_PLACE, [buf, mpi_type], op)
        wait_request(req, self.timeout, f"{self.mode} reduction")

    def _prepare_step(self):
        # the step's total weight, and how many ranks still have data (0: every rank has
        # joined, eddis.join()'s last step); with op=sum only the latter is needed
        totals = np.array([self._step_weight, 0.0 if self.joined else 1.0], dtype=np.float64)
        self._allreduce(totals, self.MPI.DOUBLE, self.MPI.SUM)
        self.active_ranks = int(totals[1])
        self.total_weight = float(totals[0])
        if self.op != "average":
            self._scale = 1.0
            return
        check_total(float(totals[0]), self.step, f"the {self.size} ranks")
        self._scale = self._step_weight / float(totals[0])

    def _submit(self, k):
        view = self.plan.bucket_view(k)
        if self._adasum is not None:
            bucket = self.plan.buckets[k]
            segments = [(start - bucket.start, count) for start, count in adasum.bucket_segments(self.plan, k)]
            self._adasum.reduce(view, segments, tag=k % 32768, offset=bucket.start)
            return None
        if self._scale != 1.0:
            view *= view.dtype.type(self._scale)
        if self.codec.is_identity:
            mpi_type = self.MPI.DOUBLE if view.dtype == np.float64 else self.MPI.FLOAT
            if runtime.thread_multiple() and view.size <= INT_MAX:
                # out of place: Open MPI's non-blocking allreduce in place takes a tree that
                # sends more across the links (tests/test_cluster_sync.py counts them)
                if self._received is None:
                    self._received = np.empty_like(self.plan.buffer)
                received = self.plan.bucket_view(k, self._received)
                request = self.comm.Iallreduce([view, mpi_type], [received, mpi_type], self.MPI.SUM)
                return request, view, received
            self._allreduce(view, mpi_type, self.MPI.SUM)
            return None
        wire = self.codec.compress(view, out=self.plan.bucket_view(k, self._wire))
        self._allreduce(wire, self.MPI.UINT16_T, self._mpi_op)
        self.codec.decompress(wire, view)
        return None

    def _finish(self, k, token):
        if token is not None:
            request, view, received = token
            # blocking, with the GIL released: the wait drives MPI's progress (a polled
            # Test with sleeps would leave the link idle between polls); a rank that never
            # joins is the training thread's timeout to report, as for a blocking Allreduce
            request.Wait()
            view[...] = received

    def _release(self):
        try:
            if self._mpi_op is not None:
                self._mpi_op.Free()
            self.comm.Free()
        except Exception:
            pass


def _half_sum(inbuf, inoutbuf, datatype):
    a = np.frombuffer(inbuf, dtype=np.float16)
    b = np.frombuffer(inoutbuf, dtype=np.float16)
    b += a


def _bf16_sum(inbuf, inoutbuf, datatype):
    a = bfloat16_bits_to_float32(np.frombuffer(inbuf, dtype=np.uint16))
    out = np.frombuffer(inoutbuf, dtype=np.uint16)
    b = bfloat16_bits_to_float32(out)
    b += a
    float32_to_bfloat16_bits(b, out)
