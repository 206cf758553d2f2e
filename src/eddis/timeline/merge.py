"""``eddis prof merge <dir>``: every rank's and server's trace on one aligned clock.

Each input process becomes one process of the output (ranks as pid = rank,
servers as pid = 100000 + index), its timestamps moved onto rank 0's monotonic
clock and then shifted so the earliest event is at 0. How each process was
aligned, and how sure that is, goes into the process labels (visible in the
viewer) and into ``otherData.eddis_clock``:

- same clock domain as rank 0 (same running kernel): offset 0, uncertainty 0;
- another domain with a measured offset (``sync_clock_mpi``): the measurement of
  that domain with the smallest round trip, uncertainty RTT/2;
- otherwise the wall clocks (NTP), uncertainty unknown.
"""
import json
import warnings
from pathlib import Path

from ..errors import TimelineNotFoundError
from .trace import TimelineWarning

SERVER_PID_BASE = 100000


def load_events(path):
    """The events of one trace file; accepts a file cut short by a crash or a kill."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
        return data["traceEvents"] if isinstance(data, dict) else data
    except json.JSONDecodeError:
        pass
    events = []
    # The writer puts one event per line; only a line cut by the crash may be incomplete.
    for line in text.splitlines():
        line = line.strip().rstrip(",")
        if not line.startswith("{"):
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def _read_clocks(directory):
    clocks = []
    for path in sorted(Path(directory).glob("*.clock.json")):
        try:
            clock = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            warnings.warn(f"skipping {path}: {exc}", TimelineWarning, stacklevel=3)
            continue
        trace = path.with_name(clock.get("trace", ""))
        if not trace.is_file():
            warnings.warn(f"skipping {path}: its trace {trace.name} is missing", TimelineWarning, stacklevel=3)
            continue
        clock["_trace_path"] = trace
        clocks.append(clock)
    return clocks


def _alignment(clocks):
    """Per clock record: (offset_ns to the reference clock, uncertainty_ns or None, how)."""
    ref = next((c for c in clocks if c["role"] == "rank" and c["index"] == 0), None)
    if ref is None:  # no rank 0: the earliest process is the reference, by wall clock
        ref = min(clocks, key=lambda c: c["wall_anchor_ns"])
    ref_domain = ref["clock_domain"]
    measured = {}
    for c in clocks:
        if c.get("offset_to_rank0_ns") is None or c["clock_domain"] == ref_domain:
            continue
        prev = measured.get(c["clock_domain"])
        if prev is None or c["uncertainty_ns"] < prev["uncertainty_ns"]:
            measured[c["clock_domain"]] = c
    ref_wall_minus_perf = ref["wall_anchor_ns"] - ref["perf_anchor_ns"]
    result = []
    for c in clocks:
        if c["clock_domain"] == ref_domain:
            result.append((0, 0, "same host clock as the reference"))
        elif c["clock_domain"] in measured:
            m = measured[c["clock_domain"]]
            how = m.get("offset_method") or "measured"
            if m is not c:
                how += f" (via {m['role']} {m['index']} on the same host)"
            result.append((m["offset_to_rank0_ns"], m["uncertainty_ns"], how))
        else:
            offset = (c["wall_anchor_ns"] - c["perf_anchor_ns"]) - ref_wall_minus_perf
            result.append((offset, None, "wall clock (NTP), uncertainty unknown"))
    return ref, result


def merge_timeline(directory, output=None):
    """Merge the traces in ``directory`` into one file; returns (path, summary dict)."""
    directory = Path(directory)
    clocks = _read_clocks(directory)
    if not clocks:
        raise TimelineNotFoundError(
            f"no timeline in {directory}: expected <role>-<index>.clock.json and .trace.json files "
            f"written by a run with EDDIS_TIMELINE={directory}")
    ref, alignment = _alignment(clocks)
    merged, processes = [], {}
    for clock, (offset_ns, uncertainty_ns, how) in zip(clocks, alignment):
        role, index = clock["role"], int(clock["index"])
        pid = index if role == "rank" else SERVER_PID_BASE + index
        events = load_events(clock["_trace_path"])
        shift_us = offset_ns / 1000.0
        for ev in events:
            ev["pid"] = pid
            if ev.get("ph") == "M":
                if ev.get("name") in ("process_name", "process_sort_index", "process_labels"):
                    continue  # rewritten once per output process below
            elif "ts" in ev:
                ev["ts"] = ev["ts"] + shift_us
            merged.append(ev)
        info = processes.setdefault(pid, {
            "role": role, "index": index, "label": clock.get("label", f"{role} {index}"),
            "host": clock.get("host"), "node": clock.get("node"), "clock_domain": clock["clock_domain"],
            "offset_to_rank0_us": offset_ns / 1000.0,
            "uncertainty_us": None if uncertainty_ns is None else uncertainty_ns / 1000.0,
            "alignment": how, "files": [], "events": 0})
        info["files"].append(clock["_trace_path"].name)
        info["events"] += sum(1 for ev in events if ev.get("ph") != "M")
    timed = [ev for ev in merged if "ts" in ev and ev.get("ph") != "M"]
    zero = min((ev["ts"] for ev in timed), default=0.0)
    for ev in timed:
        ev["ts"] = round(ev["ts"] - zero, 3)
    meta = []
    for pid, info in sorted(processes.items()):
        unc = info["uncertainty_us"]
        unc_text = "unknown" if unc is None else f"{unc:.1f} us"
        meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": info["label"]}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        meta.append({"name": "process_labels", "ph": "M", "pid": pid, "tid": 0, "args": {
            "labels": f"clock {info['offset_to_rank0_us']:+.1f} us, uncertainty {unc_text} ({info['alignment']})"}})
    timed.sort(key=lambda ev: ev["ts"])
    other = [ev for ev in merged if "ts" not in ev or ev.get("ph") == "M"]
    uncertainties = [p["uncertainty_us"] for p in processes.values()]
    summary = {
        "processes": len(processes),
        "ranks": sorted(p["index"] for p in processes.values() if p["role"] == "rank"),
        "servers": sorted(p["index"] for p in processes.values() if p["role"] != "rank"),
        "events": len(timed),
        "max_uncertainty_us": None if any(u is None for u in uncertainties) else max(uncertainties, default=0.0),
        "time_zero": {"reference": f"{ref['role']} {ref['index']}",
                      "perf_counter_us": zero, "note": "ts 0 = earliest event, on the reference's monotonic clock"},
    }
    out = {
        "traceEvents": meta + other + timed,
        "displayTimeUnit": "ms",
        "otherData": {"eddis_clock": {str(pid): info for pid, info in sorted(processes.items())},
                      "eddis_summary": summary},
    }
    output = Path(output) if output else directory / "timeline.json"
    tmp = output.with_name(output.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f, separators=(",", ":"))
    tmp.replace(output)
    return output, summary
