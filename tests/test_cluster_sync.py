"""Mode sync on the emulated cluster: nodes that are network hosts of their own.

A private netns dev cluster of 4 nodes (scripts/eddis-dev-cluster, unlimited
links) runs real Slurm jobs (the EDDIS job script: one smb-server per node,
``srun --mpi=pmix eddis-train``) on 2 nodes x 2 ranks and 4 nodes x 1 rank:

- the parameters equal one process's on the global batch (the worker of
  tests/test_torch_equivalence.py), with the hierarchy in use;
- the bytes that the steps put on each node's link (its counters, read while
  every rank waits at a barrier) are within 10 % of ``2 (k-1)/k`` of the
  gradient bytes each way for k nodes (halved with fp16 on the wire), and at
  least that: the traffic went through the links. The flat path sends
  ``2 r (k-1)/k``; mode allreduce (MPI's non-blocking allreduce, out of place) the
  hierarchy's ``2 (k-1)/k``, where the in-place one took another algorithm that sent twice
  that here at 2 x 2 (1.5 S in bench/cluster.py's 2 x 2).
  Counts, never timings.
"""
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import DEV_CLUSTER, PYTHON, REPO, SRC, python_env
from test_dev_cluster import free_port_base
from test_torch_equivalence import TOLERANCE

pytestmark = [pytest.mark.netns, pytest.mark.slurm]
LAYOUTS = {"2x2": (2, 2), "4x1": (4, 1)}


@pytest.fixture(scope="module")
def cluster4():
    state = Path(tempfile.mkdtemp(prefix="eddis-hier-test-", dir="/tmp")) / "cluster"
    os.chmod(state.parent, 0o755)
    env = python_env({"EDDIS_DEV_CLUSTER_DIR": str(state), "EDDIS_DEV_CLUSTER_PORT": str(free_port_base(36817)),
                      "EDDIS_DEV_CLUSTER_NET": "netns", "EDDIS_DEV_CLUSTER_NODES": "4",
                      "EDDIS_DEV_CLUSTER_LINK": "unlimited", "SLURM_CONF": str(state / "slurm.conf")})
    env["PATH"] = f"{Path(PYTHON).parent}:{env['PATH']}"
    up = subprocess.run([str(DEV_CLUSTER), "up"], env=env, capture_output=True, text=True, timeout=180)
    if up.returncode != 0:
        pytest.fail(f"a 4-node netns dev cluster did not come up:\n{up.stdout}\n{up.stderr}", pytrace=False)
    yield env
    subprocess.run([str(DEV_CLUSTER), "down"], env=env, capture_output=True, text=True, timeout=180)
    shutil.rmtree(state.parent, ignore_errors=True)


def run_job(env, layout, command, extra=None, timeout=300):
    from eddis.slurm.script import JobComponent, render_job_script

    nodes, ranks = LAYOUTS[layout]
    work = Path(tempfile.mkdtemp(prefix="eddis-hier-job-", dir="/tmp"))
    os.chmod(work, 0o755)
    out = work / "job.out"
    script = work / "job.sh"
    script.write_text(render_job_script(components=[JobComponent("all", nodes=nodes, tasks_per_node=ranks)],
                                        command=command, output=str(out), time="00:10:00"))
    job_env = dict(env, PYTHONPATH=str(SRC), **(extra or {}))
    proc = subprocess.run(["sbatch", "--wait", str(script)], env=job_env, capture_output=True, text=True,
                          timeout=timeout, cwd=str(work))
    text = out.read_text() if out.exists() else ""
    shutil.rmtree(work, ignore_errors=True)
    assert proc.returncode == 0, f"job failed ({proc.returncode}):\n{proc.stderr}\n{text[-4000:]}"
    return text


def tagged(text, tag):
    return [json.loads(m.group(1)) for m in re.finditer(rf"{tag} (\{{.*\}})", text)]


CASES = {"2x2": "none:auto,fp16:auto,none:server,none:allreduce", "4x1": "none:auto,none:server,none:allreduce"}
EQUIV = "sync,none,mlp,False;sync,fp16,mlp,False;sync,bf16,mlp,False;sync,none,cnn,True"
_jobs = {}


def layout_job(env, layout):
    """One job a layout: the equivalence configurations, then the link-bytes cases."""
    if layout not in _jobs:
        text = run_job(env, layout, [PYTHON, str(REPO / "tests" / "launch_scripts" / "sync_link_bytes.py")],
                       {"EQUIV_CONFIGS": EQUIV, "LINK_BYTES_CASES": CASES[layout]})
        _jobs[layout] = (tagged(text, "RESULT"), tagged(text, "BYTES"), text)
    return _jobs[layout]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sync_across_hosts_matches_one_process(cluster4, layout):
    results, _, text = layout_job(cluster4, layout)
    assert len(results) == 4, text[-3000:]
    for r in results:
        assert r["hierarchical"] and r["ranks"] == 4, r
        assert r["rank_spread"] == 0.0, r
        assert r["rel_error"] < TOLERANCE[r["compression"]], r


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout,case", [(layout, case) for layout in sorted(CASES)
                                         for case in CASES[layout].split(",")])
def test_a_step_crosses_each_link_as_the_scheme_says(cluster4, layout, case):
    nodes, ranks = LAYOUTS[layout]
    compression, path = case.split(":")
    _, measured, text = layout_job(cluster4, layout)
    [found] = [m for m in measured if (m["compression"], m["path"]) == (compression, path)] or [None]
    assert found is not None, text[-3000:]
    assert found["hierarchical"] == (path == "auto"), found
    wire = found["gradient_bytes"] * (0.5 if compression == "fp16" else 1.0) * found["steps"]
    # hierarchical and MPI's allreduce: 2 (k-1)/k of the wire bytes each way; flat: every
    # rank's slot, 2 r (k-1)/k
    expected = wire * 2 * (nodes - 1) / nodes * (ranks if path == "server" else 1)
    for node, moved in found["nodes"].items():
        if node not in [f"n{i}" for i in range(1, nodes + 1)]:
            assert moved["tx"] < 1e6 and moved["rx"] < 1e6, (node, moved)  # not in the job
            continue
        for way in ("tx", "rx"):
            assert 0.98 * expected <= moved[way] <= 1.10 * expected, (node, way, moved[way] / wire, found)


@pytest.mark.timeout(400)
def test_sync_over_rdma_between_hosts_matches_one_process(cluster4):
    """The rdma transport between network hosts: one-sided UCX, here over its tcp transport
    with the test-only SMB_UCX_ALLOW_TCP=1 (no HCA on these machines); the job records rdma
    and every server's start line calls the setting unsafe."""
    rdma = {"SMB_TRANSPORT": "rdma", "SMB_UCX_ALLOW_TCP": "1", "UCX_TLS": "tcp",
            "EQUIV_CONFIGS": "sync,none,mlp,False;sync,fp16,mlp,False"}
    text = run_job(cluster4, "2x2", [PYTHON, str(REPO / "tests" / "launch_scripts" / "sync_link_bytes.py")], rdma)
    results = tagged(text, "RESULT")
    assert len(results) == 2, text[-3000:]
    for r in results:
        assert r["hierarchical"] and r["ranks"] == 4 and r["rank_spread"] == 0.0, r
        assert r["rel_error"] < TOLERANCE[r["compression"]], r
    assert "smb transport rdma: SMB_TRANSPORT=rdma" in text, text[-3000:]
    assert text.count("transport rdma over UCX tcp") == 2 and text.count("UNSAFE") >= 2, text[-3000:]
