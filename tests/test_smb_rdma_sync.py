"""Mode sync over the rdma transport: 2 nodes x 2 ranks end with one process's parameters.

The worker of tests/test_torch_equivalence.py, launched as in tests/test_sync_hierarchy.py
(named nodes: a rank maps its own node's server and reaches the other one remotely), with
the servers and ranks on SMB_TRANSPORT=rdma: the cross-node pieces move one-sidedly over
UCX (here shared memory and CMA; this machine has no HCA). The servers' request loops
then carry no byte of data: their put/get byte counters stay at 0, while they gave keys.
tests/test_cluster_sync.py runs the same over UCX's tcp between network namespaces.
"""
import json

import pytest

from conftest import PYTHON
from eddis.smb import Client
from eddis.smb.testing import LocalServers
from test_sync_hierarchy import LAYOUTS, WORKER
from test_torch_equivalence import TOLERANCE

CONFIGS = ["sync,none,mlp,False", "sync,fp16,mlp,False"]


def train_over_rdma(run_mpi, monkeypatch, hosts):
    """The equivalence worker's CONFIGS on ``hosts`` (a node name per rank) over the rdma
    transport; returns its results and every server's stats."""
    rdma = {"SMB_TRANSPORT": "rdma"}
    nodes = list(dict.fromkeys(hosts))
    with LocalServers(len(nodes), memory="64M", hostnames=nodes, env=rdma) as servers:
        env = {"EDDIS_RUN_DIR": str(servers.run_dir), "EQUIV_FAKE_HOSTS": ",".join(hosts),
               "EQUIV_CONFIGS": ";".join(CONFIGS), "EDDIS_EMBEDDED_SERVER": "0", **rdma}
        proc = run_mpi(len(hosts), [PYTHON, WORKER], env=env, timeout=240, check=True)
        monkeypatch.setenv("SMB_TRANSPORT", "socket")   # the observer: it moves no data
        with Client(servers.run_dir, expected_servers=len(nodes), timeout=20) as observer:
            stats = [observer.stats(s) for s in range(len(nodes))]
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(CONFIGS), proc.stdout[-3000:]
    for r in results:
        assert r["rank_spread"] == 0.0 and r["rel_error"] < TOLERANCE[r["compression"]], r
    for s in stats:
        assert s["transport"] == "rdma" and s["keys_given"] > 0, s
        assert s["put_bytes"] == 0, s   # the data went one-sided, not through the request loop
    return results, stats


@pytest.mark.timeout(300)
def test_hierarchical_sync_over_rdma_matches_one_process(run_mpi, monkeypatch):
    results, stats = train_over_rdma(run_mpi, monkeypatch, LAYOUTS["2x2"])
    assert all(r["hierarchical"] and not r["ring"] for r in results), results
    assert all(s["get_bytes"] == 0 for s in stats), stats


@pytest.mark.timeout(300)
def test_ring_over_rdma_matches_one_process(run_mpi, monkeypatch):
    """One rank on each of 3 nodes: auto takes the ring, whose pieces are one-sided puts
    into the next node's server, each announced with a counter add once it is in."""
    results, _ = train_over_rdma(run_mpi, monkeypatch, ["h0", "h1", "h2"])
    assert all(r["ring"] for r in results), results
