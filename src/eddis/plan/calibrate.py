"""The planner's inputs from what a run measured: its profile and its timeline.

- The profile (``EDDIS_PROFILE``, ``profile.h5``; :mod:`eddis.timeline.profile`) gives each
  rank's node, GPU type and speed (samples over compute time in a typical step, as
  ``eddis prof report`` computes it), its samples per step (the local batch) and the bytes
  it pushed per step (the gradient, S on the wire).
- The timeline (``EDDIS_TIMELINE`` directory, the ranks' ``rank-*.trace.json``) gives the
  buckets: each one's bytes (its pushes), when it is ready in the step (``bucket_ready``,
  as a share of the time from the end of the last step to the last bucket ready), and the
  optimizer's share of the step (``optimizer_step`` spans).

Link and SMB rates are not in either: they come from the probes (:mod:`.probe`), a
cluster.json, or the command line.
"""
import statistics
from collections import defaultdict
from pathlib import Path

from ..errors import ConfigError
from .spec import Bucket, Rank, Workload

WIRE_EVENTS = ("push", "allreduce")


def ranks_from_profile(path, skip=None):
    """``([(node name, [Rank, ...]), ...], local batch, gradient bytes on the wire, mode)``."""
    import numpy as np

    from ..timeline.profile import load_profile
    from ..timeline.report import summarize

    if not Path(path).exists():
        raise ConfigError(f"--from-profile {path}: no such profile; record one with eddis-train --profile "
                          "(EDDIS_PROFILE=1): it is <run dir>/profile.h5")
    try:
        _, ranks = load_profile(path)
    except OSError as exc:   # h5py's word for a file that is not HDF5
        raise ConfigError(f"--from-profile {path}: not an EDDIS profile ({exc}); give the profile.h5 of a run "
                          "or its run directory") from None
    summary = summarize(ranks, skip)
    nodes = {}
    for row in summary["ranks"]:
        speed = row["typical_compute_samples_per_s"]
        if not speed > 0:
            raise ConfigError(f"{path}: rank {row['rank']} has no measured step (samples over compute time); "
                              "profile a run of a few steps more (the first is skipped as warm-up)")
        nodes.setdefault(row["node"], []).append(Rank(samples_per_s=speed, kind=row["gpu_type"]))
    first = ranks[min(ranks)]
    steady = slice(1 if len(first["step"]) > 3 else 0, None)
    local_batch = int(np.median(first["samples"][steady]))
    sent = float(np.median(first["bytes_sent"][steady]))
    modes = sorted({row["mode"] for row in summary["ranks"]})
    return list(nodes.items()), local_batch, sent, modes


def buckets_from_timeline(directory, skip=1):
    """``(buckets, update share, wire bytes per element)`` from the ranks' trace files: each
    bucket's bytes (the median of its pushes, as fp32: a run with compression halves them,
    seen from its ``compress`` events), its readiness (median over ranks and steps) and the
    optimizer's share of a step."""
    from ..timeline.merge import load_events

    files = sorted(Path(directory).glob("rank-*.trace.json"))
    if not files:
        raise ConfigError(f"{directory}: no rank-*.trace.json; give the EDDIS_TIMELINE directory of a run "
                          "(eddis-train --timeline DIR)")
    ready_shares = defaultdict(list)
    wire_bytes = defaultdict(list)
    update_shares = []
    compressed = False
    for path in files:
        events = load_events(path)
        compressed = compressed or any(e.get("name") == "compress" for e in events)
        for e in events:
            args = e.get("args") or {}
            if e.get("name") in WIRE_EVENTS and "bucket" in args and "bytes" in args:
                wire_bytes[int(args["bucket"])].append(int(args["bytes"]))
        for shares, update in _step_shares(events, skip):
            for b, share in shares.items():
                ready_shares[b].append(share)
            update_shares.append(update)
    if not wire_bytes or not ready_shares:
        raise ConfigError(f"{directory}: the traces hold no bucket pushes and readiness of two steps or more; "
                          "profile a run in a mode that reduces gradients (sync, allreduce, hybrid) for a few "
                          "steps")
    scale = 2 if compressed else 1
    buckets = tuple(Bucket(int(statistics.median(wire_bytes[b])) * scale,
                           min(1.0, max(1e-3, statistics.median(ready_shares.get(b, [1.0])))))
                    for b in sorted(wire_bytes))
    return buckets, statistics.median(update_shares) if update_shares else 0.0, 4 // scale


def _step_shares(events, skip):
    """Per step of one rank: ({bucket: readiness}, update share). A step runs from the end of
    the previous step's last wait (``wait`` without a bucket) to the end of its own; the
    forward and backward end at its last ``bucket_ready``."""
    ends, readies, updates = {}, defaultdict(dict), []
    for e in events:
        name, args = e.get("name"), e.get("args") or {}
        if name == "wait" and "bucket" not in args and "step" in args:
            ends[int(args["step"])] = e["ts"] + e.get("dur", 0)
        elif name == "bucket_ready" and "step" in args:
            readies[int(args["step"])][int(args["bucket"])] = e["ts"]
        elif name == "optimizer_step":
            updates.append((e["ts"], e.get("dur", 0)))
    # the ready events of step s carry s; its closing wait carries s as well
    for step in sorted(readies):
        if step < skip or step - 1 not in ends or step not in ends:
            continue
        start, end = ends[step - 1], ends[step]
        last = max(readies[step].values())
        if last <= start or end <= start:
            continue
        shares = {b: (t - start) / (last - start) for b, t in readies[step].items()}
        update = sum(d for t, d in updates if start < t <= end)
        yield shares, min(0.9, update / (end - start))


def workload_from_run(profile=None, timeline=None, name="model", skip=None):
    """A :class:`Workload` from a run's profile (batch, gradient bytes) and, better, its
    timeline (buckets, readiness, update share); either may be missing, not both."""
    if profile is None and timeline is None:
        raise ConfigError("calibration needs a run's profile (--from-profile) or its timeline (--timeline)")
    local_batch, sent = None, None
    if profile is not None:
        _, local_batch, sent, _ = ranks_from_profile(profile, skip)
    if timeline is not None:
        buckets, update, _ = buckets_from_timeline(timeline)
    else:
        if not sent > 0:
            raise ConfigError(f"{profile}: the ranks pushed no gradient bytes; profile a run in a mode that "
                              "reduces gradients (sync, allreduce, hybrid), or give --model")
        # one bucket, ready at the backward's end: the timeline says better
        buckets, update = (Bucket(int(sent), 1.0),), 0.0
    if local_batch is None:
        raise ConfigError("the local batch is in the profile only: give --from-profile too, or --model")
    return Workload(buckets=buckets, local_batch=local_batch, update_share=update, name=name)
