"""The allocation of a Slurm job, read from Slurm's variables: its hetjob components and nodes."""
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from .hostlist import expand_hostlist
from .placement import allocation_nodes


@dataclass(frozen=True)
class Component:
    """One hetjob component (the whole job when it is not a hetjob)."""

    group: Optional[int]  # its --het-group; None for a job of one component
    nodes: int
    cpus_per_node: int  # the fewest CPUs the job holds on one of its nodes

    def het_group_option(self):
        return [] if self.group is None else [f"--het-group={self.group}"]


def fewest_cpus(text):
    """The fewest CPUs per node in Slurm's SLURM_JOB_CPUS_PER_NODE form ("16(x2),8" -> 8); 1 if none."""
    counts = [part.split("(")[0].strip() for part in (text or "").split(",")]
    return min((int(c) for c in counts if c.isdigit()), default=1)


def _count(env, name, default=None):
    text = env.get(name)
    if not text:
        if default is not None:
            return default
        raise ConfigError(f"{name} is not set: eddis-train --job runs as the command of a Slurm batch "
                          "job script (sbatch eddis_job.sh train.py)")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} from Slurm is not a whole number") from None


def components(env):
    """The job's components, from SLURM_HET_SIZE and the per-component SLURM_*_HET_GROUP_<g>."""
    size = _count(env, "SLURM_HET_SIZE", default=1)
    if size <= 1:
        return [Component(None, _count(env, "SLURM_JOB_NUM_NODES"),
                          fewest_cpus(env.get("SLURM_JOB_CPUS_PER_NODE")))]
    return [Component(g, _count(env, f"SLURM_JOB_NUM_NODES_HET_GROUP_{g}"),
                      fewest_cpus(env.get(f"SLURM_JOB_CPUS_PER_NODE_HET_GROUP_{g}")))
            for g in range(size)]


def job_nodes(env):
    """Every node the job started with, in component order (SLURM_JOB_NODELIST[_HET_GROUP_<g>])."""
    size = _count(env, "SLURM_HET_SIZE", default=1)
    if size <= 1:
        return allocation_nodes(env)
    return tuple(n for g in range(size) for n in expand_hostlist(env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{g}", "")))
