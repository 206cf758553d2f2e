"""Who am I? Map the launcher's environment (srun or mpirun) onto EDDIS_* rank variables.

Under ``srun`` (plain or heterogeneous job) and under Open MPI's ``mpirun`` each
task finds its rank in different variables. :func:`detect` reads them and returns
a :class:`RankInfo`; :meth:`RankInfo.environ` gives the ``EDDIS_*`` variables the
launcher exports to the trainer (the rank environment of the team contract) plus
the ``CUDA_VISIBLE_DEVICES`` that binds the rank to one GPU.

What Slurm 22.05 puts in a heterogeneous step (``srun --het-group=0,1``), as seen
on the dev cluster: ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_NODEID`` span the
whole step; ``SLURM_JOB_PARTITION`` holds the *last* component's partition for
every task, so the component of a task comes from ``SLURM_JOB_NODELIST_HET_GROUP_<k>``
(and from the per-component task counts when components share nodes).
"""
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Optional

from .. import identity, settings
from ..errors import ConfigError
from .hostlist import expand_hostlist, expand_tasks_per_node
from .mpirun_step import parse_host_groups

GPU_MODEL_PATTERN = re.compile(r"\b([AHBLTPVK]\d{2,3}[A-Z]?|RTX\s?\d{4}|MI\d{2,3}[A-Z]?)\b", re.I)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    size: int
    local_rank: int
    local_size: int
    group: int
    num_groups: int
    group_size: int
    hostname: str
    gpu_type: str
    gpu: Optional[str]  # the device this rank is bound to (an entry of CUDA_VISIBLE_DEVICES)
    launcher: str  # "slurm", "mpirun" or "single"

    def environ(self, run_dir=None):
        """The rank variables to export to the trainer process."""
        env = {
            "EDDIS_RANK": str(self.rank),
            "EDDIS_SIZE": str(self.size),
            "EDDIS_LOCAL_RANK": str(self.local_rank),
            "EDDIS_LOCAL_SIZE": str(self.local_size),
            "EDDIS_GROUP": str(self.group),
            "EDDIS_NUM_GROUPS": str(self.num_groups),
            "EDDIS_GROUP_SIZE": str(self.group_size),
            "EDDIS_GPU_TYPE": self.gpu_type,
            "EDDIS_HOSTNAME": self.hostname,
            "EDDIS_LAUNCHED": "1",
        }
        if run_dir is not None:
            env["EDDIS_RUN_DIR"] = str(run_dir)
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        return env

    def describe(self):
        gpu = f"gpu {self.gpu_type}:{self.gpu}" if self.gpu is not None else f"gpu {self.gpu_type} (none bound)"
        return (f"rank {self.rank}/{self.size} local {self.local_rank}/{self.local_size} "
                f"group {self.group}/{self.num_groups} host {self.hostname} {gpu}")


def _int(env, name, default=None):
    text = env.get(name)
    if text is None or text == "":
        if default is None:
            raise ConfigError(f"{name} is not set; is this process started by srun or mpirun?")
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer") from None


def _device_list(text):
    if text is None:
        return []
    text = text.strip()
    if text in ("", "NoDevFiles", "(null)"):
        return []
    return [d for d in text.split(",") if d]


def visible_gpus(env):
    """The GPU ids this task may use, as the CUDA runtime will number them."""
    devices = _device_list(env.get("CUDA_VISIBLE_DEVICES"))
    if not devices:
        devices = _device_list(env.get("SLURM_STEP_GPUS")) or _device_list(env.get("SLURM_JOB_GPUS"))
    return devices


def bind_gpu(devices, local_rank):
    """One device per local rank; ranks share devices round-robin when there are fewer."""
    if not devices:
        return None
    return devices[local_rank % len(devices)]


