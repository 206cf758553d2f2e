"""``eddis plan --plot``: step time against the number of nodes, one line per mode (PNG)."""
from pathlib import Path

from ..errors import ConfigError
from .evaluate import evaluate
from .modes import SOLO


def series(cluster, workload, modes, counts, tau):
    """``{mode: [step seconds at each node count]}`` (the cluster's node pattern repeated)."""
    out = {}
    for count in counts:
        for name, o in evaluate(cluster.with_nodes(count), workload, modes, tau=tau).items():
            out.setdefault(name, []).append(o.step.step_s)
    return out


def plot_nodes(path, cluster, workload, modes, counts, tau):
    try:
        import matplotlib
    except ImportError as exc:
        raise ConfigError(f"--plot needs matplotlib ({exc}); pip install matplotlib, or leave --plot out") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    data = series(cluster, workload, modes, counts, tau)
    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=100)
    colours = matplotlib.colormaps["tab20"]
    for c, (name, times) in enumerate(data.items()):
        style = {"linestyle": ":", "color": "black"} if name == SOLO else (
            {"linestyle": "--", "color": colours(c % 20)} if name.startswith("ddp") else {"color": colours(c % 20)})
        label = "solo (the ideal)" if name == SOLO else name
        ax.plot(counts, [1e3 * t for t in times], marker="o", markersize=3, label=label, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts)
    ax.set_xticklabels([str(c) for c in counts])
    ax.set_xlabel("nodes")
    ax.set_ylabel("step time, one global batch (ms)")
    ax.set_title(f"predicted: {workload.name}, {len(cluster.nodes[0].ranks)} rank(s) a node, local batch "
                 f"{workload.local_batch}, tau {tau}", fontsize="medium")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
