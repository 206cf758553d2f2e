"""The planner's inputs: the cluster and the model, read from JSON and checked field by field.

Two small files (docs/plan.md has the schema with an example of each):

- ``cluster.json`` (``"format": "eddis-plan-cluster/1"``): the nodes and their ranks'
  speeds, the link of each node, the SMB transport's rates, the PCIe staging rate;
- ``model.json`` (``"format": "eddis-plan-model/1"``): the gradient's buckets (bytes and
  when each is ready in the backward pass), the local batch, the share of a step after
  the backward pass, and what is known of the samples to a target.

Every rate is kept in bytes per second and every time in seconds here; the files use
the units people quote (Gbit/s for links, GB/s = 1e9 bytes/s for the rest). A bad
field is a :class:`~eddis.errors.ConfigError` that names the file, the field, what is
wrong and how to fix it.
"""
import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, Optional, Tuple

from ..errors import ConfigError

CLUSTER_FORMAT = "eddis-plan-cluster/1"
MODEL_FORMAT = "eddis-plan-model/1"
# The share of an Ethernet link's line rate that a TCP stream carries as payload
# (1448 payload bytes in a 1514-byte frame): a 1gbit dev-cluster link moves 119.6 MB/s.
TCP_PAYLOAD_SHARE = 1448 / 1514
RATE_UNITS = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "tbit": 1e12}


@dataclass(frozen=True)
class Rank:
    """One rank: its own speed on this model (samples/s alone, no communication), or a
    relative ``speed`` that the model's ``compute_s_per_sample`` turns into one."""
    samples_per_s: Optional[float] = None
    speed: Optional[float] = None
    kind: str = "rank"


@dataclass(frozen=True)
class Node:
    name: str
    ranks: Tuple[Rank, ...]
    link_bps: float          # payload bytes/s the node's link carries each way
    latency_s: float = 0.0   # one message across the link


@dataclass(frozen=True)
class Cluster:
    nodes: Tuple[Node, ...]
    put_bps: Optional[float] = None     # SMB put into one server, bytes/s (None: not a limit)
    get_bps: Optional[float] = None     # SMB get from one server
    reduce_bps: Optional[float] = None  # bytes of input summed per second (a server's reduce, a rank's node sum)
    # what sync's ring through the servers carries a node and way (one stream into each server,
    # where the mesh's puts and gets have k-1; None: the put rate)
    smb_ring_bps: Optional[float] = None
    pcie_bps: Optional[float] = None    # device <-> host staging per rank (None: the gradients are in host memory)
    cast_bps: Optional[float] = None    # fp32 bytes cast to fp16/bf16 (or back) per second per rank
    intra_bps: Optional[float] = None   # between two ranks of one node (ring and MPI hops inside a node)
    # what a collective of the peers carries a node and way across the link under its own
    # traffic pattern (a probe's bus bandwidth): caps the link for that path
    mpi_bps: Optional[float] = None     # MPI allreduce
    ring_bps: Optional[float] = None    # the ring allreduce (DDP, NCCL)
    source: str = ""

    @property
    def ranks(self):
        return [r for node in self.nodes for r in node.ranks]

    @property
    def size(self):
        return sum(len(node.ranks) for node in self.nodes)

    @property
    def num_nodes(self):
        return len(self.nodes)

    def node_of_ranks(self):
        return [j for j, node in enumerate(self.nodes) for _ in node.ranks]

    def with_nodes(self, count):
        """The same cluster with ``count`` nodes: its node pattern repeated (or cut)."""
        if count < 1:
            raise ConfigError(f"--nodes must be at least 1, got {count}")
        pattern = self.nodes
        nodes = [pattern[j % len(pattern)] for j in range(count)]
        # the repeats get names of their own: a node's name says which one it is in the tables
        nodes = [n if j < len(pattern) else replace(n, name=f"{n.name}.{j // len(pattern)}")
                 for j, n in enumerate(nodes)]
        return replace(self, nodes=tuple(nodes))

    def with_link(self, bits_per_s=None, latency_s=None, payload_share=TCP_PAYLOAD_SHARE):
        nodes = tuple(replace(n, link_bps=n.link_bps if bits_per_s is None else bits_per_s * payload_share / 8,
                              latency_s=n.latency_s if latency_s is None else latency_s) for n in self.nodes)
        return replace(self, nodes=nodes)


