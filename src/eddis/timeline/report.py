"""``eddis prof report <profile.h5 | run dir>``: where the step time went, per rank and GPU type.

The summary table, per rank (after ``skip`` warm-up steps):

- ``samples/s``: samples / wall time of its steps (what it contributed);
- ``step ms``: mean step time;
- ``compute % / wait %``: shares of the step (they add up to 100);
- ``comm %``: busy time of the communication thread over the step time (it
  overlaps compute, so it is not part of the 100);
- ``compute samples/s``: samples / compute time: the speed of the rank itself.

The straggler ranking orders ranks by the compute speed of their median step
(samples / compute time of that step; robust to one-off interference), slowest
first; ``slowdown`` is the median of all ranks' speeds over the rank's own. In synchronous training every
rank has the same step time (all wait for the slowest), so the straggler shows
up as the rank with the highest compute share and the least wait. Bandwidth is
bytes sent and received over communication busy time.

Plots (matplotlib, Agg): ``step_time.png`` (step time per rank over the steps),
``throughput.png`` (samples/s and compute samples/s per rank, coloured by GPU
type), ``breakdown.png`` (stacked compute / wait per rank, with the overlapped
communication beside it).
"""
import json
from pathlib import Path

import numpy as np

from ..errors import TimelineFormatError
from .profile import load_profile


def _default_skip(steps):
    return 1 if steps > 3 else 0


def summarize(ranks, skip=None):
    """Per-rank figures, per-GPU-type totals and the straggler ranking (dicts)."""
    rows = []
    for rank, d in ranks.items():
        n = len(d["step"])
        k = _default_skip(n) if skip is None else min(skip, max(n - 1, 0))
        sl = slice(k, None)
        t_step = float(np.sum(d["t_step"][sl]))
        t_compute = float(np.sum(d["t_compute"][sl]))
        t_comm = float(np.sum(d["t_comm"][sl]))
        t_wait = float(np.sum(d["t_wait"][sl]))
        samples = int(np.sum(d["samples"][sl]))
        moved = int(np.sum(d["bytes_sent"][sl]) + np.sum(d["bytes_recv"][sl]))
        steps = max(n - k, 0)
        per_step = d["t_compute"][sl]
        ok = per_step > 0
        # The median step resists one-off interference (a busy neighbour, a GC pause,
        # an evaluation pass) that a sum would charge to the rank's speed.
        typical = float(np.median(d["samples"][sl][ok] / per_step[ok])) if np.any(ok) else 0.0
        rows.append({
            "rank": rank, "gpu_type": str(d["attrs"].get("gpu_type", "?")),
            "node": str(d["attrs"].get("node", d["attrs"].get("host", "?"))),
            "mode": str(d["attrs"].get("mode", "?")), "steps": steps, "samples": samples,
            "time_s": t_step,
            "samples_per_s": samples / t_step if t_step > 0 else 0.0,
            "step_ms": 1000.0 * t_step / steps if steps else 0.0,
            "compute_pct": 100.0 * t_compute / t_step if t_step > 0 else 0.0,
            "wait_pct": 100.0 * t_wait / t_step if t_step > 0 else 0.0,
            "comm_pct": 100.0 * t_comm / t_step if t_step > 0 else 0.0,
            "compute_samples_per_s": samples / t_compute if t_compute > 0 else 0.0,
            "typical_compute_samples_per_s": typical,
            "bytes": moved,
            "bandwidth_gb_s": moved / t_comm / 1e9 if t_comm > 0 else 0.0,
        })
    speeds = [r["typical_compute_samples_per_s"] for r in rows if r["typical_compute_samples_per_s"] > 0]
    median = float(np.median(speeds)) if speeds else 0.0
    for r in rows:
        speed = r["typical_compute_samples_per_s"]
        r["slowdown"] = median / speed if speed > 0 else float("inf")
    ranking = sorted(rows, key=lambda r: r["typical_compute_samples_per_s"])
    by_type = {}
    for r in rows:
        t = by_type.setdefault(r["gpu_type"], {"gpu_type": r["gpu_type"], "ranks": 0, "samples": 0,
                                               "samples_per_s": 0.0, "compute_samples_per_s": 0.0})
        t["ranks"] += 1
        t["samples"] += r["samples"]
        t["samples_per_s"] += r["samples_per_s"]
        t["compute_samples_per_s"] += r["compute_samples_per_s"]
    for t in by_type.values():
        t["per_rank_compute_samples_per_s"] = t["compute_samples_per_s"] / t["ranks"]
    total_time = max((r["time_s"] for r in rows), default=0.0)
    total = {
        "ranks": len(rows), "samples": sum(r["samples"] for r in rows),
        "samples_per_s": sum(r["samples_per_s"] for r in rows),
        "wall_s": total_time,
        "bytes": sum(r["bytes"] for r in rows),
    }
    return {"ranks": rows, "ranking": [r["rank"] for r in ranking], "by_gpu_type": list(by_type.values()),
            "straggler": ranking[0]["rank"] if ranking else None,
            "straggler_slowdown": ranking[0]["slowdown"] if ranking else None, "total": total}


