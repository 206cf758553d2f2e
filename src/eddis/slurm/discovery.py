"""Partitions and their GPU types, from Slurm.

pyslurm is used only where it imports and its version matches the installed
Slurm (its major.minor follows Slurm's). PyPI's pyslurm targets Slurm 25.11 and
does not build against Debian 12's Slurm 22.05, so on such systems (and on the
dev cluster) the Slurm CLI answers: ``sinfo -h -o '%R|%G|%D|%c|%a'``, one line
per partition and node configuration.
"""
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..errors import ConfigError

SINFO_FORMAT = "%R|%G|%D|%c|%a"


@dataclass
class Partition:
    name: str
    nodes: int = 0
    cpus_per_node: int = 0
    available: bool = True
    gpus_per_node: Dict[str, int] = field(default_factory=dict)  # type -> GPUs on each node of that type

    @property
    def gpu_types(self):
        return sorted(self.gpus_per_node)

    def describe(self):
        gpus = ", ".join(f"{t} x{n}/node" for t, n in sorted(self.gpus_per_node.items())) or "no GPUs"
        state = "" if self.available else ", DOWN"
        return f"{self.name} ({gpus}; {self.nodes} node{'s' if self.nodes != 1 else ''}{state})"


def parse_gres(gres):
    """``gpu:a100:2(S:0-1),gpu:v100:1`` -> {'a100': 2, 'v100': 1}; untyped GPUs count as 'gpu'."""
    found = {}
    for item in (gres or "").split(","):
        fields = item.split("(")[0].split(":")
        if not fields or fields[0] != "gpu" or len(fields) < 2:
            continue
        if len(fields) >= 3:
            kind, count = fields[1], fields[2]
        else:
            kind, count = "gpu", fields[1]
        try:
            found[kind] = found.get(kind, 0) + int(re.match(r"\d+", count).group())
        except (AttributeError, ValueError):
            continue
    return found


def parse_sinfo(text):
    """Partitions from ``sinfo -h -o '%R|%G|%D|%c|%a'`` output."""
    parts = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) != 5:
            raise ConfigError(f"unexpected sinfo line {line!r} (format {SINFO_FORMAT})")
        name, gres, nodes, cpus, avail = fields
        p = parts.setdefault(name, Partition(name))
        p.nodes += int(nodes)
        cpus_value = int(re.match(r"\d+", cpus).group()) if re.match(r"\d+", cpus) else 0
        p.cpus_per_node = min(p.cpus_per_node, cpus_value) if p.cpus_per_node else cpus_value
        p.available = p.available and avail.strip() == "up"
        for kind, count in parse_gres(gres).items():
            # nodes of one type may differ: a job can only count on the smallest
            p.gpus_per_node[kind] = min(p.gpus_per_node.get(kind, count), count)
    return list(parts.values())


def slurm_version():
    """(major, minor) of the installed Slurm CLI, or None."""
    try:
        out = subprocess.run(["sinfo", "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"(\d+)\.(\d+)", out)
    return (int(match.group(1)), int(match.group(2))) if match else None


def pyslurm_status() -> Tuple[bool, str]:
    """Whether pyslurm can be used here, and why (not)."""
    try:
        import pyslurm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a version mismatch raises at import
        return False, f"pyslurm does not import ({exc.__class__.__name__}: {exc}); using the Slurm CLI"
    version = getattr(pyslurm, "__version__", "")
    match = re.match(r"(\d+)\.(\d+)", version)
    installed = slurm_version()
    if not match or installed is None or (int(match.group(1)), int(match.group(2))) != installed:
        return False, f"pyslurm {version or '?'} does not match Slurm {installed}; using the Slurm CLI"
    return True, f"pyslurm {version} matches Slurm {installed[0]}.{installed[1]}"


def _partitions_pyslurm():
    import pyslurm

    nodes = pyslurm.Nodes.load()
    result = []
    for name, part in pyslurm.Partitions.load().items():
        p = Partition(name, available=str(getattr(part, "state", "UP")).upper() == "UP")
        for node_name in part.to_dict().get("nodes_list", []) or []:
            node = nodes.get(node_name)
            if node is None:
                continue
            p.nodes += 1
            p.cpus_per_node = min(p.cpus_per_node, node.total_cpus) if p.cpus_per_node else node.total_cpus
            gres = ",".join(f"{k}:{v}" for k, v in (node.configured_gres or {}).items())
            for kind, count in parse_gres(gres).items():
                p.gpus_per_node[kind] = min(p.gpus_per_node.get(kind, count), count)
        result.append(p)
    return result


def partitions(use_pyslurm: Optional[bool] = None) -> List[Partition]:
    """Every partition with its GPU types: pyslurm if usable, else ``sinfo``."""
    if use_pyslurm is None:
        use_pyslurm = pyslurm_status()[0]
    if use_pyslurm:
        return _partitions_pyslurm()
    if shutil.which("sinfo") is None:
        raise ConfigError("sinfo is not on PATH: run this on a Slurm login node (or `module load slurm`)")
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", SINFO_FORMAT], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise ConfigError("sinfo did not answer within 30 s: is slurmctld up? (scontrol ping)") from None
    if proc.returncode != 0:
        raise ConfigError(f"sinfo failed ({proc.returncode}): {proc.stderr.strip()}; is slurmctld up? (scontrol ping)")
    return parse_sinfo(proc.stdout)
