"""EDDIS_ELASTIC=1 on the Slurm cluster (``eddis-train --job``, the srun path): a 2-node easgd job,
one rank on n1 and one on n2 (tests/launch_scripts/elastic_trainer.py).

- A lost rank: rank 1 (n2) sends itself SIGKILL mid-training.
- A lost node: rank 1 waits at a step, and the test SIGKILLs every process of the job on n2
  at once (the rank, the smb-server and both their supervisors), as a node that dies takes
  them; slurmd and slurmstepd stay. The survivor goes on with the mirrored copies of the
  centre, the counters and the heartbeats that n2's server held (eddis.smb.mirror).

Stated: the survivor trains until the global learning counter reaches exactly the total,
the job ends COMPLETED 0:0, and its output says it finished degraded, naming the lost rank
and host, or the lost node with its rank and smb-server.
"""
import json
import os
import re
import signal

import pytest

from conftest import REPO
from launch_helpers import environ_of, make_bin, wait_job_end, wait_until

import eddis.smb.server  # noqa: F401  (required: missing is a failure, not a skip)

TRAINER = REPO / "tests" / "launch_scripts" / "elastic_trainer.py"
TOTAL = 300
KILL_STEP = 10
LOST_AFTER = 5   # seconds: short for the test, long enough for 2 busy cores


ONE_COMPONENT = (("all", 2),)
HETJOB = (("a100", 1), ("v100", 1))   # n1 and n2: one smb-server step each


def submit_elastic_job(cluster, tmp_path, *trainer_args, components=ONE_COMPONENT):
    from eddis.slurm.script import JobComponent, render_job_script

    out, log = tmp_path / "out", tmp_path / "job.out"
    out.mkdir()
    script = tmp_path / "job.sh"
    script.write_text(render_job_script(
        components=[JobComponent(partition, nodes=nodes, tasks_per_node=1) for partition, nodes in components],
        job_name="eddis-elastic-test",
        command=[str(TRAINER), "--out", str(out), "--mode", "easgd", "--total", str(TOTAL),
                 *map(str, trainer_args)],
        time="00:05:00", output=str(log), mode="easgd", checkpoint_signal=0,
        settings={"EDDIS_ELASTIC": "1", "EDDIS_ELASTIC_LOST_AFTER": str(LOST_AFTER),
                  "EDDIS_COMM_TIMEOUT": "90"}))
    bin_dir = make_bin(tmp_path / "bin")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "EDDIS_RUN_DIR": str(tmp_path / "run"),
           "SMB_MEMORY": "64M", "OMP_NUM_THREADS": "1"}
    job_id = cluster.run(["sbatch", "--parsable", str(script)], env=env, timeout=60).stdout.strip()
    return job_id, out, log


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_easgd_job_trains_on_without_a_killed_rank(slurm_cluster, tmp_path):
    job_id, out, log = submit_elastic_job(slurm_cluster, tmp_path, "--kill-rank", 1, "--kill-step", KILL_STEP)
    state = wait_job_end(slurm_cluster, job_id, 240, log)
    text = log.read_text(errors="replace")
    assert state == ("COMPLETED", "0:0"), text[-4000:]
    assert re.search(r"^eddis-train: finished degraded: rank 1 on host n2 was lost \(was killed by signal 9 "
                     r"\(SIGKILL\)\) at \d\d:\d\d:\d\d; rank 0 finished the training$", text, re.M), text[-4000:]
    results = {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(results) == [0], text[-4000:]
    assert results[0]["counter"] == TOTAL, results
    # rank 1 claimed its steps 0..KILL_STEP and completed KILL_STEP of them
    assert results[0]["steps"] == TOTAL - (KILL_STEP + 1), results
    assert (out / "model.pt").exists()
    assert "ROOT CAUSE" not in text and "CANCELLED" not in text, text[-4000:]


def job_processes_on(node, run_dir):
    """PIDs of the job's processes on ``node`` (the fake nodes share this PID namespace), found
    by the run dir every process of the job has in its environment; not slurmstepd, which
    stands for slurmd here (a lost node takes both)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = environ_of(entry)
            with open(f"/proc/{entry}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if env.get("EDDIS_RUN_DIR") == str(run_dir) and env.get("SLURMD_NODENAME") == node \
                and name != "slurmstepd":
            found.append(int(entry))
    return sorted(found)   # parents first: a supervisor must not see its child die and record it


@pytest.mark.slurm
@pytest.mark.timeout(300)
@pytest.mark.parametrize("components", [ONE_COMPONENT, HETJOB], ids=["one-component", "hetjob"])
def test_easgd_job_trains_on_without_a_lost_node(slurm_cluster, tmp_path, components):
    job_id, out, log = submit_elastic_job(slurm_cluster, tmp_path, "--pause-rank", 1, "--pause-step", KILL_STEP,
                                          components=components)
    wait_until(lambda: (out / "paused.1").exists(), 180, what="rank 1 to reach its pause")
    victims = job_processes_on("n2", tmp_path / "run")
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    state = wait_job_end(slurm_cluster, job_id, 240, log)
    text = log.read_text(errors="replace")
    # the rank and the smb-server of n2, each under its supervisor
    assert len(victims) == 4, (victims, text[-4000:])
    assert state == ("COMPLETED", "0:0"), text[-4000:]
    assert re.search(r"^eddis-train: finished degraded: node n2 was lost: rank 1 and its smb-server 1; "
                     r"rank 0 finished the training$", text, re.M), text[-4000:]
    results = {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(results) == [0], text[-4000:]
    assert results[0]["lost_servers"] == [1], results
    assert results[0]["counter"] == TOTAL, results
    # rank 1 claimed its steps 0..KILL_STEP and completed KILL_STEP of them
    assert results[0]["steps"] == TOTAL - (KILL_STEP + 1), results
    assert (out / "model.pt").exists()
    assert "ROOT CAUSE" not in text, text[-4000:]