def format_table(summary, run_attrs=None):
    lines = []
    if run_attrs:
        modes = ", ".join(json.loads(run_attrs.get("modes", "[]")))
        nodes = ", ".join(json.loads(run_attrs.get("nodes", "[]")))
        lines.append(f"run: {summary['total']['ranks']} ranks, mode {modes or '?'}, nodes {nodes or '?'}")
    head = (f"{'rank':>4} {'node':<10} {'gpu':<6} {'steps':>6} {'samples/s':>10} {'step ms':>9} "
            f"{'compute%':>8} {'wait%':>6} {'comm%':>6} {'compute smp/s':>13} {'GB/s':>7}")
    lines += [head, "-" * len(head)]
    for r in summary["ranks"]:
        lines.append(
            f"{r['rank']:>4} {r['node'][:10]:<10} {r['gpu_type'][:6]:<6} {r['steps']:>6} "
            f"{r['samples_per_s']:>10.1f} {r['step_ms']:>9.2f} {r['compute_pct']:>8.1f} "
            f"{r['wait_pct']:>6.1f} {r['comm_pct']:>6.1f} {r['compute_samples_per_s']:>13.1f} "
            f"{r['bandwidth_gb_s']:>7.3f}")
    t = summary["total"]
    lines.append(f"total: {t['samples_per_s']:.1f} samples/s, {t['samples']} samples, "
                 f"{t['bytes'] / 1e6:.1f} MB moved")
    lines.append("")
    lines.append("per GPU type:")
    for g in summary["by_gpu_type"]:
        lines.append(f"  {g['gpu_type']:<8} {g['ranks']} ranks  {g['samples_per_s']:.1f} samples/s  "
                     f"{g['per_rank_compute_samples_per_s']:.1f} compute samples/s per rank")
    lines.append("")
    lines.append("straggler ranking (slowest first, by the median step's compute speed; "
                 "slowdown = median of the ranks / rank):")
    by_rank = {r["rank"]: r for r in summary["ranks"]}
    for i, rank in enumerate(summary["ranking"], 1):
        r = by_rank[rank]
        flag = "  <- straggler" if i == 1 and r["slowdown"] > 1.2 else ""
        lines.append(f"  {i}. rank {rank} ({r['gpu_type']}, {r['node']}): {r['typical_compute_samples_per_s']:.1f} "
                     f"compute samples/s in a typical step, slowdown {r['slowdown']:.2f}x{flag}")
    return "\n".join(lines)


def _colors(rows):
    import matplotlib

    types = sorted({r["gpu_type"] for r in rows})
    cmap = matplotlib.colormaps["tab10"]
    return {t: cmap(i % 10) for i, t in enumerate(types)}


def write_plots(ranks, summary, out_dir, skip=None):
    """Write the three PNGs into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summary["ranks"]
    colors = _colors(rows)
    labels = [f"{r['rank']}\n{r['gpu_type']}" for r in rows]
    x = np.arange(len(rows))
    paths = []

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for rank, d in ranks.items():
        gpu = str(d["attrs"].get("gpu_type", "?"))
        ax.plot(d["step"], 1000.0 * d["t_step"], label=f"rank {rank} ({gpu})", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    steady = [1000.0 * d["t_step"][(_default_skip(len(d["step"])) if skip is None else skip):] for d in ranks.values()]
    steady = np.concatenate([a for a in steady if len(a)]) if any(len(a) for a in steady) else np.zeros(1)
    top = 1.3 * float(np.percentile(steady, 99)) if steady.size else 1.0
    clipped = any(float(np.max(1000.0 * d["t_step"], initial=0.0)) > top for d in ranks.values())
    ax.set_title("Step time per rank" + (" (warm-up steps above the top are clipped)" if clipped else ""))
    ax.grid(alpha=0.3)
    ax.set_ylim(0, top if top > 0 else None)
    ax.legend(fontsize="small", ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    paths.append(out_dir / "step_time.png")
    fig.savefig(paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    width = 0.4
    ax.bar(x - width / 2, [r["samples_per_s"] for r in rows], width,
           color=[colors[r["gpu_type"]] for r in rows], label="samples/s (wall)")
    ax.bar(x + width / 2, [r["compute_samples_per_s"] for r in rows], width,
           color=[colors[r["gpu_type"]] for r in rows], alpha=0.45, hatch="//", label="samples/s (compute only)")
    ax.set_xticks(x, labels)
    ax.set_xlabel("rank / GPU type")
    ax.set_ylabel("samples per second")
    ax.set_title("Throughput per rank (colour: GPU type; hatched: compute only)")
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=t) for t, c in colors.items()]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="compute-only speed"))
    ax.legend(handles=handles, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / "throughput.png")
    fig.savefig(paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    compute = np.array([r["compute_pct"] for r in rows])
    wait = np.array([r["wait_pct"] for r in rows])
    comm = np.array([r["comm_pct"] for r in rows])
    ax.bar(x - 0.2, compute, 0.4, label="compute", color="tab:blue")
    ax.bar(x - 0.2, wait, 0.4, bottom=compute, label="wait on communication", color="tab:red")
    ax.bar(x + 0.2, comm, 0.4, label="communication busy (overlapped)", color="tab:green", alpha=0.6)
    ax.set_xticks(x, labels)
    ax.set_xlabel("rank / GPU type")
    ax.set_ylabel("% of step time")
    ax.set_title("Where the step time went")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / "breakdown.png")
    fig.savefig(paths[-1])
    plt.close(fig)
    return paths


def report(path, out_dir=None, skip=None, plots=True):
    """Summary text, summary dict and plot paths for a profile (file or run dir)."""
    path = Path(path)
    run_attrs, ranks = load_profile(path)
    if not ranks:
        raise TimelineFormatError(f"{path} holds no rank profiles: give `eddis prof report` the "
                                  f"profile.h5 of a run with EDDIS_PROFILE=1, or its run directory")
    summary = summarize(ranks, skip=skip)
    text = format_table(summary, run_attrs)
    paths = []
    if plots:
        if out_dir is None:
            out_dir = (path if path.is_dir() else path.parent) / "report"
        paths = write_plots(ranks, summary, out_dir, skip=skip)
    return text, summary, paths
