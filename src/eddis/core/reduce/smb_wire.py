"""A bucket between the plan's fp32 buffer and the SMB pools, which hold the wire dtype:
the one path both sync reducers (``sync``, ``adasum_sync``) write and read through."""
from ... import timeline


def bucket_on_the_wire(reducer, k, wire):
    """Bucket k of ``reducer.plan`` as it goes into the pools: the plan's own view, or
    compressed into ``wire`` (the codec's buffer over the whole plan)."""
    view = reducer.plan.bucket_view(k)
    if reducer.codec.is_identity:
        return view
    with timeline.span(timeline.COMPRESS, args={"step": reducer.step, "bucket": k, "bytes": view.nbytes}):
        return reducer.codec.compress(view, out=reducer.plan.bucket_view(k, wire))


def read_result(reducer, k, wire):
    """Bucket k of the result (slot 0 of ``reducer.result_pool``) into the plan's buffer,
    through ``wire`` and the codec when the pools hold half precision."""
    view = reducer.plan.bucket_view(k)
    start = reducer.plan.buckets[k].start
    if reducer.codec.is_identity:
        reducer.result_pool.read(out=view, slot=0, start=start, timeout=reducer.timeout)
        return
    staged = reducer.plan.bucket_view(k, wire)
    reducer.result_pool.read(out=staged, slot=0, start=start, timeout=reducer.timeout)
    with timeline.span(timeline.DECOMPRESS, args={"step": reducer.step, "bucket": k, "bytes": staged.nbytes}):
        reducer.codec.decompress(staged, view)
