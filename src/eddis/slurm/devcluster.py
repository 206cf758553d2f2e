"""What `scripts/eddis-dev-cluster up` built, and the byte counters of its node links.

The script records its cluster in the state directory (``EDDIS_DEV_CLUSTER_DIR``):
``cluster.env`` (``NET``, ``NODES``, ``LINK``, ``SUBNET``, ``BRIDGE``) and ``nodes``,
one line per node: name, host name, address, GPU type, bridge-side veth, network
namespace, link rate (``-`` for the last three in loopback mode; files of older
versions of the script have no rate column). ``LINK`` is ``EDDIS_DEV_CLUSTER_LINK``
in its canonical form: the default rate, then ``nK=RATE`` for each node whose link
differs (``1gbit,n1=unlimited``).

:func:`traffic` reads the interface statistics of each node's bridge-side veth
(readable by anyone, from the root namespace and from inside a node, whatever the
link rate), as seen from the node: ``tx`` bytes out of the node, ``rx`` bytes into
it. Take it before and after a job and subtract::

    before = devcluster.traffic()
    ...  # sbatch --wait ...
    sent = devcluster.difference(before, devcluster.traffic())

The counters include Ethernet, IP and TCP headers (about 66 bytes per 1448-byte
segment) and whatever else crossed the link at the time (Slurm's own messages:
a few kB per job step).
"""
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from .. import settings
from ..errors import ConfigError


@dataclass(frozen=True)
class Node:
    name: str
    hostname: str
    address: str
    gpu_type: str
    veth: Optional[str]  # bridge-side interface in the root namespace (netns mode)
    netns: Optional[str]
    link: Optional[str] = None  # its link rate: unlimited, 100mbit, 1gbit, 10gbit (netns mode)


def state_dir(path=None):
    return Path(path if path is not None else settings.get("EDDIS_DEV_CLUSTER_DIR")).resolve()


def config(path=None) -> Dict[str, str]:
    """The recorded configuration: NET, NODES, LINK, SUBNET, BRIDGE."""
    record = state_dir(path) / "cluster.env"
    try:
        text = record.read_text()
    except OSError:
        raise ConfigError(f"no dev cluster at {record.parent} ({record.name} is missing): start it with "
                          "scripts/eddis-dev-cluster up (EDDIS_DEV_CLUSTER_DIR names its state directory)") from None
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def nodes(path=None) -> List[Node]:
    table = state_dir(path) / "nodes"
    try:
        lines = table.read_text().splitlines()
    except OSError:
        raise ConfigError(f"no dev cluster at {table.parent} ({table.name} is missing): start it with "
                          "scripts/eddis-dev-cluster up") from None
    found = []
    old_link = None  # a nodes file without the rate column: every link has the recorded LINK
    for line in lines:
        fields = line.split()
        if len(fields) == 6 and fields[4] != "-":
            if old_link is None:
                try:
                    old_link = config(path).get("LINK", "unlimited").split(",")[0] or "unlimited"
                except ConfigError:
                    old_link = ""
            fields.append(old_link or "-")
        elif len(fields) == 6:
            fields.append("-")
        if len(fields) != 7:
            continue
        name, host, addr, gpu = fields[:4]
        veth, ns, link = (None if f == "-" else f for f in fields[4:])
        found.append(Node(name, host, addr, gpu, veth, ns, link))
    return found


def traffic(path=None) -> Dict[str, Dict[str, int]]:
    """{node: {"tx": bytes out of the node, "rx": bytes into it}} of every node link now."""
    mode = config(path).get("NET", "loopback")
    if mode != "netns":
        raise ConfigError(f"the dev cluster at {state_dir(path)} runs in network mode {mode}: its nodes have "
                          "no links to count; rebuild it with EDDIS_DEV_CLUSTER_NET=netns "
                          "scripts/eddis-dev-cluster up")
    counters = {}
    for node in nodes(path):
        stats = Path("/sys/class/net") / node.veth / "statistics"
        try:
            # the bridge side receives what the node sends, and sends what it receives
            counters[node.name] = {"tx": int((stats / "rx_bytes").read_text()),
                                   "rx": int((stats / "tx_bytes").read_text())}
        except (OSError, ValueError):
            raise ConfigError(f"the link {node.veth} of {node.name} is gone ({stats} unreadable): the dev "
                              "cluster is broken; run scripts/eddis-dev-cluster up again") from None
    return counters


def difference(before, after) -> Dict[str, Dict[str, int]]:
    """after - before, per node and direction."""
    return {name: {k: after[name][k] - before.get(name, {}).get(k, 0) for k in ("tx", "rx")}
            for name in after}


if __name__ == "__main__":  # python -m eddis.slurm.devcluster: the counters as JSON
    import json
    import sys

    try:
        print(json.dumps(traffic()))
    except ConfigError as exc:
        sys.exit(f"eddis.slurm.devcluster: {exc}")
