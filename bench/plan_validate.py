#!/usr/bin/env python
"""bench/cluster.py's measurements beside the planner's model (issue 42's validation).

    .venv/bin/python bench/plan_validate.py RUNS.json [MORE.json ...] [--ready 0.86,0.93,1.0] [--markdown]

RUNS.json: what ``bench/cluster.py --json`` wrote; every configuration must have run the
``solo`` contender too, since the model's inputs come from the same run
(:func:`eddis.plan.emulated.validate`): each rank's CPU seconds a sample from solo, SMB's
put/get at the link rate the run measured, and the buckets of the model the bench built,
cut as EDDIS cuts them. ``--ready``: when each bucket is complete, as shares of the
forward and backward pass (default for the comm MLP: 0.86, 0.93, 1.0, from a 2 x 2
timeline of 2026-12-05; else the buckets spread over the backward pass, which is taken
as the last two thirds of the step).

It prints, per configuration and contender, the predicted and measured samples/s and
bytes a step, and how many rows and configurations fall within issue 42's bounds
(samples/s within 15 %, bytes within 5 %), and per configuration the contender the
model finds fastest beside the one that measured fastest.
"""
import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

SAMPLES_BOUND, BYTES_BOUND = 0.15, 0.05
COMM_MLP_READY = (0.86, 0.93, 1.0)


def bucket_plan_of(model_name):
    """The bench model's gradient buckets as EDDIS cuts them (definition order, as the
    planner's recorded tests do)."""
    from cluster import bucket_plan, build_model

    return bucket_plan(build_model(model_name))


def spread_ready(nbytes):
    """Each bucket complete at 1/3 + 2/3 of the bytes before and in it: backward is the last
    two thirds of the step and frees the gradients at an even rate."""
    total, done, ready = sum(nbytes), 0, []
    for n in nbytes:
        done += n
        ready.append(1 / 3 + 2 / 3 * done / total)
    return ready


def workload_maker(ready_option):
    from eddis.plan.spec import Bucket, Workload

    cache = {}

    def workload_of(config):
        name = config["model"]
        if name not in cache:
            plan = bucket_plan_of(name)
            sizes = [b.nbytes for b in plan.buckets]
            ready = ready_option or (COMM_MLP_READY if name == "comm" else spread_ready(sizes))
            if len(ready) != len(sizes):
                sys.exit(f"plan_validate: --ready gives {len(ready)} shares, model {name} has "
                         f"{len(sizes)} buckets")
            cache[name] = tuple(Bucket(n, r) for n, r in zip(sizes, ready))
        return Workload(buckets=cache[name], local_batch=int(config.get("local_batch", 8)), name=name)
    return workload_of


def describe(config):
    return (f"{config['link']} {config['nodes']}x{config['ranks_per_node']} "
            f"{config.get('slowdowns', '1')} {config['model']}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="bench/cluster.py --json files")
    p.add_argument("--ready", help="each bucket's completion share, comma-separated (see above)")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    from eddis.plan.emulated import validate

    records = [r for path in args.runs for r in json.loads(Path(path).read_text())]
    ready = [float(x) for x in args.ready.split(",")] if args.ready else None
    rows, unsolved = validate(records, workload_maker(ready))
    for config in unsolved:
        print(f"no solo record for {describe(config)}: its contenders are left out (run solo too)")
    sep = " | " if args.markdown else "  "
    header = ["configuration", "contender", "samples/s measured", "predicted", "x", "bytes/S measured",
              "predicted", "x"]
    if args.markdown:
        print("| " + sep.join(header) + " |")
        print("|" + "---|" * len(header))
    else:
        print(sep.join(f"{h:>18}" for h in header))
    inside, by_config = 0, {}
    for row in rows:
        s, b = row["samples_per_s"], row["bytes_per_step_over_S"]
        xs, xb = s["predicted"] / s["measured"], b["predicted"] / b["measured"] if b["measured"] else float("nan")
        ok = abs(xs - 1) <= SAMPLES_BOUND and abs(xb - 1) <= BYTES_BOUND
        inside += ok
        name = describe(row["config"])
        entry = by_config.setdefault(name, {"ok": True, "measured": {}, "predicted": {}})
        entry["ok"] &= ok
        entry["measured"][row["contender"]] = s["measured"]
        entry["predicted"][row["contender"]] = s["predicted"]
        cells = [name, row["contender"], f"{s['measured']:.1f}", f"{s['predicted']:.1f}", f"{xs:.2f}",
                 f"{b['measured']:.3f}", f"{b['predicted']:.3f}", f"{xb:.3f}"]
        print(("| " + sep.join(cells) + " |") if args.markdown else sep.join(f"{c:>18}" for c in cells))
    print(f"\nwithin bounds (samples/s {SAMPLES_BOUND:.0%}, bytes {BYTES_BOUND:.0%}): {inside} of {len(rows)} rows, "
          f"{sum(e['ok'] for e in by_config.values())} of {len(by_config)} configurations")
    for name, entry in by_config.items():
        fastest = max(entry["measured"], key=entry["measured"].get)
        picked = max(entry["predicted"], key=entry["predicted"].get)
        ratio = entry["measured"][picked] / entry["measured"][fastest]
        print(f"{name}: measured fastest {fastest}; the model's pick {picked} "
              f"({ratio:.2f} of the fastest measured)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
