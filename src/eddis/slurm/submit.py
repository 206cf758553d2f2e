"""``eddis submit``: write the job script for the requested GPUs and submit it.

``eddis submit --gpus a100:4,v100:8 [--nodes N] [--time T] [--mode M] train.py [args]``
makes one hetjob component per GPU type (on a partition that offers it, the one
with only that type when there is a choice), one rank per GPU, and submits the
script of :func:`eddis.slurm.script.render_job_script` with ``sbatch``.
``--dry-run`` prints it instead. Everything is checked against Slurm's
partitions before anything is submitted.
"""
import argparse
import math
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from .. import settings
from ..errors import ConfigError
from .command import missing_script
from .discovery import Partition, partitions
from .script import CHECKPOINT_SIGNAL_SECONDS, JobComponent, render_job_script


def parse_counts(text, what):
    """``a100:4,v100:8`` -> [('a100', 4), ('v100', 8)]."""
    items = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, count = item.rpartition(":")
        if not sep or not name or not count.isdigit() or int(count) < 1:
            raise ConfigError(f"{what} {item!r}: write NAME:COUNT with COUNT >= 1, e.g. a100:4,v100:8")
        if any(n == name for n, _ in items):
            raise ConfigError(f"{what}: {name} is given twice")
        items.append((name, int(count)))
    if not items:
        raise ConfigError(f"{what} is empty: write e.g. a100:4,v100:8")
    return items


def _listing(parts):
    return "; ".join(p.describe() for p in parts) or "(none)"


def choose_partition(name, parts: Sequence[Partition]) -> Tuple[Partition, str]:
    """The partition for a ``--gpus`` entry (a GPU type or a partition name) and its GPU type."""
    by_name = {p.name: p for p in parts}
    if name in by_name:
        p = by_name[name]
        if len(p.gpu_types) == 1:
            return p, p.gpu_types[0]
        if name in p.gpus_per_node:
            return p, name
        raise ConfigError(f"partition {name} offers GPU types {', '.join(p.gpu_types) or 'none'}: "
                          f"ask for a type instead (e.g. --gpus {p.gpu_types[0] if p.gpu_types else 'a100'}:4). "
                          f"Partitions: {_listing(parts)}")
    offering = [p for p in parts if name in p.gpus_per_node]
    if not offering:
        raise ConfigError(f"no partition named {name!r} and none offering GPUs of type {name!r}. "
                          f"Partitions: {_listing(parts)}")
    # prefer a partition of that type only (a100, not the mixed 'all'), then an available one
    offering.sort(key=lambda p: (len(p.gpu_types) != 1, not p.available, p.name))
    return offering[0], name


def _partition_size(part, gpu_type):
    """``2 a100 GPUs (1 node x 2 per node)``: what a partition can give of one GPU type."""
    per_node = part.gpus_per_node[gpu_type]
    return (f"{part.nodes * per_node} {gpu_type} GPUs ({part.nodes} node{'s' if part.nodes != 1 else ''} "
            f"x {per_node} per node)")


def _askable(node_count, per_node_max, nodes=None):
    """The GPU counts a ``--gpus`` entry may ask for: the same number on each node used, on
    ``nodes`` nodes when the partition has that many, else on as few as hold them (what
    :func:`plan_components` picks)."""
    if nodes and nodes <= node_count:
        counts = [nodes * g for g in range(1, per_node_max + 1)]
    else:
        counts = [c for c in range(1, node_count * per_node_max + 1)
                  if c % math.ceil(c / per_node_max) == 0]
    runs = []  # consecutive counts as a-b, so a large partition's list stays short
    for c in counts:
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    words = [f"{a}" if a == b else f"{a}-{b}" if b > a + 1 else f"{a}, {b}" for a, b in runs]
    if len(words) > 12:
        words = words[:10] + ["...", words[-1]]
    return ", ".join(words)