def gpu_types_from_gres(gres):
    """``gpu:a100:2(S:0-1),gpu:v100:1`` -> ``['a100', 'v100']`` (typed GPUs only)."""
    types = []
    for item in (gres or "").split(","):
        fields = item.split("(")[0].split(":")
        if len(fields) >= 3 and fields[0] == "gpu" and not fields[1].isdigit():
            if fields[1] not in types:
                types.append(fields[1])
    return types


def gpu_type_from_model(model):
    """``NVIDIA A100-SXM4-40GB`` -> ``a100``; None when no known family shows."""
    match = GPU_MODEL_PATTERN.search(model or "")
    return match.group(1).replace(" ", "").lower() if match else None


def node_gres(node, timeout=10.0):
    """The Gres= field of a Slurm node (scontrol), or None when Slurm does not answer."""
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True,
                             text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    for field in out.stdout.split():
        if field.startswith("Gres="):
            return field[len("Gres="):]
    return None


class CachedGres:
    """node_gres with one scontrol call per node and job: the local ranks of a node share the
    answer through a file in the run directory (under a lock), so a large job does not send
    slurmctld one request per rank."""

    def __init__(self, folder, lookup=node_gres):
        self.folder = folder
        self.lookup = lookup

    def __call__(self, node):
        import fcntl

        try:
            os.makedirs(self.folder, exist_ok=True)
            cache = os.path.join(self.folder, f"{node}.gres")
            with open(cache + ".lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    with open(cache) as f:
                        return f.read() or None
                except FileNotFoundError:
                    pass
                gres = self.lookup(node)
                if gres is not None:
                    with open(cache, "w") as f:
                        f.write(gres)
                return gres
        except OSError:
            return self.lookup(node)


def local_gpu_models():
    """GPU model names from the NVIDIA driver's /proc files (no CUDA needed)."""
    models = []
    root = "/proc/driver/nvidia/gpus"
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return models
    for entry in entries:
        try:
            with open(os.path.join(root, entry, "information")) as f:
                for line in f:
                    if line.startswith("Model:"):
                        models.append(line.split(":", 1)[1].strip())
        except OSError:
            pass
    return models


def resolve_gpu_type(env, hostname, group, devices, gres_lookup=node_gres):
    """The GPU generation of this rank, for the heterogeneity-aware modes.

    Order: an explicit EDDIS_GPU_TYPE; ``cpu`` when no GPU is visible; the typed
    GRES of the Slurm node; the partition of the rank's het component; the
    driver's model name; else ``gpu``.
    """
    explicit = identity.gpu_type(env)
    if explicit:
        return explicit
    if not devices:
        return "cpu"
    if "SLURM_JOB_ID" in env and gres_lookup is not None:
        types = gpu_types_from_gres(gres_lookup(hostname))
        if types:
            return types[0]
    if "SLURM_JOB_ID" in env:
        partition = env.get(f"SLURM_JOB_PARTITION_HET_GROUP_{group}") or env.get("SLURM_JOB_PARTITION")
        model = gpu_type_from_model(partition)
        if model:
            return model
    for model in local_gpu_models():
        family = gpu_type_from_model(model)
        if family:
            return family
    return "gpu"


def _het_group(env, node, rank):
    """The heterogeneous-job component of this task, and the number of components."""
    het_size = _int(env, "SLURM_HET_SIZE", 0)
    if het_size <= 1:
        return 0, 1
    owners = [k for k in range(het_size)
              if node in expand_hostlist(env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{k}", ""))]
    if len(owners) == 1:
        return owners[0], het_size
    # Components share this node (or the lists are missing): tasks are numbered
    # component after component, so count them off.
    first = 0
    for k in range(het_size):
        count = _int(env, f"SLURM_NTASKS_HET_GROUP_{k}", 0)
        if first <= rank < first + count:
            return k, het_size
        first += count
    raise ConfigError(f"cannot tell the het-job component of task {rank} on {node}: "
                      f"SLURM_*_HET_GROUP_<k> variables are missing")


def _het_group_size(env, group, size):
    nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST", ""))
    counts = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""))
    members = set(expand_hostlist(env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{group}", "")))
    if nodes and len(nodes) == len(counts) and members:
        total = sum(c for n, c in zip(nodes, counts) if n in members)
        if total:
            return total
    return _int(env, f"SLURM_NTASKS_HET_GROUP_{group}", size)


def from_slurm(env, gres_lookup=node_gres):
    """RankInfo of a task started by srun."""
    rank = _int(env, "SLURM_PROCID")
    size = _int(env, "SLURM_STEP_NUM_TASKS", 0) or _int(env, "SLURM_NTASKS")
    local_rank = _int(env, "SLURM_LOCALID")
    gtids = [g for g in env.get("SLURM_GTIDS", "").split(",") if g]
    if gtids:
        local_size = len(gtids)
    else:
        counts = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", ""))
        node_id = _int(env, "SLURM_NODEID", 0)
        local_size = counts[node_id] if node_id < len(counts) else 1
    hostname = identity.node_name(env)
    group, num_groups = _het_group(env, hostname, rank)
    if num_groups > 1:
        group_size = _het_group_size(env, group, size)
    else:
        # a plain job: one group per node (hybrid's synchronous part then stays on the node)
        group, group_size = _int(env, "SLURM_NODEID", 0), local_size
        num_groups = (_int(env, "SLURM_STEP_NUM_NODES", 0) or _int(env, "SLURM_NNODES", 0)
                      or max(1, len(expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE")
                                                          or env.get("SLURM_TASKS_PER_NODE", "")))))
    devices = visible_gpus(env)
    return RankInfo(rank, size, local_rank, local_size, group, num_groups, group_size, hostname,
                    resolve_gpu_type(env, hostname, group, devices, gres_lookup),
                    bind_gpu(devices, local_rank), "slurm")


def _host_group(env, hostname, size):
    """(group, number of groups, ranks in the group) of a rank on ``hostname``: from
    EDDIS_HOST_GROUPS (the mpirun of an elastic Slurm job), else one group of every rank."""
    text = settings.get("EDDIS_HOST_GROUPS", env)
    if not text:
        return 0, 1, size
    table = parse_host_groups(text)
    if hostname not in table:
        raise ConfigError(f"this rank's node {hostname} is not among the trainer nodes of EDDIS_HOST_GROUPS="
                          f"{text!r}: the node name Slurm gives it (SLURMD_NODENAME) differs from the one "
                          "mpirun was given")
    group = table[hostname][0]
    return group, len({g for g, _ in table.values()}), sum(n for g, n in table.values() if g == group)


def from_openmpi(env, gres_lookup=None):
    """RankInfo of a process started by Open MPI's mpirun (eddis-train --local, or the elastic
    trainers of a Slurm job, :mod:`eddis.launch.mpirun_step`)."""
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    size = _int(env, "OMPI_COMM_WORLD_SIZE")
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
    hostname = identity.node_name(env)
    group, num_groups, group_size = _host_group(env, hostname, size)
    devices = visible_gpus(env)
    return RankInfo(rank, size, local_rank, local_size, group, num_groups, group_size, hostname,
                    resolve_gpu_type(env, hostname, group, devices, gres_lookup),
                    bind_gpu(devices, local_rank), "mpirun")


def detect(env=None, gres_lookup=node_gres):
    """RankInfo from whichever launcher started this process: mpirun first, whose ranks
    inside a Slurm job also see the variables of the step that holds their node's daemon."""
    env = os.environ if env is None else env
    if "OMPI_COMM_WORLD_RANK" in env:
        return from_openmpi(env, gres_lookup if "SLURM_JOB_ID" in env else None)
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        return from_slurm(env, gres_lookup)
    hostname = identity.node_name(env)
    devices = visible_gpus(env)
    return RankInfo(0, 1, 0, 1, 0, 1, 1, hostname,
                    resolve_gpu_type(env, hostname, 0, devices, None), bind_gpu(devices, 0), "single")
