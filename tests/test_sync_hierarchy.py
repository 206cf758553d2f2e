"""Hierarchical mode sync: ranks on several nodes end with the parameters of one
process on the global batch, and each node's sum crosses between nodes once.

The nodes are named (EDDIS_HOSTNAME per rank, one smb-server per name), so a
rank maps only its own node's server and reaches the others through UCX, as
across real hosts; the same worker as tests/test_torch_equivalence.py trains.
The emulated cluster's tests (tests/test_cluster_sync.py) count the bytes on
real node links.
"""
import json

import pytest

from conftest import PYTHON, REPO
from eddis.smb.testing import LocalServers
from test_torch_equivalence import TOLERANCE

WORKER = REPO / "tests" / "test_torch_equivalence.py"
LAYOUTS = {  # name: node of each rank
    "2x2": ["hA", "hA", "hB", "hB"],
    "4x1": ["h0", "h1", "h2", "h3"],
    "2+1": ["hA", "hB", "hA"],  # unequal nodes: pieces are shared out unevenly
}
CONFIGS = ["sync,none,mlp,False", "sync,none,cnn,False", "sync,fp16,mlp,False", "sync,bf16,mlp,False",
           "sync,none,mlp,True", "sync:keepgrads,none,mlp,False"]
FLAT = "sync:server,none,mlp,False"   # the flat path, asked for: run last in the 2x2 launch
MESH = "sync:hierarchical,none,mlp,False"   # the mesh where auto takes the ring: last in the 4x1 launch
_runs = {}


def layout_results(run_mpi, layout):
    """One launch a layout (starting torch on every rank costs more than the training)."""
    if layout not in _runs:
        _runs[layout] = run_layout(run_mpi, layout, CONFIGS + [FLAT] * (layout == "2x2")
                                   + [MESH] * (layout == "4x1"))
    return _runs[layout]


def launch(run_mpi, hosts, configs, check=True):
    """The equivalence worker's ``configs`` on ``hosts`` (a node name per rank), one
    smb-server a node; returns the finished launch."""
    servers_hosts = list(dict.fromkeys(hosts))
    with LocalServers(len(servers_hosts), memory="64M", hostnames=servers_hosts) as servers:
        env = {"EDDIS_RUN_DIR": str(servers.run_dir), "EQUIV_FAKE_HOSTS": ",".join(hosts),
               "EQUIV_CONFIGS": ";".join(configs), "EDDIS_EMBEDDED_SERVER": "0"}
        return run_mpi(len(hosts), [PYTHON, WORKER], env=env, timeout=240, check=check)


def results_of(proc):
    return [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def run_layout(run_mpi, layout, configs):
    return results_of(launch(run_mpi, LAYOUTS[layout], configs))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hierarchical_sync_matches_one_process(run_mpi, layout):
    results = layout_results(run_mpi, layout)[:len(CONFIGS)]
    assert len(results) == len(CONFIGS), results
    for r in results:
        assert r["hierarchical"], f"ranks on several nodes must reduce hierarchically: {r}"
        # auto: a ring at one rank on each of 3 or more nodes, the mesh otherwise
        assert r["ring"] == (layout == "4x1"), r
        assert r["rank_spread"] == 0.0, f"ranks ended with different parameters: {r}"
        assert r["rel_error"] < TOLERANCE[r["compression"]], r
        assert r["buckets"] > 1, r
        # CPU buffers may move: with the mesh every rank's gradients live in its node slot while
        # training (the ring sums into the next node's server and keeps them where they are)
        assert r["in_slot"] == (not r["ring"]), r
        assert r["grads_follow"], f"gradients changed or stayed in SMB memory at close: {r}"


@pytest.mark.timeout(300)
def test_the_mesh_at_one_rank_a_node_when_asked(run_mpi):
    [r] = layout_results(run_mpi, "4x1")[len(CONFIGS):]
    assert r["hierarchical"] and not r["ring"] and r["in_slot"], r
    assert r["rank_spread"] == 0.0 and r["rel_error"] < TOLERANCE["none"], r


@pytest.mark.timeout(300)
def test_flat_path_still_there_when_asked(run_mpi):
    [r] = layout_results(run_mpi, "2x2")[len(CONFIGS):]
    assert not r["hierarchical"] and not r["by_ranks"], r
    assert r["rel_error"] < TOLERANCE["none"], r


@pytest.mark.timeout(300)
def test_hierarchy_on_one_node_when_forced(run_mpi):
    with LocalServers(1, memory="64M", hostnames=["hA"]) as servers:
        env = {"EDDIS_RUN_DIR": str(servers.run_dir), "EQUIV_FAKE_HOSTS": "hA,hA",
               "EQUIV_CONFIGS": "sync:hierarchical,none,mlp,False;sync:hierarchical,bf16,mlp,False"}
        proc = run_mpi(2, [PYTHON, WORKER], env=env, timeout=240, check=True)
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert [r["hierarchical"] for r in results] == [True, True], results
    for r in results:
        assert r["rel_error"] < TOLERANCE[r["compression"]], r


RING_CONFIGS = ["sync:ring,none,mlp,False", "sync:ring,none,mlp,True", "sync:ring,fp16,mlp,False",
                "sync:ring,bf16,cnn,False"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hosts", [["h0", "h1", "h2", "h3"], ["hA", "hB"]], ids=["4x1", "2x1"])
def test_ring_at_one_rank_a_node_matches_one_process(run_mpi, hosts):
    proc = launch(run_mpi, hosts, RING_CONFIGS)
    results = results_of(proc)
    assert len(results) == len(RING_CONFIGS), proc.stdout[-2000:]
    for r in results:
        assert r["ring"], f"EDDIS_SYNC_REDUCE=ring must build the ring: {r}"
        assert r["rank_spread"] == 0.0, f"ranks ended with different parameters: {r}"
        assert r["rel_error"] < TOLERANCE[r["compression"]], r
        assert r["buckets"] > 1, r


@pytest.mark.timeout(300)
def test_ring_refuses_a_node_with_two_ranks(run_mpi):
    proc = launch(run_mpi, ["hA", "hB", "hA"], ["sync:ring,none,mlp,False"], check=False)
    assert proc.returncode != 0
    assert "EDDIS_SYNC_REDUCE=ring" in proc.stderr + proc.stdout and "one rank a node" in proc.stderr + proc.stdout