def plan_components(gpus: Sequence[Tuple[str, int]], parts: Sequence[Partition],
                    nodes: Optional[Dict[str, int]] = None, default_nodes: Optional[int] = None,
                    spare_nodes: int = 0) -> List[JobComponent]:
    """One JobComponent per requested GPU type: nodes, one rank per GPU; ``spare_nodes`` more
    nodes for a job of one GPU type."""
    if spare_nodes < 0:
        raise ConfigError(f"--spare-nodes {spare_nodes}: give 0 or more nodes")
    if spare_nodes and len(gpus) > 1:
        raise ConfigError(f"--spare-nodes is for a job of one GPU type, and --gpus asks for {len(gpus)}: "
                          "a hetjob's components are its GPU types and each component's trainers use all "
                          "its nodes, so a spare could not stand in for a failed node of another type. Ask "
                          "for one GPU type with --spare-nodes, or submit the hetjob without it")
    components = []
    used = set()
    for name, count in gpus:
        part, gpu_type = choose_partition(name, parts)
        if part.name in used:
            raise ConfigError(f"--gpus: two entries map to partition {part.name}; give the total once")
        used.add(part.name)
        per_node_max = part.gpus_per_node[gpu_type]
        explicit_nodes = (nodes or {}).get(name, default_nodes)
        size = _partition_size(part, gpu_type)
        if count > part.nodes * per_node_max:
            raise ConfigError(f"--gpus {name}:{count} is more than partition {part.name} has: {size}; "
                              f"ask for one of {_askable(part.nodes, per_node_max, explicit_nodes)}")
        wanted_nodes = explicit_nodes or math.ceil(count / per_node_max)
        if wanted_nodes > part.nodes:
            raise ConfigError(f"--gpus {name}:{count} needs {wanted_nodes} node(s) of partition {part.name}, "
                              f"which has {part.nodes}. Partitions: {_listing(parts)}")
        if wanted_nodes + spare_nodes > part.nodes:
            raise ConfigError(f"--gpus {name}:{count} with --spare-nodes {spare_nodes} needs "
                              f"{wanted_nodes + spare_nodes} node(s) of partition {part.name}, which has "
                              f"{part.nodes}: ask for fewer spare nodes or GPUs")
        if count % wanted_nodes:
            raise ConfigError(f"--gpus {name}:{count} over {wanted_nodes} node(s) is not a whole number per node "
                              f"(partition {part.name} has {size}); ask for one of "
                              f"{_askable(part.nodes, per_node_max, explicit_nodes)} or other --nodes")
        per_node = count // wanted_nodes
        if per_node > per_node_max:
            raise ConfigError(f"--gpus {name}:{count} on {wanted_nodes} node(s) needs {per_node} GPUs per node, "
                              f"but partition {part.name} has {per_node_max} {gpu_type} per node; "
                              f"use --nodes {math.ceil(count / per_node_max)} or fewer GPUs")
        components.append(JobComponent(part.name, nodes=wanted_nodes, tasks_per_node=per_node,
                                       gpu_type=gpu_type, gpus_per_node=per_node, spare_nodes=spare_nodes))
    return components


def _parse_nodes(text):
    if text is None:
        return None, None
    if text.isdigit():
        if int(text) < 1:
            raise ConfigError("--nodes must be >= 1")
        return None, int(text)
    return dict(parse_counts(text, "--nodes")), None