@dataclass(frozen=True)
class Bucket:
    nbytes: int     # fp32 gradient bytes
    ready: float    # share of the forward and backward pass done when its gradient is complete, (0, 1]


@dataclass(frozen=True)
class Workload:
    """The model's side: what a step computes and what it communicates."""
    buckets: Tuple[Bucket, ...]
    local_batch: int
    update_share: float = 0.0                  # share of a rank's solo step after the backward pass
    compute_s_per_sample: Optional[float] = None   # at speed 1 (ranks given by speed)
    samples_to_target: Optional[float] = None      # of one big batch (mode sync, DDP)
    sample_efficiency: Dict[str, float] = field(default_factory=dict)  # mode: sync's samples / the mode's
    efficiency_tau: Optional[int] = None       # the tau the elastic efficiencies were measured at
    name: str = "model"

    @property
    def gradient_bytes(self):
        return sum(b.nbytes for b in self.buckets)


# ---------------------------------------------------------------- parsing helpers
def parse_rate(text, what="link rate"):
    """Bits per second from ``200gbit``, ``100mbit``, ``1.5gbit`` or a number of Gbit/s."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text) * 1e9
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]+)?\s*", str(text).lower())
        if not m or (m.group(2) or "gbit") not in RATE_UNITS:
            raise ConfigError(f"{what} {text!r} is not a rate; write it as e.g. 200gbit, 10gbit, 100mbit "
                              "(or a number of Gbit/s)")
        value = float(m.group(1)) * RATE_UNITS[m.group(2) or "gbit"]
    if not value > 0 or math.isinf(value):
        raise ConfigError(f"{what} {text!r} must be a positive, finite rate (e.g. 200gbit)")
    return value


class _Fields:
    """Reads one JSON object's fields, naming ``where`` in every error."""

    def __init__(self, data, where):
        if not isinstance(data, dict):
            raise ConfigError(f"{where} must be a JSON object ({{...}}), got {type(data).__name__}")
        self.data, self.where = data, where

    def fail(self, name, problem, fix):
        raise ConfigError(f"{self.where}.{name}: {problem}; {fix}")

    def number(self, name, default=None, required=False, low=0.0, high=None, low_open=True, fix=""):
        if name not in self.data or self.data[name] is None:
            if required:
                self.fail(name, "missing", fix or f"add \"{name}\"")
            return default
        value = self.data[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            self.fail(name, f"{value!r} is not a number", fix or f"give \"{name}\" a number")
        too_low = value <= low if low_open else value < low
        if (low is not None and too_low) or (high is not None and value > high) or math.isinf(value):
            bounds = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")
            self.fail(name, f"{value!r} is out of range", fix or f"it must be {bounds}")
        return float(value)

    def integer(self, name, default=None, required=False, low=1, fix=""):
        value = self.number(name, default, required, low=low, low_open=False, fix=fix)
        if value is not None and value != int(value):
            self.fail(name, f"{value!r} is not a whole number", fix or f"give \"{name}\" a whole number")
        return None if value is None else int(value)

    def gbs(self, name):
        """A rate in GB/s (1e9 bytes/s), as bytes/s; absent: None (not a limit)."""
        value = self.number(name, fix=f"\"{name}\" is in GB/s (1e9 bytes/s), > 0; leave it out if it is no limit")
        return None if value is None else value * 1e9

    def text(self, name, default=""):
        value = self.data.get(name, default)
        if not isinstance(value, str):
            self.fail(name, f"{value!r} is not a string", f"give \"{name}\" as a string")
        return value

    def items(self, name, required=True):
        value = self.data.get(name)
        if value is None and not required:
            return []
        if not isinstance(value, list) or not value:
            self.fail(name, "missing or not a non-empty list", f"give \"{name}\" as a list [...] with one entry "
                      "or more (docs/plan.md has an example)")
        return value

    def unknown(self, known):
        extra = sorted(set(self.data) - set(known))
        if extra:
            self.fail(extra[0], "unknown field", f"known fields: {', '.join(sorted(known))} (a typo?)")

    def check_format(self, expected):
        got = self.data.get("format")
        if got != expected:
            raise ConfigError(f"{self.where}.format: {got!r} is not {expected!r}; start the file with "
                              f"\"format\": \"{expected}\" (is this the other of the two plan files?)")


def _link(fields, base=None):
    """(payload bytes/s, latency s) from a ``link`` object; ``base`` fills what it leaves out."""
    fields.unknown({"rate", "latency_us", "payload_share"})
    if "rate" not in fields.data:
        if base is None:
            fields.fail("rate", "missing", "give the link's line rate, e.g. \"rate\": \"200gbit\"")
        payload = base[0]
    else:
        share = fields.number("payload_share", TCP_PAYLOAD_SHARE, high=1.0)
        payload = parse_rate(fields.data["rate"], f"{fields.where}.rate") * share / 8
    latency = fields.number("latency_us", None if base is not None else 0.0, low=0.0, low_open=False)
    return payload, (base[1] if latency is None else latency * 1e-6)


def _rank(data, where):
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        data = {"samples_per_s": data}
    f = _Fields(data, where)
    f.unknown({"samples_per_s", "speed", "kind"})
    rate = f.number("samples_per_s")
    speed = f.number("speed")
    if (rate is None) == (speed is None):
        f.fail("samples_per_s", "give exactly one of samples_per_s and speed",
               "samples_per_s: the rank's own samples/s on this model (no communication); speed: a relative "
               "speed that the model's compute_s_per_sample turns into samples/s")
    return Rank(samples_per_s=rate, speed=speed, kind=f.text("kind", "rank"))


def cluster_from_dict(data, where="cluster.json"):
    f = _Fields(data, where)
    f.check_format(CLUSTER_FORMAT)
    f.unknown({"format", "link", "smb", "pcie_gbs", "cast_gbs", "intra_gbs", "mpi_gbs", "ring_gbs", "nodes",
               "source"})
    if "link" not in data:
        f.fail("link", "missing", "give the nodes' link, e.g. \"link\": {\"rate\": \"200gbit\", \"latency_us\": 2}")
    default_link = _link(_Fields(data["link"], f"{where}.link"))
    smb = _Fields(data.get("smb", {}), f"{where}.smb")
    smb.unknown({"put_gbs", "get_gbs", "reduce_gbs", "ring_gbs"})
    nodes = []
    for i, entry in enumerate(f.items("nodes")):
        nf = _Fields(entry, f"{where}.nodes[{i}]")
        nf.unknown({"count", "name", "ranks", "samples_per_s", "speed", "kind", "link"})
        count = nf.integer("count", 1)
        link = default_link if "link" not in entry else _link(_Fields(entry["link"], f"{nf.where}.link"),
                                                              default_link)
        ranks = entry.get("ranks")
        if isinstance(ranks, list):
            if not ranks:
                nf.fail("ranks", "an empty list", "a node needs one rank or more")
            extra = {"samples_per_s", "speed", "kind"} & set(entry)
            if extra:
                nf.fail(sorted(extra)[0], "given beside a list of ranks",
                        "give it in each rank of the list, or give \"ranks\" as a number")
            parsed = tuple(_rank(r, f"{nf.where}.ranks[{m}]") for m, r in enumerate(ranks))
        else:
            per_node = nf.integer("ranks", required=True,
                                  fix="give \"ranks\" as a number of ranks (with samples_per_s or speed "
                                      "beside it) or as a list of ranks")
            one = _rank({k: entry[k] for k in ("samples_per_s", "speed", "kind") if k in entry}, nf.where)
            parsed = (one,) * per_node
        name = nf.text("name", "")
        for c in range(count):
            label = name or f"n{len(nodes) + 1}"
            nodes.append(Node(label if count == 1 or not name else f"{name}{c + 1}", parsed, *link))
    return Cluster(nodes=tuple(nodes), put_bps=smb.gbs("put_gbs"), get_bps=smb.gbs("get_gbs"),
                   reduce_bps=smb.gbs("reduce_gbs"), smb_ring_bps=smb.gbs("ring_gbs"),
                   pcie_bps=f.gbs("pcie_gbs"), cast_bps=f.gbs("cast_gbs"),
                   intra_bps=f.gbs("intra_gbs"), mpi_bps=f.gbs("mpi_gbs"), ring_bps=f.gbs("ring_gbs"),
                   source=f.text("source"))


def model_from_dict(data, where="model.json"):
    f = _Fields(data, where)
    f.check_format(MODEL_FORMAT)
    f.unknown({"format", "name", "buckets", "local_batch", "update_share", "compute_s_per_sample",
               "samples_to_target", "sample_efficiency", "efficiency_tau", "source"})
    buckets = []
    for i, entry in enumerate(f.items("buckets")):
        bf = _Fields(entry, f"{where}.buckets[{i}]")
        bf.unknown({"bytes", "ready"})
        nbytes = bf.integer("bytes", required=True, fix="give the bucket's fp32 gradient bytes, > 0")
        ready = bf.number("ready", 1.0, high=1.0,
                          fix="\"ready\" is the share of the forward and backward pass done when the "
                              "bucket's gradient is complete: > 0 and <= 1")
        buckets.append(Bucket(nbytes, ready))
    efficiency = data.get("sample_efficiency", {})
    ef = _Fields(efficiency, f"{where}.sample_efficiency")
    from .modes import MODES

    ef.unknown(set(MODES))
    eff = {mode: ef.number(mode, high=None,
                           fix="the mode's sample efficiency: sync's samples to the target over the mode's "
                               "(e.g. 0.8 when it needs 1.25x the samples), > 0")
           for mode in efficiency}
    return Workload(
        buckets=tuple(buckets), local_batch=f.integer("local_batch", required=True,
                                                      fix="give the samples per rank and step"),
        update_share=f.number("update_share", 0.0, low=0.0, high=0.9, low_open=False,
                              fix="the share of a rank's solo step after its backward pass (the "
                                  "optimizer's update), >= 0 and <= 0.9"),
        compute_s_per_sample=f.number("compute_s_per_sample"),
        samples_to_target=f.number("samples_to_target"),
        sample_efficiency=eff, efficiency_tau=f.integer("efficiency_tau"),
        name=f.text("name", "model"))


def check_pair(cluster, workload, where="cluster.json"):
    """What the two files need of each other: ranks given by speed need compute_s_per_sample."""
    if any(r.samples_per_s is None for r in cluster.ranks) and workload.compute_s_per_sample is None:
        raise ConfigError(f"{where}: some ranks are given by \"speed\", so the model needs "
                          "\"compute_s_per_sample\" (seconds a sample takes at speed 1, forward, backward "
                          "and update); add it to model.json or give the ranks' samples_per_s")


def load_json(path, parse):
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; `eddis plan --calibrate` writes one, docs/plan.md "
                          "shows the schema") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                          "fix the syntax") from None
    return parse(data, str(path))


