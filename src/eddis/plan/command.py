"""``eddis plan``: every mode's step time on a cluster, and the mode to run.

    eddis plan --cluster cluster.json --model model.json [--nodes 16] [--link 200gbit]
    eddis plan --from-profile run/profile.h5 [--timeline DIR] --nodes 16 --link 200gbit
    eddis plan ... --plot steps.png --json plan.json
    eddis-train --job -- eddis plan --calibrate --out DIR [--from-profile ...]   # in a job

docs/plan.md has the equations, the two files' schema and how to read the table.
"""
import json
from dataclasses import replace
from pathlib import Path

from .. import settings
from ..errors import ConfigError
from . import calibrate, spec
from .evaluate import DEFAULT_TAU, describe_split, evaluate, recommend
from .modes import LISTED, MODES, SOLO


def add_arguments(p):
    p.add_argument("--cluster", metavar="JSON", help="the cluster (cluster.json; docs/plan.md has the schema)")
    p.add_argument("--model", metavar="JSON", help="the model's buckets and batch (model.json)")
    p.add_argument("--from-profile", metavar="RUN", dest="profile",
                   help="a run's profile (profile.h5 or its run directory): the ranks' speeds and nodes, the "
                        "local batch and, without --model, the gradient's bytes")
    p.add_argument("--timeline", metavar="DIR", help="the run's timeline directory (EDDIS_TIMELINE): the "
                                                    "buckets, when each is ready, the optimizer's share")
    p.add_argument("--nodes", type=int, help="plan for this many nodes (the cluster's node pattern repeated)")
    p.add_argument("--link", metavar="RATE", help="every node's link rate, e.g. 200gbit, 10gbit, 100mbit")
    p.add_argument("--latency-us", type=float, help="every node's link latency in microseconds")
    p.add_argument("--local-batch", type=int, help="samples per rank and step (overrides the model's)")
    p.add_argument("--modes", help=f"comma-separated, from: {', '.join(MODES)} (default: {', '.join(LISTED)})")
    p.add_argument("--tau", type=int, default=None,
                   help=f"easgd/hybrid: steps between exchanges (default EDDIS_EASGD_TAU, {DEFAULT_TAU})")
    p.add_argument("--run-steps", type=int, default=None,
                   help="count the run's end (the final model's exchange and reads) over this many global "
                        "batches in the elastic modes' bytes, as bench/cluster.py measures them")
    p.add_argument("--json", metavar="OUT", help="also write every mode's figures and the recommendation here")
    p.add_argument("--plot", metavar="PNG", help="draw step time against nodes for each mode")
    p.add_argument("--plot-nodes", default="1,2,4,8,16,32,64", help="the node counts of --plot")
    p.add_argument("--write", metavar="DIR", help="write the cluster.json and model.json the plan used into DIR")
    cal = p.add_argument_group("calibration (every rank of a job runs it)")
    cal.add_argument("--calibrate", action="store_true",
                     help="probe the link, SMB put/get and the servers' reduce; write cluster.json (and "
                          "model.json with --from-profile/--timeline) into --out")
    cal.add_argument("--out", metavar="DIR", default=".", help="where --calibrate writes (default: .)")
    cal.add_argument("--probe-bytes", default="64M", help="bytes of each probe transfer (default 64M)")
    cal.add_argument("--repeats", type=int, default=4, help="transfers per probe (default 4)")
    cal.add_argument("--probe-timeout", type=float, default=300.0, help="seconds the probes may take at most")


def run(args):
    if args.calibrate:
        return run_calibration(args)
    counts = _counts(args.plot_nodes) if args.plot else None
    cluster, workload = assemble(args)
    modes = _modes(args.modes)
    tau = args.tau or settings.get("EDDIS_EASGD_TAU")
    outcomes = evaluate(cluster, workload, modes, tau=tau, run_steps=args.run_steps)
    advice = recommend(cluster, workload, outcomes, tau=tau)
    print(format_plan(cluster, workload, outcomes, advice, tau))
    if args.write:
        write_inputs(args.write, cluster, workload)
    if args.json:
        Path(args.json).write_text(json.dumps(as_records(cluster, workload, outcomes, advice, tau), indent=1))
    if args.plot:
        from .plot import plot_nodes

        path = plot_nodes(args.plot, cluster, workload, modes, counts, tau)
        print(f"plot: {path}")
    return 0


