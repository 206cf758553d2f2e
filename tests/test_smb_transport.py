"""Which transport a job gets (eddis.smb.transport): pure functions, from given facts."""
import pytest

from eddis.errors import ConfigError, SMBValueError
from eddis.smb import transport

IB = {"devices": [{"name": "mlx5_0", "ports": [
    {"port": 1, "active": True, "link_layer": "InfiniBand", "state": "PORT_ACTIVE"}]}], "finding": None}
ROCE = {"devices": [{"name": "mlx5_1", "ports": [
    {"port": 1, "active": True, "link_layer": "Ethernet", "state": "PORT_ACTIVE"}]}], "finding": None}
DOWN = {"devices": [{"name": "mlx5_0", "ports": [
    {"port": 1, "active": False, "link_layer": "InfiniBand", "state": "PORT_DOWN"}]}], "finding": None}
NO_HCA = {"devices": [], "finding": "no HCA found: ibv_get_device_list returned NULL with ENOSYS"}
UCX_IB = ["self", "tcp", "sysv", "posix", "cma", "rc_verbs", "ud_verbs", "rc_mlx5", "dc_mlx5"]
UCX_HERE = ["self", "tcp", "sysv", "posix", "cma"]     # this machine: no HCA transport


def node(name, verbs, ucx):
    return {"node": name, "ports": transport.hca_ports(verbs), "ucx": ucx, "finding": verbs["finding"]}


def test_active_infiniband_and_roce_ports_count_and_down_ones_do_not():
    assert transport.hca_ports(IB) == ["mlx5_0:1 (InfiniBand)"]
    assert transport.hca_ports(ROCE) == ["mlx5_1:1 (RoCE)"]
    assert transport.hca_ports(DOWN) == [] and transport.hca_ports(NO_HCA) == []


def test_auto_picks_rdma_only_where_every_node_has_a_port_ucx_can_use():
    ib = [node("n1", IB, UCX_IB), node("n2", ROCE, UCX_IB)]
    assert transport.choose("auto", ib)[0] == "rdma"
    for odd, words in ((node("n3", NO_HCA, UCX_HERE), "node n3: no HCA found"),
                       (node("n3", DOWN, UCX_IB), "node n3: no active InfiniBand or RoCE port"),
                       (node("n3", IB, UCX_HERE), "UCX lists no HCA transport")):
        choice, why = transport.choose("auto", ib + [odd])
        assert choice == "socket" and words in why, why
    assert transport.choose("auto", [])[0] == "socket"


def test_auto_never_picks_ucx_over_tcp_and_forced_values_are_kept():
    here = [node("n1", NO_HCA, UCX_HERE), node("n2", NO_HCA, UCX_HERE)]
    assert transport.choose("auto", here)[0] == "socket"
    assert transport.choose("rdma", here) == ("rdma", "SMB_TRANSPORT=rdma")
    assert transport.choose("socket", [node("n1", IB, UCX_IB)]) == ("socket", "SMB_TRANSPORT=socket")
    # the transports rdma may use: no tcp, unless the test setting allows it
    assert transport.ucx_tls(UCX_IB) == "self,sysv,posix,cma,rc_verbs,ud_verbs,rc_mlx5,dc_mlx5"
    assert "tcp" not in transport.ucx_tls(UCX_HERE).split(",")
    assert transport.ucx_tls(["tcp"]) == ""
    assert transport.ucx_tls(UCX_HERE, allow_tcp=True) == "self,tcp,sysv,posix,cma"
    assert transport.ucx_tls(UCX_HERE + ["cuda_copy", "cuda_ipc"]) == "self,sysv,posix,cma"
    assert transport.ucx_tls(UCX_HERE + ["cuda_copy", "cuda_ipc"], gpu_direct=True).endswith(",cuda_copy,cuda_ipc")


def test_ucx_reports_lost_peers_only_between_nodes():
    assert transport.reports_lost_peers("rc_mlx5,posix") and transport.reports_lost_peers("tcp")
    assert not transport.reports_lost_peers("self,sysv,posix,cma")


def test_the_job_follows_what_every_server_offers():
    both = [(0, "rdma", "node a: mlx5_0:1"), (1, "rdma", "node b: mlx5_0:1")]
    mixed = [(0, "rdma", "node a: mlx5_0:1"), (1, "socket", "node b: no HCA found")]
    assert transport.job_transport("auto", both)[0] == "rdma"
    choice, why = transport.job_transport("auto", mixed)
    assert choice == "socket" and "smb-server 1" in why and "no HCA" in why
    assert transport.job_transport("socket", both)[0] == "socket"
    assert transport.job_transport("rdma", both)[0] == "rdma"
    with pytest.raises(SMBValueError, match=r"smb-server\(s\) 1 offer the socket transport only"):
        transport.job_transport("rdma", mixed)


def test_the_removed_ucx_value_is_refused_with_its_replacement():
    with pytest.raises(ConfigError, match="SMB_TRANSPORT=rdma"):
        transport.requested("ucx")
    with pytest.raises(ConfigError, match="auto, socket, rdma"):
        transport.requested("verbs")
    assert transport.requested(" RDMA ") == "rdma"


def test_the_record_follows_the_servers_offers(tmp_path):
    from eddis.smb import rundir

    records = [{"index": 0, "transport": "rdma", "transport_reason": "node a: mlx5_0:1 (InfiniBand)"},
               {"index": 1, "transport": "socket", "transport_reason": "node b: no HCA found"}]
    chosen = rundir.record_transport(tmp_path, records, requested="auto")
    assert chosen["transport"] == "socket" and "smb-server 1" in chosen["reason"]
    assert rundir.read_transport(tmp_path) == chosen
    assert rundir.record_transport(tmp_path, records[:1], requested="auto")["transport"] == "rdma"
    with pytest.raises(SMBValueError, match="start the servers with SMB_TRANSPORT=rdma"):
        rundir.record_transport(tmp_path, records, requested="rdma")
    assert rundir.read_transport(tmp_path / "none") is None


READ_RECORD = """
import json, os, pathlib
print("RECORD", (pathlib.Path(os.environ["EDDIS_RUN_DIR"]) / "smb-transport.json").read_text().strip())
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("requested", ["auto", "rdma"])
def test_a_local_job_records_its_transport_once_before_the_ranks_start(tmp_path, requested):
    """eddis-train --local: on this machine (no HCA) auto gives socket and says why; a
    forced rdma is kept (over shared memory inside the node)."""
    import json
    import subprocess
    import sys

    from conftest import python_env

    script = tmp_path / "train.py"
    script.write_text(READ_RECORD)
    env = python_env({"EDDIS_RUN_DIR": str(tmp_path / "run"), "SMB_MEMORY": "8M", "SMB_TRANSPORT": requested})
    proc = subprocess.run([sys.executable, "-m", "eddis.launch.train", "--local", "-n", "1", str(script)],
                          env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [line for line in proc.stdout.splitlines() if "RECORD " in line]   # "[0@host] RECORD ..."
    record = json.loads(line.split("RECORD ", 1)[1])
    if requested == "auto" and not transport.hca_ports(_verbs_report()):
        assert record["transport"] == "socket" and "smb-server 0 offers socket only" in record["reason"]
        assert "no HCA found" in record["reason"]
    if requested == "rdma":
        assert record == {"transport": "rdma", "reason": "SMB_TRANSPORT=rdma",
                          "servers": [[0, "rdma", "SMB_TRANSPORT=rdma"]]}
    assert f"smb transport {record['transport']}: " in proc.stdout


def _verbs_report():
    from eddis import _verbs

    return _verbs.query()
