"""Which transport an SMB job uses, and which UCX transports may carry its one-sided access.

- ``socket``: requests and data over one proven TCP connection per server (the gate of
  :mod:`eddis.smb.handshake`); the server's request loop checks and copies every byte.
- ``rdma``: the same proven connection carries the requests (counters, barriers,
  events, reductions) and, per region, the region's remote key; bulk put/get are
  one-sided UCX transfers into the registered region. UCX gets no listener, and only
  the transports of :func:`ucx_tls`: those of an HCA (InfiniBand, RoCE) and shared
  memory inside a node, never ``tcp`` (whose RMA checks no key: anyone connected could
  write anywhere) unless ``SMB_UCX_ALLOW_TCP=1``, which is for tests.
- ``auto`` (the setting's value, not a transport): ``rdma`` where every node of the job
  has an active InfiniBand or RoCE port that UCX can use, else ``socket``.

Each smb-server decides what it offers from its own node's facts (:func:`node_facts`,
the same facts ``eddis doctor`` reports); the job's transport follows from what every
server offers (:func:`job_transport`), so every client of the job computes the same
one, and the launcher records it in the run directory. The deciding functions are pure.
"""
from ..errors import ConfigError, SMBValueError

TRANSPORTS = ("socket", "rdma")
SETTING_VALUES = ("auto",) + TRANSPORTS
# UCX transports of an HCA (libibverbs; mlx5 direct verbs): one-sided access the HCA checks
HCA_TLS = ("rc_verbs", "rc_mlx5", "dc_mlx5", "ud_verbs", "ud_mlx5")
# inside a node: UCX's shared-memory transports (posix/sysv carry UCX's own traffic, cma,
# xpmem and knem the one-sided copies into registered memory) and its loopback
SHM_TLS = ("posix", "sysv", "cma", "xpmem", "knem", "self")
# GPUDirect (SMB_GPU_DIRECT): transfers from CUDA memory
CUDA_TLS = ("cuda_copy", "cuda_ipc", "gdr_copy")
TCP_TLS = ("tcp",)


def requested(value):
    """The SMB_TRANSPORT value ``value``, checked: auto, socket or rdma."""
    text = str(value).strip().lower()
    if text == "ucx":
        raise ConfigError(
            "SMB_TRANSPORT=ucx is gone: it gave UCX a listener that served one-sided access to "
            "any peer before it proved the job token. Use SMB_TRANSPORT=rdma (UCX reached only "
            "over the proven connection, with a key per region) or auto (rdma where every node "
            "has InfiniBand/RoCE, else socket)")
    if text not in SETTING_VALUES:
        raise ConfigError(f"SMB_TRANSPORT={value!r}: use one of {', '.join(SETTING_VALUES)}")
    return text


def hca_ports(verbs_report):
    """The active ports of an ``eddis._verbs.query()`` report that RDMA can use (InfiniBand
    or RoCE: link layer InfiniBand or Ethernet), as ``device:port (link layer)`` texts."""
    ports = []
    for device in verbs_report.get("devices", ()):
        for port in device.get("ports", ()):
            if port.get("active") and port.get("link_layer") in ("InfiniBand", "Ethernet"):
                layer = "RoCE" if port["link_layer"] == "Ethernet" else "InfiniBand"
                ports.append(f"{device.get('name')}:{port.get('port')} ({layer})")
    return ports


def offer(node):
    """(transport, why) a node can offer on its own: ``rdma`` when it has an active
    InfiniBand/RoCE port and UCX lists an HCA transport, else ``socket``. ``node``:
    {"node": name, "ports": [active port texts], "ucx": [UCX transport names],
    "finding": what the HCA query said when it found no port}."""
    name = node.get("node", "?")
    ports = list(node.get("ports") or ())
    hca = [t for t in node.get("ucx") or () if t in HCA_TLS]
    if not ports:
        finding = node.get("finding") or "no active InfiniBand or RoCE port"
        return "socket", f"node {name}: {finding}"
    if not hca:
        return "socket", (f"node {name} has {', '.join(ports)} but UCX lists no HCA transport "
                          f"(it lists {', '.join(node.get('ucx') or ()) or 'none'}): UCX built "
                          f"without verbs, or UCX_TLS/UCX_NET_DEVICES exclude it")
    return "rdma", f"node {name}: {', '.join(ports)} through UCX {', '.join(hca)}"


