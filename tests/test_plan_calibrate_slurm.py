"""``eddis plan --calibrate`` as the job's command on the local Slurm cluster's two nodes
(n1, n2: network hosts of their own): the link between them, MPI's allreduce and EDDIS's
own allreduce and sync paths measured on every rank at once, written as cluster.json."""
import os
import re
from pathlib import Path

import pytest

from conftest import PYTHON, REPO
from launch_helpers import make_bin, wait_job_end

import eddis.smb.server  # noqa: F401  (required: missing is a failure, not a skip)
from eddis.plan import spec

JOB_SCRIPT = REPO / "scripts" / "eddis_job.sh"


@pytest.mark.timeout(300)
def test_calibrate_on_two_nodes_measures_every_path_across_the_link(slurm_cluster, tmp_path):
    env = {"PATH": f"{make_bin(tmp_path / 'bin')}:{os.environ['PATH']}", "EDDIS_RUN_DIR": str(tmp_path / "run"),
           "SMB_MEMORY": "128M", "OMP_NUM_THREADS": "1"}
    out, cal = tmp_path / "job.out", tmp_path / "cal"
    command = [PYTHON, "-m", "eddis.cli", "plan", "--calibrate", "--out", cal, "--probe-bytes", "4M", "--repeats", "2"]
    proc = slurm_cluster.run(["sbatch", "--parsable", f"--output={out}", JOB_SCRIPT, *map(str, command)], env=env,
                             timeout=60)
    job_id = proc.stdout.strip().split(";")[0]
    state, code = wait_job_end(slurm_cluster, job_id, 240, out)
    text = out.read_text()
    assert (state, code) == ("COMPLETED", "0:0"), text
    said = re.search(r"eddis plan --calibrate: (.*)$", text, re.M).group(1)
    assert re.search(r"link n1<->n2: [\d.]+ MB/s one way", said), said
    for path in ("MPI allreduce", "EDDIS allreduce", "EDDIS sync"):
        assert re.search(rf"{path} [\d.]+ GB/s a node and way", said), said
    cluster = spec.load_cluster(cal / "cluster.json")
    assert (cluster.num_nodes, cluster.size) == (2, 4)
    # the caps come from EDDIS's own paths, measured across the link
    assert cluster.mpi_bps > 0 and cluster.put_bps == cluster.get_bps > 0 and cluster.reduce_bps > 0
    assert not list(Path(env["EDDIS_RUN_DIR"], "servers").glob("*.json"))
