"""Where a synchronous step's time goes, stage by stage, from a run's timeline.

    python bench/sync_stages.py RUN_TIMELINE_DIR [--skip 3] [--rank 0]

Reads the traces a run wrote with ``EDDIS_TIMELINE=DIR`` (merged onto one clock as ``eddis
prof merge`` does) and prints, per rank, the median over the steps (after ``--skip``) of
when each bucket passed each stage, in ms from the step's start (the end of the previous
step's last optimizer update):

- ``ready``: its gradients are all computed (backward hooks);
- ``sum``: the node's weighted sum of its pieces (hierarchical sync), first start to last end;
- ``put``: the waits for the pieces' writes to other servers;
- ``submitted``: the submit thread is done with it (the pieces sum, put and the servers'
  reduce posted);
- ``pull``: the reads of its result, first start to last end;
- ``done``: the finish thread handed it to the training thread;
- ``update``: the optimizer's update of its parameters (bucket by bucket);

and the step's totals: its length, the training thread's waits, the updates, and the time
from the last bucket ready to the last done (the tail that nothing computes under). It
asserts nothing; it is the measure issue 41 asks for before and after changing a reducer.
"""
import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def load(directory):
    from eddis.timeline.merge import load_events, merge_timeline

    with tempfile.TemporaryDirectory(prefix="eddis-stages-") as tmp:
        path, _ = merge_timeline(directory, Path(tmp) / "merged.json")
        return load_events(path)


def steps_of(events, rank):
    """{step: {stage: {bucket: (start_us, end_us)}}} and the steps' start times, for one rank."""
    mine = [e for e in events if e.get("pid") == rank and e.get("ph") in ("X", "i", "I")]
    mine.sort(key=lambda e: e["ts"])
    updates = [(e["ts"], e["ts"] + e.get("dur", 0), e.get("args", {}).get("bucket"))
               for e in mine if e["name"] == "optimizer_step"]
    stages = defaultdict(lambda: defaultdict(dict))

    def note(step, stage, bucket, start, end):
        spans = stages[step][stage]
        old = spans.get(bucket)
        spans[bucket] = (start, end) if old is None else (min(old[0], start), max(old[1], end))

    for e in mine:
        args = e.get("args", {})
        step, bucket = args.get("step"), args.get("bucket")
        if step is None:
            continue
        start, end = e["ts"], e["ts"] + e.get("dur", 0)
        name = e["name"]
        if name == "bucket_ready":
            note(step, "ready", bucket, start, start)
        elif name == "reduce" and args.get("by") == "node":
            note(step, "sum", bucket, start, end)
        elif name == "push" and "requests" in args:
            note(step, "put", bucket, start, end)
        elif name == "push":
            note(step, "submitted", bucket, end, end)
        elif name == "pull" and "count" in args:
            note(step, "pull", bucket, start, end)
        elif name == "pull":
            note(step, "done", bucket, end, end)
        elif name == "wait":
            note(step, "wait", bucket, start, end)
    starts, updates_of = {}, {}
    for step, stage in stages.items():
        if not stage.get("ready"):
            continue
        first_ready = min(s for s, _ in stage["ready"].values())
        before = [u for u in updates if u[1] <= first_ready]
        if before:
            starts[step] = before[-1][1]
        last_done = max((e for _, e in stage.get("done", {}).values()), default=first_ready)
        updates_of[step] = [u for u in updates if u[0] >= first_ready and u[1] <= last_done + 1e6]
    return stages, starts, updates_of


def summarize(stages, starts, updates_of, skip):
    """The median over steps of every stage's (start, end) per bucket, in ms from the step's
    start, and the step totals."""
    chosen = sorted(s for s in starts)[skip:]
    chosen = [s for s in chosen if s + 1 in starts]   # a next step gives this one's length
    table = defaultdict(lambda: defaultdict(list))
    totals = defaultdict(list)
    for s in chosen:
        t0, stage = starts[s], stages[s]
        for name, spans in stage.items():
            for bucket, (a, b) in spans.items():
                if name == "wait":
                    continue
                table[name][bucket].append(((a - t0) / 1e3, (b - t0) / 1e3))
        per_update = {}
        for a, b, bucket in updates_of[s]:
            if a < starts[s + 1]:
                per_update.setdefault(bucket, []).append((a, b))
        for bucket, spans in per_update.items():
            table["update"][bucket].append(((spans[0][0] - t0) / 1e3, (spans[-1][1] - t0) / 1e3))
        totals["step ms"].append((starts[s + 1] - t0) / 1e3)
        totals["wait ms"].append(sum(b - a for a, b in stage.get("wait", {}).values()) / 1e3)
        totals["update ms"].append(sum(b - a for a, b, _ in updates_of[s] if a < starts[s + 1]) / 1e3)
        ready = stage["ready"]
        done = stage.get("done", {})
        if done:
            totals["last ready -> last done ms"].append(
                (max(e for _, e in done.values()) - max(a for a, _ in ready.values())) / 1e3)
        totals["start -> first ready ms"].append((min(a for a, _ in ready.values()) - t0) / 1e3)
    med = {name: {bucket: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v))
                  for bucket, v in buckets.items()} for name, buckets in table.items()}
    return len(chosen), med, {k: statistics.median(v) for k, v in totals.items() if v}


ORDER = ["ready", "sum", "put", "submitted", "pull", "done", "update"]


def print_rank(rank, count, med, totals):
    print(f"\nrank {rank}: median of {count} steps, ms from the step's start")
    buckets = sorted({b for spans in med.values() for b in spans if b is not None})
    print(f"{'stage':12s}" + "".join(f"{'bucket ' + str(b):>18s}" for b in buckets))
    for name in ORDER:
        if name not in med:
            continue
        cells = []
        for b in buckets:
            span = med[name].get(b)
            cells.append("-" if span is None else (f"{span[0]:.0f}" if span[0] == span[1]
                                                   else f"{span[0]:.0f}-{span[1]:.0f}"))
        print(f"{name:12s}" + "".join(f"{c:>18s}" for c in cells))
    for k, v in totals.items():
        print(f"  {k}: {v:.1f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", help="the run's EDDIS_TIMELINE directory")
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out")
    p.add_argument("--rank", type=int, action="append", help="only these ranks (default: all)")
    args = p.parse_args(argv)
    events = load(args.directory)
    ranks = sorted({e["pid"] for e in events if isinstance(e.get("pid"), int) and e["pid"] < 100000})
    for rank in args.rank or ranks:
        stages, starts, updates_of = steps_of(events, rank)
        count, med, totals = summarize(stages, starts, updates_of, args.skip)
        if count:
            print_rank(rank, count, med, totals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