def choose(requested_value, nodes):
    """(transport, why) for a job on ``nodes`` (each as :func:`offer` takes it) when
    SMB_TRANSPORT is ``requested_value``. Never UCX over TCP: ``auto`` picks ``rdma`` only
    where every node has an HCA port that UCX can use."""
    want = requested(requested_value)
    if want != "auto":
        return want, f"SMB_TRANSPORT={want}"
    if not nodes:
        return "socket", "no node to judge"
    for node in nodes:
        transport, why = offer(node)
        if transport != "rdma":
            return "socket", f"auto: {why}"
    return "rdma", (f"auto: every node ({len(nodes)}) has an active InfiniBand/RoCE port that "
                    f"UCX can use")


def job_transport(requested_value, offers):
    """(transport, why) of a job whose servers offer ``offers`` ([(server index, offer,
    why)]), for a client whose SMB_TRANSPORT is ``requested_value``: ``rdma`` when every
    server offers it (and the client does not force ``socket``), else ``socket``;
    SMBValueError when the client forces ``rdma`` and a server does not offer it."""
    want = requested(requested_value)
    if want == "socket":
        return "socket", "SMB_TRANSPORT=socket"
    lacking = [(index, why) for index, transport, why in offers if transport != "rdma"]
    if not lacking:
        return "rdma", ("SMB_TRANSPORT=rdma" if want == "rdma" else
                        f"auto: every server ({len(offers)}) offers rdma")
    if want == "rdma":
        raise SMBValueError(
            f"SMB_TRANSPORT=rdma, but smb-server(s) {', '.join(str(i) for i, _ in lacking)} offer "
            f"the socket transport only ({lacking[0][1]}); start the servers with SMB_TRANSPORT=rdma "
            f"(or auto on InfiniBand/RoCE nodes), or set SMB_TRANSPORT=socket or auto for the clients")
    index, why = lacking[0]
    return "socket", f"auto: smb-server {index} offers socket only ({why})"


def ucx_tls(available, allow_tcp=False, gpu_direct=False):
    """The UCX transports (UCX_TLS value) SMB's one-sided access may use, of those UCX has
    here (``available``, names as ``ucx_info -d`` gives them): the HCA's, shared memory and
    loopback; CUDA's with ``gpu_direct``; ``tcp`` only with ``allow_tcp`` (tests). A user's
    UCX_TLS narrows what UCX reports as available, so it narrows this too."""
    allowed = HCA_TLS + SHM_TLS + (CUDA_TLS if gpu_direct else ()) + (TCP_TLS if allow_tcp else ())
    seen = []
    for name in available:
        if name in allowed and name not in seen:
            seen.append(name)
    return ",".join(seen)


def reports_lost_peers(tls):
    """Whether UCX can report a lost peer over the transports ``tls`` (a UCX_TLS value):
    those between nodes can; shared memory and loopback cannot (the proven socket does)."""
    return any(name in HCA_TLS + TCP_TLS for name in tls.split(","))


def node_facts(node_name):
    """This node's facts for :func:`offer`: its active HCA ports (libibverbs, as ``eddis
    doctor`` reports them) and the transports UCX lists. Never raises: a query that fails
    is the node's finding."""
    facts = {"node": node_name, "ports": [], "ucx": [], "finding": None}
    try:
        from .. import _verbs

        report = _verbs.query()
        facts["ports"] = hca_ports(report)
        facts["finding"] = report.get("finding")
    except Exception as exc:  # no libibverbs, or it failed: no RDMA here, and why
        facts["finding"] = f"the HCA query failed: {exc}"
    try:
        from . import _core

        facts["ucx"] = sorted({entry["transport"] for entry in _core.ucx_transports()})
    except Exception as exc:
        facts["finding"] = (facts["finding"] or "") + f"; UCX lists no transports: {exc}"
    return facts
