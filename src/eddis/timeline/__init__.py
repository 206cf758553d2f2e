"""Observability: Chrome-trace timeline, per-step HDF5 profile, ``eddis prof`` report.

Timeline (cheap to call when off: one global lookup)::

    from eddis import timeline
    timeline.start_timeline("/tmp/tl", comm=MPI.COMM_WORLD)   # or EDDIS_TIMELINE=/tmp/tl
    with timeline.span(timeline.PUSH, args={"bucket": 3, "bytes": n, "step": s}):
        ...
    t0 = timeline.now_ns(); ...; timeline.complete(timeline.PULL, t0, args={...})
    timeline.instant(timeline.BUCKET_READY, args={"bucket": 3, "step": s})
    timeline.stop_timeline()

then ``eddis prof merge /tmp/tl`` -> ``/tmp/tl/timeline.json`` (Perfetto, chrome://tracing).

Profile: :class:`eddis.timeline.profile.StepProfiler` (h5py), report:
``eddis prof report <run dir or profile.h5>``. Those import h5py/matplotlib and
are therefore not imported here.
"""
from .events import *  # noqa: F401,F403  (the shared event names)
from .events import ALL_EVENTS  # noqa: F401
from .trace import (  # noqa: F401
    NULL_SPAN, NULL_TIMELINE, Timeline, TimelineWarning, active, begin, complete, counter,
    enabled, end, for_server, instant, open_timeline, span, start_timeline, stop_timeline,
)
from .trace import perf_ns as now_ns  # noqa: F401
