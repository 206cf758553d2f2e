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


@pytest.mark.timeout(300)
def test_hierarchical_sync_over_rdma_matches_one_process(run_mpi, monkeypatch):
    hosts = LAYOUTS["2x2"]
    rdma = {"SMB_TRANSPORT": "rdma"}
    with LocalServers(2, memory="64M", hostnames=list(dict.fromkeys(hosts)), env=rdma) as servers:
        env = {"EDDIS_RUN_DIR": str(servers.run_dir), "EQUIV_FAKE_HOSTS": ",".join(hosts),
               "EQUIV_CONFIGS": ";".join(CONFIGS), "EDDIS_EMBEDDED_SERVER": "0", **rdma}
        proc = run_mpi(len(hosts), [PYTHON, WORKER], env=env, timeout=240, check=True)
        monkeypatch.setenv("SMB_TRANSPORT", "socket")   # the observer: it moves no data
        with Client(servers.run_dir, expected_servers=2, timeout=20) as observer:
            stats = [observer.stats(s) for s in range(2)]
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(CONFIGS), proc.stdout[-3000:]
    for r in results:
        assert r["hierarchical"] and r["rank_spread"] == 0.0, r
        assert r["rel_error"] < TOLERANCE[r["compression"]], r
    for s in stats:
        assert s["transport"] == "rdma" and s["keys_given"] > 0, s
        assert s["put_bytes"] == 0 and s["get_bytes"] == 0, s