def load_cluster(path):
    return load_json(path, cluster_from_dict)


def load_model(path):
    return load_json(path, model_from_dict)


# ---------------------------------------------------------------- writing
def _gbs(bps):
    return None if bps is None else bps / 1e9


def cluster_to_dict(cluster):
    """The JSON form (one node entry per node, rates as the files quote them)."""
    first = cluster.nodes[0]

    def link(node):
        return {"rate": f"{node.link_bps * 8 / TCP_PAYLOAD_SHARE / 1e9:.6g}gbit",
                "latency_us": node.latency_s * 1e6}

    def rank(r):
        out = {"samples_per_s": r.samples_per_s} if r.samples_per_s is not None else {"speed": r.speed}
        return dict(out, kind=r.kind)

    nodes = []
    for node in cluster.nodes:
        entry = {"name": node.name, "ranks": [rank(r) for r in node.ranks]}
        if (node.link_bps, node.latency_s) != (first.link_bps, first.latency_s):
            entry["link"] = link(node)
        nodes.append(entry)
    smb = {k: _gbs(v) for k, v in (("put_gbs", cluster.put_bps), ("get_gbs", cluster.get_bps),
                                    ("reduce_gbs", cluster.reduce_bps), ("ring_gbs", cluster.smb_ring_bps))
           if v is not None}
    out = {"format": CLUSTER_FORMAT, "link": link(first), "smb": smb, "nodes": nodes, "source": cluster.source}
    for key, value in (("pcie_gbs", cluster.pcie_bps), ("cast_gbs", cluster.cast_bps),
                       ("intra_gbs", cluster.intra_bps), ("mpi_gbs", cluster.mpi_bps),
                       ("ring_gbs", cluster.ring_bps)):
        if value is not None:
            out[key] = _gbs(value)
    return out


def model_to_dict(workload):
    out = {"format": MODEL_FORMAT, "name": workload.name, "local_batch": workload.local_batch,
           "buckets": [{"bytes": b.nbytes, "ready": round(b.ready, 4)} for b in workload.buckets],
           "update_share": round(workload.update_share, 4)}
    for key in ("compute_s_per_sample", "samples_to_target", "efficiency_tau"):
        if getattr(workload, key) is not None:
            out[key] = getattr(workload, key)
    if workload.sample_efficiency:
        out["sample_efficiency"] = dict(workload.sample_efficiency)
    return out
