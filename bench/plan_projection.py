#!/usr/bin/env python
"""Issue 42's projection: what the planner's model predicts for 4 to 64 InfiniBand nodes.

    .venv/bin/python bench/plan_projection.py [--markdown] [--plot docs/img/plan-projection.png]

Every figure it prints is predicted, none measured. The cluster is a mixed one, as the
published EDDIS results had: half the nodes A100s, half V100s, 4 or 8 GPUs a node, every
node's link 100 or 200 Gbit/s. The two workloads are a ResNet-50-sized gradient (25.6 M
parameters, 102 MB in fp32) and a YOLOv5m-sized one (21.2 M, 84.8 MB), cut into EDDIS's
25 MiB buckets (EDDIS_BUCKET_BYTES), each complete as the backward pass (the last two
thirds of a step) frees its bytes. The inputs (``INPUTS``) and where each comes from are
in docs/benchmarks-cluster.md beside the table; changing one is changing this file.

For each model, link, GPUs a node and node count it prints the ring's samples/s (DDP
over NCCL, and Horovod, which reduces with NCCL's ring on GPUs too) and every EDDIS
mode's samples/s over the ring's. Elastic modes (easgd, hybrid) are shown at tau 4 in
samples/s only: what they need in samples to a target is measured, not modelled
(docs/plan.md).
"""
import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

BUCKET_BYTES = 25 << 20
MODELS = {
    # parameters; samples/s of one A100 and one V100 in mixed precision; samples per GPU and step
    "resnet50": {"parameters": 25_557_032, "a100": 2470.0, "v100": 1200.0, "local_batch": 256},
    "yolov5m": {"parameters": 21_200_000, "a100": 103.0 * 2470.0 / 1200.0, "v100": 103.0, "local_batch": 48},
}
INPUTS = {
    "latency_us": 2.0,      # one message across an InfiniBand switch
    "pcie_gbs": 12.0,       # EDDIS's staging of a bucket between GPU and host memory (PCIe 3.0 x16)
    "reduce_gbs": 20.0,     # a server's (and a node sum's) reduce, bytes of input a second
    "intra_gbs": 100.0,     # between two GPUs of one node (NVLink)
}
NODES = (4, 8, 16, 32, 64)
GPUS_A_NODE = (4, 8)
LINKS = ("10gbit", "100gbit", "200gbit")   # 10gbit: Ethernet, for contrast
TAU = 4
EDDIS_MODES = ("eddis-allreduce", "eddis-sync", "eddis-sync-fp16", "eddis-balanced", "eddis-hybrid",
               "eddis-hybrid-balanced", "eddis-easgd")
PUBLISHED = "hybrid 2.53x Horovod on ResNet-50, 2.8x DDP on YOLOv5m (16 heterogeneous nodes)"


def workload(name):
    from plan_validate import spread_ready

    from eddis.plan.spec import Bucket, Workload

    total = 4 * MODELS[name]["parameters"]
    sizes = [BUCKET_BYTES] * (total // BUCKET_BYTES) + ([total % BUCKET_BYTES] if total % BUCKET_BYTES else [])
    return Workload(buckets=tuple(Bucket(n, r) for n, r in zip(sizes, spread_ready(sizes))),
                    local_batch=MODELS[name]["local_batch"], name=name)


def mixed_cluster(name, nodes, gpus, link):
    """Half the nodes A100s, half V100s, alternating."""
    from eddis.plan.spec import TCP_PAYLOAD_SHARE, Cluster, Node, Rank, parse_rate

    rate = parse_rate(link) * TCP_PAYLOAD_SHARE / 8
    built = []
    for j in range(nodes):
        kind = "a100" if j % 2 == 0 else "v100"
        built.append(Node(f"{kind}{j // 2 + 1}", (Rank(samples_per_s=MODELS[name][kind], kind=kind),) * gpus,
                          rate, INPUTS["latency_us"] * 1e-6))
    return Cluster(nodes=tuple(built), reduce_bps=INPUTS["reduce_gbs"] * 1e9, pcie_bps=INPUTS["pcie_gbs"] * 1e9,
                   intra_bps=INPUTS["intra_gbs"] * 1e9, source="bench/plan_projection.py")


def rows():
    from eddis.plan.evaluate import evaluate
    from eddis.plan.modes import RING, SOLO

    for name in MODELS:
        wl = workload(name)
        for link in LINKS:
            for gpus in GPUS_A_NODE:
                for nodes in NODES:
                    out = evaluate(mixed_cluster(name, nodes, gpus, link), wl, (RING,) + EDDIS_MODES, tau=TAU)
                    ring = out[RING].step.samples_per_s
                    yield {"model": name, "link": link, "gpus": gpus, "nodes": nodes, "ring": ring,
                           "ring_link_busy": out[RING].step.link_busy,
                           "x_ring": {m: out[m].step.samples_per_s / ring for m in EDDIS_MODES + (SOLO,)}}


def plot(path, table):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(12, 4.8), dpi=100, sharey=True)
    for ax, name in zip(axes, MODELS):
        picked = [r for r in table if r["model"] == name and r["link"] == "100gbit" and r["gpus"] == 8]
        counts = [r["nodes"] for r in picked]
        for mode in EDDIS_MODES + ("solo",):
            style = {"linestyle": ":", "color": "black"} if mode == "solo" else {}
            ax.plot(counts, [r["x_ring"][mode] for r in picked], marker="o", markersize=3,
                    label="solo (the ideal)" if mode == "solo" else mode, **style)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts)
        ax.set_xticklabels([str(c) for c in counts])
        ax.set_xlabel("nodes (half A100, half V100; 8 GPUs a node; 100 Gbit/s)")
        ax.set_title(f"predicted: {name}", fontsize="medium")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("samples/s over the ring's (DDP, Horovod)")
    axes[-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--plot", metavar="PNG", help="samples/s over the ring's against nodes, 8 GPUs a node, 100gbit")
    args = p.parse_args(argv)
    table = list(rows())
    header = ["model", "link", "GPUs a node", "nodes", "ring samples/s", "ring's link busy"] + \
        [m.replace("eddis-", "") for m in EDDIS_MODES] + ["ideal"]
    sep = " | " if args.markdown else "  "
    print(("| " + sep.join(header) + " |\n|" + "---|" * len(header)) if args.markdown else sep.join(header))
    for r in table:
        cells = [r["model"], r["link"], str(r["gpus"]), str(r["nodes"]), f"{r['ring']:.0f}",
                 f"{r['ring_link_busy']:.2f}"] + [f"{r['x_ring'][m]:.2f}" for m in EDDIS_MODES + ("solo",)]
        print(("| " + sep.join(cells) + " |") if args.markdown else sep.join(cells))
    print(f"\nevery figure predicted (eddis.plan), none measured; published beside it: {PUBLISHED}")
    if args.plot:
        print(f"plot: {plot(args.plot, table)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
