"""Mode ``sync``: gradients averaged by the SMB servers (the default mode).

Two pools of the plan's length, partitioned over all servers and in the wire
dtype (float32, float16 or bfloat16):

- ``<name>.slots``: one slot (row) per rank, where each rank writes its
  compressed local gradients;
- ``<name>.result``: one slot with the reduced gradients.

Per bucket, on the reducer's threads: write this rank's slot range, then
``reduce_nb(weight=sample count, parties=W, generation=step)``: each server,
once all W contributions to its column range are in, writes the
sample-weighted average (fp32 accumulation) into the result pool and completes
every contributor's request; the finish thread then reads the result range and
decompresses it into the plan's buffer. One round trip per bucket and server;
bucket k+1 is written while bucket k is reduced.
"""
import logging

from .. import timeline
from ..errors import SMBMemoryError, SMBTimeoutError
from ..smb import _core  # noqa: F401  (without the built SMB extension there is no mode sync)
from . import runtime
from .reducer import Reducer, register_mode

log = logging.getLogger("eddis.core.sync")


class SyncReducer(Reducer):
    mode = "sync"

    def __init__(self, plan, compression="none", op="average", timeout=None, name="grads"):
        super().__init__(plan, compression, op, timeout, name)
        self.client = runtime.smb_client()
        dtype = self.codec.smb_dtype
        self.pool_name = f"eddis.{name}"
        try:
            self.slots_pool = self.client.pool(self.pool_name + ".slots", plan.total, dtype=dtype, slots=self.size)
            self.result_pool = self.client.pool(self.pool_name + ".result", plan.total, dtype=dtype, slots=1)
        except SMBMemoryError as exc:
            need = (self.size + 1) * plan.total * self.codec.itemsize
            raise SMBMemoryError(
                f"{exc.message}. Mode sync needs {need / 2**20:.0f} MiB of SMB memory for this model "
                f"({self.size} gradient slots + 1 result, {self.codec.name} on the wire) spread over "
                f"{self.client.num_servers} server(s): raise SMB_MEMORY / --memory, or use compression "
                "fp16/bf16 to halve it.", exc.code) from exc
        self._wire = None if self.codec.is_identity else self.codec.empty(plan.total)
        self._start_threads()

    def _submit(self, k):
        bucket = self.plan.buckets[k]
        view = self.plan.bucket_view(k)
        if self.codec.is_identity:
            wire = view
        else:
            with timeline.span(timeline.COMPRESS, args={"step": self.step, "bucket": k, "bytes": view.nbytes}):
                wire = self.codec.compress(view, out=self.plan.bucket_view(k, self._wire))
        self.slots_pool.write(wire, slot=self.rank, start=bucket.start, timeout=self.timeout)
        average = self.op == "average"
        return self.result_pool.reduce_nb(
            self.rank, self._step_weight if average else 1.0, self.size, 0, self.step,
            src_pool=self.slots_pool, start=bucket.start, count=bucket.count, average=average)

    def _finish(self, k, request):
        try:
            request.wait(self.timeout)
        except SMBTimeoutError as exc:
            raise SMBTimeoutError(
                f"step {self.step}, bucket {k}: not every rank contributed within {self.timeout:g} s "
                "(another rank failed or is far slower; raise EDDIS_COMM_TIMEOUT if it is slow)",
                exc.code) from exc
        view = self.plan.bucket_view(k)
        bucket = self.plan.buckets[k]
        if self.codec.is_identity:
            self.result_pool.read(out=view, slot=0, start=bucket.start, timeout=self.timeout)
        else:
            wire = self.plan.bucket_view(k, self._wire)
            self.result_pool.read(out=wire, slot=0, start=bucket.start, timeout=self.timeout)
            with timeline.span(timeline.DECOMPRESS, args={"step": self.step, "bucket": k, "bytes": wire.nbytes}):
                self.codec.decompress(wire, view)

    def _release(self):
        # Free the pools once every rank is done with them (an SMB barrier, so a
        # missing rank costs a bounded wait and never poisons MPI).
        try:
            self.client.barrier(self.pool_name + ".close", self.size).wait(timeout=min(self.timeout, 60.0))
            if self.rank == 0:
                self.slots_pool.free()
                self.result_pool.free()
        except Exception as exc:  # the server frees everything when it stops anyway
            log.warning("could not free the sync pools %s: %s", self.pool_name, exc)


register_mode("sync", SyncReducer)