def _modes(text):
    if not text:
        return None
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODES]
    if unknown:
        raise ConfigError(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    return names


def _counts(text):
    try:
        counts = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ConfigError(f"--plot-nodes {text!r}: give node counts, e.g. 1,2,4,8,16,32,64")
    return counts


def assemble(args):
    """The cluster and the model from the files, the profile and the options (docs/plan.md,
    "Inputs"): the profile's ranks replace the cluster file's; the options win over both."""
    if args.cluster is None and args.profile is None:
        raise ConfigError("eddis plan needs a cluster: --cluster cluster.json, or --from-profile run.h5 with "
                          "--link RATE (eddis plan --calibrate writes a cluster.json)")
    cluster = spec.load_cluster(args.cluster) if args.cluster else None
    if args.profile:
        ranks, _, _, modes = calibrate.ranks_from_profile(args.profile)
        if cluster is None:
            if not args.link:
                raise ConfigError("--from-profile without --cluster: give the link rate, e.g. --link 200gbit")
            cluster = spec.Cluster(nodes=(), source=f"ranks from {args.profile} ({', '.join(modes)} run)")
            link = spec.parse_rate(args.link, "--link") * spec.TCP_PAYLOAD_SHARE / 8
            latency = 0.0
        else:
            link, latency = cluster.nodes[0].link_bps, cluster.nodes[0].latency_s
        cluster = replace(cluster, nodes=tuple(spec.Node(name, tuple(rs), link, latency) for name, rs in ranks))
    if args.model:
        workload = spec.load_model(args.model)
    else:
        if not (args.profile or args.timeline):
            raise ConfigError("eddis plan needs a model: --model model.json, or a run's --from-profile/--timeline")
        workload = calibrate.workload_from_run(args.profile, args.timeline)
    if args.nodes is not None:
        cluster = cluster.with_nodes(args.nodes)
    if args.link or args.latency_us is not None:
        cluster = cluster.with_link(spec.parse_rate(args.link, "--link") if args.link else None,
                                    None if args.latency_us is None else args.latency_us * 1e-6)
    if args.local_batch is not None:
        if args.local_batch < 1:
            raise ConfigError(f"--local-batch {args.local_batch}: a rank needs a sample or more a step")
        workload = replace(workload, local_batch=args.local_batch)
    spec.check_pair(cluster, workload, args.cluster or "the cluster")
    return cluster, workload


def write_inputs(directory, cluster, workload):
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster.json").write_text(json.dumps(spec.cluster_to_dict(cluster), indent=1) + "\n")
    (out / "model.json").write_text(json.dumps(spec.model_to_dict(workload), indent=1) + "\n")
    return out / "cluster.json", out / "model.json"


def run_calibration(args):
    from . import probe

    nbytes = settings.PARSERS["size"](args.probe_bytes)
    if nbytes < 8:
        raise ConfigError(f"--probe-bytes {args.probe_bytes}: give at least 8 bytes, e.g. 64M")
    ranks = calibrate.ranks_from_profile(args.profile)[0] if args.profile else None
    link = spec.parse_rate(args.link, "--link") if args.link else None
    cluster = probe.run(nbytes, args.repeats, args.probe_timeout, link, ranks)
    if cluster is None:   # not rank 0
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster.json").write_text(json.dumps(spec.cluster_to_dict(cluster), indent=1) + "\n")
    print(f"eddis plan --calibrate: {cluster.source}")
    print(f"wrote {out / 'cluster.json'}")
    if args.profile or args.timeline:
        workload = calibrate.workload_from_run(args.profile, args.timeline)
        (out / "model.json").write_text(json.dumps(spec.model_to_dict(workload), indent=1) + "\n")
        print(f"wrote {out / 'model.json'}")
    return 0


# ---------------------------------------------------------------- output
def _mb(nbytes):
    return f"{nbytes / 1e6:.1f}"


def describe_inputs(cluster, workload):
    kinds = {}
    for r in cluster.ranks:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    links = sorted({(n.link_bps, n.latency_s) for n in cluster.nodes})
    link = "; ".join(f"{b * 8 / spec.TCP_PAYLOAD_SHARE / 1e9:.3g} Gbit/s ({b / 1e6:.1f} MB/s payload), "
                     f"{lat * 1e6:.3g} us" for b, lat in links)

    def gbs(v):
        return "-" if v is None else f"{v / 1e9:.3g}"

    sizes = ", ".join(_mb(b.nbytes) for b in workload.buckets[:8]) + (", ..." if len(workload.buckets) > 8 else "")
    return [f"cluster: {cluster.num_nodes} nodes, {cluster.size} ranks ("
            + ", ".join(f"{c} x {k}" for k, c in kinds.items()) + f"); link {link}",
            f"  SMB put/get/reduce/ring {gbs(cluster.put_bps)}/{gbs(cluster.get_bps)}/{gbs(cluster.reduce_bps)}/"
            f"{gbs(cluster.smb_ring_bps)} GB/s, "
            f"PCIe {gbs(cluster.pcie_bps)}, cast {gbs(cluster.cast_bps)}, in a node {gbs(cluster.intra_bps)} GB/s "
            "(-: not a limit)" + (f"; {cluster.source}" if cluster.source else ""),
            f"model {workload.name}: S = {_mb(workload.gradient_bytes)} MB in {len(workload.buckets)} bucket(s) "
            f"({sizes} MB), local batch {workload.local_batch}, global batch "
            f"{workload.local_batch * cluster.size}, update {workload.update_share:.0%} of a step"]


def format_plan(cluster, workload, outcomes, advice, tau):
    lines = ["eddis plan (predicted, not measured)"] + describe_inputs(cluster, workload) + [""]
    head = (f"{'mode':24s} {'step ms':>9s} {'samples/s':>10s} {'x ring':>7s} {'x ideal':>8s} "
            f"{'MB/node/way':>12s} {'/ S':>5s} {'link busy':>9s} {'target smp':>10s} {'target s':>9s}")
    lines += [head, "-" * len(head)]
    S = workload.gradient_bytes
    for name, o in outcomes.items():
        st = o.step
        label = "solo (the ideal)" if name == SOLO else name
        target = "-" if o.samples_to_target is None else f"{o.samples_to_target:.0f}"
        when = "-" if o.time_to_target_s is None else f"{o.time_to_target_s:.1f}"
        lines.append(f"{label:24s} {st.step_s * 1e3:9.1f} {st.samples_per_s:10.1f} "
                     f"{'-' if o.x_ring is None else f'{o.x_ring:.2f}':>7s} {o.x_ideal:8.2f} "
                     f"{_mb(st.bytes_per_node_way):>12s} {st.bytes_per_node_way / S:5.2f} {st.link_busy:9.0%} "
                     f"{target:>10s} {when:>9s}")
    lines.append(f"(a step: one global batch; elastic modes at tau {tau}, their exchanges "
                 f"{'in the background' if cluster.num_nodes > 1 else 'inline (one node)'}; samples to target "
                 "only where the model gives them and, for easgd/hybrid, their measured sample efficiency)")
    lines += ["", f"recommendation: {advice.mode}"
              + (f" with fp16 on the wire" if advice.compression != "none" else "")
              + (f", tau {advice.tau}" if advice.tau else "")]
    lines.append(f"  batch split: {describe_split(cluster, advice.batches)}")
    lines += [f"  {reason}" for reason in advice.reasons]
    return "\n".join(lines)


def as_records(cluster, workload, outcomes, advice, tau):
    rows = []
    for name, o in outcomes.items():
        st = o.step
        rows.append({"mode": name, "step_s": st.step_s, "samples_per_s": st.samples_per_s,
                     "x_ring": o.x_ring, "x_ideal": o.x_ideal,
                     "bytes_per_node_way": st.bytes_per_node_way,
                     "bytes_per_node_way_over_S": st.bytes_per_node_way / workload.gradient_bytes,
                     "link_out_in": st.link_out_in, "link_busy": st.link_busy, "batches": st.batches,
                     "tau": st.tau, "overlap": st.overlap, "sample_efficiency": o.efficiency,
                     "samples_to_target": o.samples_to_target, "time_to_target_s": o.time_to_target_s})
    return {"predicted": True, "cluster": spec.cluster_to_dict(cluster), "model": spec.model_to_dict(workload),
            "tau": tau, "modes": rows,
            "recommendation": {"mode": advice.mode, "compression": advice.compression, "tau": advice.tau,
                               "batches": advice.batches, "reasons": advice.reasons}}

