"""A reduction that times out says whom it waited for: how many of which ranks, and on which server."""
import sys
import time

import numpy as np


def case_missing_rank():
    import os

    fake_hosts = os.environ.get("TIMEOUT_FAKE_HOSTS")   # "h0,h1,h2": this rank's node by rank
    if fake_hosts:
        os.environ["EDDIS_HOSTNAME"] = fake_hosts.split(",")[int(os.environ["OMPI_COMM_WORLD_RANK"])]
    import eddis.core as core

    core.init()
    plan = core.BucketPlan([("a", (1000,))], bucket_bytes=1 << 20)
    red = core.make_reducer("sync", plan, name="timeout")
    if core.rank() == 1:
        time.sleep(12)  # never contributes: rank 0 must time out naming what it waited for
        return
    plan.buffer[:] = np.ones(plan.total)
    red.mark_all_ready()
    try:
        red.wait()
    except Exception as exc:  # noqa: BLE001 - the comm thread's error or the wait's: either names them
        print("TIMEOUT " + str(exc).replace("\n", " "), flush=True)
    sys.stdout.flush()
    import os
    os._exit(0)  # the peer will not join a clean shutdown


if __name__ == "__main__" and len(sys.argv) > 1:
    sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__file__), "..", "src"))
    {"missing_rank": case_missing_rank}[sys.argv[1]]()
    sys.exit(0)

import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402
from eddis.smb.testing import LocalServers  # noqa: E402


@pytest.mark.timeout(90)
@pytest.mark.parametrize("path", ["ranks", "server", "hierarchical"])
def test_reduction_timeout_names_the_ranks_and_servers(run_mpi, path):
    import eddis.smb._core  # noqa: F401  (required: missing is a failure, not a skip)
    proc = run_mpi(2, [PYTHON, __file__, "missing_rank"], timeout=80,
                   env={"EDDIS_COMM_TIMEOUT": "3", "EDDIS_SYNC_REDUCE": path})
    lines = [line for line in proc.stdout.splitlines() if "TIMEOUT " in line]
    assert lines, proc.stdout + proc.stderr
    message = lines[0]
    assert "within 3 s" in message, message
    if path == "server":  # the servers' reduction: the request names the servers it waits on
        assert "servers [0]" in message, message
    else:
        assert "1 of the 2 ranks [0, 1] arrived (counter on smb-server 0" in message and "1 missing" in message, \
            message


@pytest.mark.timeout(90)
def test_a_ring_that_times_out_names_the_node_before(run_mpi):
    """One rank on each of 3 nodes (auto: the ring); rank 1 never contributes: the nodes after it
    time out on the pieces of the node before them, each naming it and the step."""
    hosts = ["h0", "h1", "h2"]
    with LocalServers(3, memory="16M", hostnames=hosts) as servers:
        proc = run_mpi(3, [PYTHON, __file__, "missing_rank"], timeout=80,
                       env={"EDDIS_COMM_TIMEOUT": "3", "EDDIS_RUN_DIR": str(servers.run_dir),
                            "EDDIS_EMBEDDED_SERVER": "0", "TIMEOUT_FAKE_HOSTS": ",".join(hosts)})
    lines = sorted(line for line in proc.stdout.splitlines() if "TIMEOUT " in line)
    assert len(lines) == 2, proc.stdout + proc.stderr
    for line in lines:
        assert "mode sync's ring: node h" in line and "sent no piece of ring step" in line, line
        assert "within 3 s" in line, line
    # rank 2 waits on rank 1's node itself
    assert any("node h1 sent no piece of ring step 1 " in line for line in lines), lines