# ---------------------------------------------------------------- the `eddis submit` subcommand
def add_arguments(parser):
    parser.add_argument("--gpus", required=True, metavar="TYPE:N[,TYPE:N...]",
                        help="GPUs per type (or partition name), one hetjob component each, e.g. a100:4,v100:8")
    parser.add_argument("--nodes", default=None, metavar="N|TYPE:N,...",
                        help="nodes per component (default: as few as hold the GPUs)")
    parser.add_argument("--time", default="01:00:00", help="time limit of each component (default 01:00:00)")
    mode_choices = settings.REGISTRY["EDDIS_MODE"].choices
    parser.add_argument("--mode", default=None, choices=mode_choices, help="training mode (EDDIS_MODE)")
    parser.add_argument("--job-name", default="eddis")
    parser.add_argument("--output", default="eddis-%j.out", help="sbatch --output pattern")
    parser.add_argument("--account", default=None)
    parser.add_argument("--memory", default=None, type=settings.REGISTRY["SMB_MEMORY"].flag_type(keep_text=True),
                        help="memory each smb-server lends (SMB_MEMORY), e.g. 4G")
    parser.add_argument("--server-wait", type=settings.REGISTRY["EDDIS_SERVER_WAIT"].flag_type("--server-wait"),
                        default=None,
                        help="seconds for the smb-servers to publish (EDDIS_SERVER_WAIT, default "
                             f"{settings.REGISTRY['EDDIS_SERVER_WAIT'].default:g})")
    parser.add_argument("--checkpoint-signal", type=int, default=CHECKPOINT_SIGNAL_SECONDS, metavar="SECONDS",
                        help="Slurm signals the job this long before its time limit; the trainers write a "
                             "checkpoint and the job requeues itself and resumes (default "
                             f"{CHECKPOINT_SIGNAL_SECONDS}; 0: no signal, no requeue)")
    parser.add_argument("--spare-nodes", type=settings.REGISTRY["EDDIS_SPARE_NODES"].flag_type("--spare-nodes"),
                        default=0, metavar="K",
                        help="K more nodes than the trainers use, and --no-kill: a restart after a node "
                             "failed (EDDIS_MAX_RESTARTS) runs without it (EDDIS_SPARE_NODES; one GPU type)")
    parser.add_argument("--dry-run", action="store_true", help="print the job script; submit nothing")
    parser.add_argument("train_command", nargs=argparse.REMAINDER, metavar="train.py [args]",
                        help="training script and its arguments")


def _train_command(args):
    command = list(args.train_command)
    return command[1:] if command and command[0] == "--" else command


def build_script(args, parts=None):
    command = _train_command(args)
    if not command:
        raise ConfigError("give the training script after the options: eddis submit --gpus a100:4 train.py [args]")
    parts = partitions() if parts is None else parts
    per_type_nodes, default_nodes = _parse_nodes(args.nodes)
    components = plan_components(parse_counts(args.gpus, "--gpus"), parts, per_type_nodes, default_nodes,
                                 spare_nodes=args.spare_nodes)
    extra = {"SMB_MEMORY": args.memory} if args.memory else {}
    return render_job_script(components=components, command=tuple(command), job_name=args.job_name,
                             time=args.time, output=args.output, account=args.account, mode=args.mode,
                             settings=extra, server_wait=args.server_wait,
                             checkpoint_signal=args.checkpoint_signal)


def run(args):
    script = build_script(args)
    problem = missing_script(_train_command(args))
    if args.dry_run:
        sys.stdout.write(script)
        if problem is not None:  # the script may be meant for another directory; say so all the same
            print(f"eddis submit: warning: {problem}; submitted from here, the job would fail at its start",
                  file=sys.stderr)
        return 0
    if problem is not None:  # as eddis-train does before it starts anything: nothing is queued
        raise ConfigError(f"{problem}; nothing was submitted")
    try:
        proc = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise ConfigError("sbatch is not on PATH: submit from a Slurm login node") from None
    except subprocess.TimeoutExpired:
        raise ConfigError("sbatch did not answer within 60 s; is slurmctld up? (scontrol ping)") from None
    if proc.returncode != 0:
        raise ConfigError(f"sbatch refused the job ({proc.returncode}): {proc.stderr.strip()}")
    job_id = proc.stdout.strip().split(";")[0]
    print(f"Submitted EDDIS job {job_id} (output: {args.output.replace('%j', job_id)})")
    return 0
