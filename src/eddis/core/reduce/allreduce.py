"""Mode ``allreduce``: every bucket reduced by an MPI allreduce, the baseline to compare SMB
against."""
import numpy as np

from ..comm import adasum, runtime
from ..comm.waits import start, wait_request
from ..layout.compression import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from .base import Reducer, check_total


class AllreduceReducer(Reducer):
    """MPI in-place Allreduce of each bucket (the baseline to compare SMB against).

    fp32 buckets use ``eddis._mpi.allreduce_sum_inplace`` (GIL released) when MPI
    has THREAD_MULTIPLE, else a polled non-blocking Iallreduce (as fp64 buckets
    of a float64 plan do, summed in float64 by MPI_DOUBLE); fp16/bf16
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
            self._allreduce(view, mpi_type, self.MPI.SUM)
            return None
        wire = self.codec.compress(view, out=self.plan.bucket_view(k, self._wire))
        self._allreduce(wire, self.MPI.UINT16_T, self._mpi_op)
        self.codec.decompress(wire, view)
        return None

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
