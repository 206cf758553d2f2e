"""The scaling figure of bench/cluster.py: samples/s and bytes per step against the job's size.

    python bench/plot_cluster.py scaling.json docs/img/cluster-scaling.png

``scaling.json`` is what ``bench/cluster.py --scaling --json`` wrote. Two panels,
one line per contender: samples/s and the bytes each node's link carried per
step each way (in units of S, the fp32 gradient bytes), against the layout
(nodes x ranks per node), with the layouts of one rank a node first.
"""
import json
import sys
from pathlib import Path


def layouts(records):
    seen = sorted({(r["config"]["ranks_per_node"], r["config"]["nodes"]) for r in records})
    return [(nodes, ranks) for ranks, nodes in seen]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.exit("usage: python bench/plot_cluster.py SCALING.json OUT.png")
    records = json.loads(Path(argv[0]).read_text())
    if not records:
        sys.exit(f"{argv[0]} holds no records")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = layouts(records)
    labels = [f"{n}x{r}" for n, r in order]
    contenders = list(dict.fromkeys(r["contender"] for r in records))
    fig, (speed, wire) = plt.subplots(1, 2, figsize=(10, 4))
    for contender in contenders:
        rows = {(r["config"]["nodes"], r["config"]["ranks_per_node"]): r for r in records
                if r["contender"] == contender}
        xs = [i for i, key in enumerate(order) if key in rows]
        speed.plot(xs, [rows[order[i]]["samples_per_s"] for i in xs], marker="o", label=contender)
        wire.plot(xs, [rows[order[i]]["cross_node_bytes_per_step"] / rows[order[i]]["gradient_bytes"]
                       for i in xs], marker="o", label=contender)
    link = records[0]["config"]["link"]
    for axis, title in ((speed, f"samples/s ({link} links)"), (wire, "bytes per step each way per node / S")):
        axis.set_xticks(range(len(order)))
        axis.set_xticklabels(labels)
        axis.set_xlabel("nodes x ranks per node")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    speed.legend()
    fig.tight_layout()
    fig.savefig(argv[1], dpi=110)
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
