"""EDDIS_ELASTIC=1 on the Slurm cluster (``eddis-train --job``): a 2-node easgd job, one rank on n1
and one on n2 (srun), or 2 ranks on each node (under mpirun inside the allocation:
eddis.launch.mpirun_step), one group per node in hybrid
(tests/launch_scripts/elastic_trainer.py).

- A lost rank: rank 1 (n2) sends itself SIGKILL mid-training; or, with 2 ranks a node, rank 1
  beside rank 0 on n1 (under srun --mpi=pmix, Slurm's PMIx plugin cancelled the whole step).
- A lost node: the first rank on n2 waits at a step, and the test SIGKILLs every process of
  the job on n2 at once (the ranks, the smb-server and their supervisors), as a node that
  dies takes them; slurmd and slurmstepd stay. The survivors go on with the mirrored copies
  of the centre, the counters, the heartbeats and the checkpoint schedule's counters that
  n2's server held (eddis.smb.mirror). The hybrid job runs with SMB_LOCAL_MAP=0, where a
  group's reduction pool once spread over every server: now on its own node's server only.

- A node lost before its ranks' training started (the first rank on n2 waits before
  eddis.init(); the test kills n2 as above): the others wait in MPI_Init or their first
  collective, so the start fails, naming n2's ranks, once their supervisors' beats stand still.

Stated: the survivors train until the global learning counter reaches exactly the total,
the job ends COMPLETED 0:0, and its output says it finished degraded, naming the lost rank
and host, or the lost node with its ranks and smb-server.

Checkpoints of the live ranks: a 2-node easgd job with periodic checkpoints loses rank 1;
rank 0 goes on checkpointing, every checkpoint after the loss naming the rank in it and the
lost one, and a fresh job of 2 ranks resumes the newest of them.
"""
import json
import os
import re
import signal
import time

import pytest

from conftest import REPO
from launch_helpers import (environ_of, last_start_attempt, make_bin, requeue_hold_seconds, wait_job_end,
                            wait_requeued_job_end, wait_until)

import eddis.smb.server  # noqa: F401  (required: missing is a failure, not a skip)

TRAINER = REPO / "tests" / "launch_scripts" / "elastic_trainer.py"
TOTAL = 300
KILL_STEP = 10
LOST_AFTER = 5   # seconds: short for the test, long enough for 2 busy cores


ONE_COMPONENT = (("all", 2, 1),)     # (partition, nodes, ranks per node)
HETJOB = (("a100", 1, 1), ("v100", 1, 1))   # n1 and n2: one smb-server step each
TWO_BY_TWO = (("all", 2, 2),)


def submit_elastic_job(cluster, tmp_path, *trainer_args, components=ONE_COMPONENT, mode="easgd", checkpoint_signal=0,
                       **settings):
    from eddis.slurm.script import JobComponent, render_job_script

    out, log = tmp_path / "out", tmp_path / "job.out"
    out.mkdir()
    script = tmp_path / "job.sh"
    script.write_text(render_job_script(
        components=[JobComponent(partition, nodes=nodes, tasks_per_node=tasks)
                    for partition, nodes, tasks in components],
        job_name="eddis-elastic-test",
        command=[str(TRAINER), "--out", str(out), "--mode", mode, "--total", str(TOTAL),
                 *map(str, trainer_args)],
        time="00:05:00", output=str(log), mode=mode, checkpoint_signal=checkpoint_signal,
        settings={"EDDIS_ELASTIC": "1", "EDDIS_ELASTIC_LOST_AFTER": str(LOST_AFTER),
                  "EDDIS_COMM_TIMEOUT": "90", **settings}))
    bin_dir = make_bin(tmp_path / "bin")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "EDDIS_RUN_DIR": str(tmp_path / "run"),
           "SMB_MEMORY": "64M", "OMP_NUM_THREADS": "1"}
    job_id = cluster.run(["sbatch", "--parsable", str(script)], env=env, timeout=60).stdout.strip()
    return job_id, out, log


def rank_results(out):
    """``{rank: the json elastic_trainer.py wrote}`` of the ranks that finished."""
    return {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}


def rank_0_finished_without_killed_rank_1(cluster, job_id, out, log):
    """The job that killed rank 1 at KILL_STEP ended COMPLETED, degraded, with rank 0 ending the
    counter at exactly the total; its output and rank 0's results."""
    state = wait_job_end(cluster, job_id, 240, log)
    text = log.read_text(errors="replace")
    assert state == ("COMPLETED", "0:0"), text[-4000:]
    assert re.search(r"^eddis-train: finished degraded: rank 1 on host n2 was lost \(was killed by signal 9 "
                     r"\(SIGKILL\)\) at \d\d:\d\d:\d\d; rank 0 finished the training$", text, re.M), text[-4000:]
    results = rank_results(out)
    assert sorted(results) == [0], text[-4000:]
    assert results[0]["counter"] == TOTAL, results
    # rank 1 claimed its steps 0..KILL_STEP and completed KILL_STEP of them
    assert results[0]["steps"] == TOTAL - (KILL_STEP + 1), results
    return text, results


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_easgd_job_trains_on_without_a_killed_rank(slurm_cluster, tmp_path):
    job_id, out, log = submit_elastic_job(slurm_cluster, tmp_path, "--kill-rank", 1, "--kill-step", KILL_STEP)
    text, _ = rank_0_finished_without_killed_rank_1(slurm_cluster, job_id, out, log)
    assert (out / "model.pt").exists()
    assert "ROOT CAUSE" not in last_start_attempt(text) and "CANCELLED" not in text, text[-4000:]


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_easgd_job_trains_on_without_a_killed_rank_that_shares_its_node(slurm_cluster, tmp_path):
    """2 ranks on each node; rank 1 dies beside rank 0 on n1, so the node and its other
    rank live on (a crash of one process, not of the node)."""
    job_id, out, log = submit_elastic_job(slurm_cluster, tmp_path, "--kill-rank", 1, "--kill-step", KILL_STEP,
                                          components=TWO_BY_TWO)
    state = wait_job_end(slurm_cluster, job_id, 240, log)
    text = log.read_text(errors="replace")
    assert state == ("COMPLETED", "0:0"), text[-4000:]
    assert re.search(r"^eddis-train: finished degraded: rank 1 on host n1 was lost \(was killed by signal 9 "
                     r"\(SIGKILL\)\) at \d\d:\d\d:\d\d; rank 0, 2, 3 finished the training$", text, re.M), \
        text[-4000:]
    results = rank_results(out)
    assert sorted(results) == [0, 2, 3], text[-4000:]
    assert {r["counter"] for r in results.values()} == {TOTAL}, results
    # rank 1 claimed its steps 0..KILL_STEP and completed KILL_STEP of them
    assert sum(r["steps"] for r in results.values()) == TOTAL - (KILL_STEP + 1), results
    assert (out / "model.pt").exists()
    assert "ROOT CAUSE" not in last_start_attempt(text) and "CANCELLED" not in text, text[-4000:]


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_hybrid_job_trains_on_without_a_group_that_lost_a_member(slurm_cluster, tmp_path):
    """2 x 2 ranks, a hybrid group per node; rank 3 dies beside rank 2 on n2: group 1 cannot
    reduce, so rank 2 ends itself (status 69), and group 0 (n1) trains on to the total."""
    job_id, out, log = submit_elastic_job(slurm_cluster, tmp_path, "--kill-rank", 3, "--kill-step", KILL_STEP,
                                          components=TWO_BY_TWO, mode="hybrid")
    state = wait_job_end(slurm_cluster, job_id, 240, log)
    text = log.read_text(errors="replace")
    assert state == ("COMPLETED", "0:0"), text[-4000:]
    assert re.search(r"^eddis-train: finished degraded: rank 3 on host n2 was lost \(was killed by signal 9 "
                     r"\(SIGKILL\)\) at [\d:]+; rank 2 on host n2 was lost \(exited with code 69\) at [\d:]+; "
                     r"rank 0, 1 finished the training$", text, re.M), text[-4000:]
    results = rank_results(out)
    assert sorted(results) == [0, 1], text[-4000:]
    assert {r["counter"] for r in results.values()} == {TOTAL}, results
    # group 1 claimed its group steps 0..KILL_STEP, 2 iterations each; group 0 did the rest together
    assert [results[r]["steps"] for r in (0, 1)] == [(TOTAL - 2 * (KILL_STEP + 1)) // 2] * 2, results
    assert (out / "model.pt").exists()
    assert "ROOT CAUSE" not in last_start_attempt(text) and "CANCELLED" not in text, text[-4000:]


# how the first run of the requeue test is ended, and the line the job says it with
REQUEUE_CAUSES = {
    # Slurm's --signal=B:USR1@N warning, which reaches the ranks through mpirun
    "time-limit warning": r"eddis_job: wrote checkpoint (\S+) \(step (\d+)\); requeued job",
    # a job of partition urgent preempts it: SIGTERM to every process of the job's steps, the
    # nodes' daemons too, which ignore it, so that their ranks write the checkpoint
    "preemption": r"eddis_job: preempted by Slurm: wrote checkpoint (\S+) \(step (\d+)\)",
}


@pytest.mark.slurm
@pytest.mark.timeout(420)
@pytest.mark.parametrize("cause", list(REQUEUE_CAUSES))
def test_elastic_job_under_mpirun_checkpoints_requeues_itself_and_resumes(slurm_cluster, tmp_path, cause):
    """2 x 2 easgd ranks under mpirun are told to stop at rank 0's step WARN_AT_STEP; they write
    a checkpoint, the job is requeued, and its next run resumes there and ends the counter at
    the total."""
    import h5py

    from eddis.core.checkpoint import folders as layout

    assert requeue_hold_seconds(slurm_cluster) <= 30, "rebuild the dev cluster (scripts/eddis-dev-cluster)"
    checkpoints = tmp_path / "checkpoints"
    job_id, out, log = submit_elastic_job(slurm_cluster, tmp_path, "--resume", checkpoints, "--step-seconds",
                                          STEP_SECONDS, "--say-step", WARN_AT_STEP, components=TWO_BY_TWO,
                                          checkpoint_signal=60, EDDIS_CHECKPOINT_DIR=str(checkpoints),
                                          EDDIS_MAX_REQUEUES="0" if cause == "preemption" else "20")
    told = []

    def tell():
        text = log.read_text(errors="replace") if log.exists() else ""
        if told or not re.search(rf"^\[0@n1\] rank 0 reached step {WARN_AT_STEP}$", text, re.M):
            return
        if cause == "preemption":
            told.append(slurm_cluster.run(
                ["sbatch", "--parsable", "--partition=urgent", "--nodes=2", "--exclusive", "--job-name=urgent",
                 f"--output={tmp_path / 'urgent.out'}", "--wrap", "sleep 2; echo urgent job ran"],
                timeout=60).stdout.strip())
        else:
            slurm_cluster.run(["scancel", "--batch", "--signal=USR1", job_id], timeout=30)
            told.append(job_id)

    state = wait_requeued_job_end(slurm_cluster, job_id, 300, log, on_poll=tell)
    text = log.read_text(errors="replace")
    assert state[:2] == ("COMPLETED", "0:0"), text[-4000:]
    if cause == "preemption":
        assert (tmp_path / "urgent.out").read_text().strip() == "urgent job ran", text[-4000:]
    else:
        assert text.count("mpirun: Forwarding signal 10 to job") == 1, text[-4000:]
    requeued = re.findall(REQUEUE_CAUSES[cause], text)
    assert len(requeued) == 1 and text.count("eddis_job: job ") == 2, text[-4000:]
    results = rank_results(out)
    assert sorted(results) == [0, 1, 2, 3], text[-4000:]
    assert {r["counter"] for r in results.values()} == {TOTAL}, results
    assert {r["start"]["path"] for r in results.values()} == {requeued[0][0]}, results
    # the second run trained exactly what the first one's checkpoint had left of the total
    with h5py.File(os.path.join(requeued[0][0], layout.TRAINING_STATE), "r") as h5:
        consumed = int(h5["progress"].attrs["consumed"])
    assert WARN_AT_STEP < consumed < TOTAL   # rank 0 alone had passed the warning's step
    assert consumed + sum(r["steps"] for r in results.values()) == TOTAL, (consumed, results)
    assert "finished degraded" not in text and "ROOT CAUSE" not in last_start_attempt(text), text[-4000:]


def job_processes_on(node, run_dir):
    """(PID, command name) of the job's processes on ``node`` (the fake nodes share this PID
    namespace), found by the run dir every process of the job has in its environment; not
    slurmstepd, which stands for slurmd here (a lost node takes both)."""
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
            found.append((int(entry), name))
    return sorted(found)   # parents first: a supervisor must not see its child die and record it


def kill_n2_once_paused(out, rank, run_dir):
    """Once ``rank`` (the first on n2) paused: SIGKILL every process of the job on n2 at once,
    as a node that dies takes them; the (PID, name) of those killed."""
    wait_until(lambda: (out / f"paused.{rank}").exists(), 180, what="the first rank on n2 to pause")
    victims = job_processes_on("n2", run_dir)
    for pid, _ in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return victims


# (components, mode, extra settings); the first rank on n2 pauses, and the test kills n2
NODE_LOSS = {
    "one-component": (ONE_COMPONENT, "easgd", {}),
    "hetjob": (HETJOB, "easgd", {}),
    # groups are nodes: {0, 1} on n1, {2, 3} on n2
    "hybrid-no-local-map": (TWO_BY_TWO, "hybrid", {"SMB_LOCAL_MAP": "0"}),
}


@pytest.mark.slurm
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(NODE_LOSS))
def test_elastic_job_trains_on_without_a_lost_node(slurm_cluster, tmp_path, case):
    components, mode, settings = NODE_LOSS[case]
    per_node = components[0][2]
    lost_ranks = list(range(per_node, 2 * per_node))
    survivors = list(range(per_node))
    # no interval: the schedule's counters exist and are read at every step, nothing is due
    job_id, out, log = submit_elastic_job(slurm_cluster, tmp_path, "--pause-rank", lost_ranks[0],
                                          "--pause-step", KILL_STEP, components=components, mode=mode,
                                          EDDIS_CHECKPOINT_DIR=str(tmp_path / "checkpoints"), **settings)
    victims = kill_n2_once_paused(out, lost_ranks[0], tmp_path / "run")
    state = wait_job_end(slurm_cluster, job_id, 240, log)
    text = log.read_text(errors="replace")
    # n2's ranks and its smb-server, each under its supervisor; with 2 ranks a node beside Open
    # MPI's daemon there (mpirun: eddis.launch.mpirun_step)
    eddis = [pid for pid, name in victims if name != "orted"]
    assert len(eddis) == 2 * (per_node + 1), (victims, text[-4000:])
    assert [name for _, name in victims if name == "orted"] == (["orted"] if per_node > 1 else []), victims
    assert state == ("COMPLETED", "0:0"), text[-4000:]
    named = ", ".join(map(str, lost_ranks))
    finished = ", ".join(map(str, survivors))
    assert re.search(rf"^eddis-train: finished degraded: node n2 was lost: rank {named} and its smb-server 1; "
                     rf"rank {finished} finished the training$", text, re.M), text[-4000:]
    results = rank_results(out)
    assert sorted(results) == survivors, text[-4000:]
    for result in results.values():
        assert result["lost_servers"] == [1], results
        assert result["counter"] == TOTAL, results
        assert result["checkpoint_requests"] == [{"mirrored": True, "value": 0}], results
        # the lost unit (a rank, or n2's group) claimed its steps 0..KILL_STEP, one iteration
        # per rank each, and the survivors' unit did the rest
        assert result["steps"] == (TOTAL - per_node * (KILL_STEP + 1)) // per_node, results
        if mode == "hybrid":
            assert result["group_servers"] == [0], results   # n1's server, though not mapped
    assert (out / "model.pt").exists()
    assert "ROOT CAUSE" not in last_start_attempt(text), text[-4000:]


# the first rank on n2 pauses before eddis.init(); the test kills n2 while rank 0 waits for it
# in MPI_Init (srun) or in its first collective (mpirun)
EARLY_NODE_LOSS = {"srun": ONE_COMPONENT, "mpirun": TWO_BY_TWO}


@pytest.mark.slurm
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(EARLY_NODE_LOSS))
def test_elastic_job_fails_at_once_when_a_node_is_lost_before_its_training_started(slurm_cluster, tmp_path, case):
    """A node lost before its ranks' training started leaves the others in a start-up
    collective without a timeout; the launcher finds that n2's ranks stopped giving signs of
    life (their supervisors' beats) and fails the start, naming them, instead of hanging."""
    components = EARLY_NODE_LOSS[case]
    per_node = components[0][2]
    lost_ranks = list(range(per_node, 2 * per_node))
    job_id, out, log = submit_elastic_job(slurm_cluster, tmp_path, "--pause-rank", lost_ranks[0],
                                          "--pause-step", -1, components=components)
    victims = kill_n2_once_paused(out, lost_ranks[0], tmp_path / "run")
    state = wait_job_end(slurm_cluster, job_id, 180, log)
    text = log.read_text(errors="replace")
    # n2's ranks and its smb-server, each under its supervisor
    assert len([pid for pid, name in victims if name != "orted"]) == 2 * (per_node + 1), (victims, text[-4000:])
    assert state == ("FAILED", "1:0"), text[-4000:]
    named = ", ".join(map(str, lost_ranks))
    assert re.search(rf"^eddis-train: rank {named} on host n2 gave no sign of life for \d+ s before (its|their) "
                     r"training started \(lost with (its|their) node\?\); failing the start", text, re.M), text[-4000:]
    assert re.search(rf"^eddis-train: ROOT CAUSE: rank {lost_ranks[0]} on host n2 was lost before its training "
                     r"started \(no sign of life", text, re.M), text[-4000:]
    assert not list(out.glob("*.json")), text[-4000:]   # nobody trained


STEP_SECONDS = 0.05   # the requeue test's steps: its 4 ranks take about 75 each
WARN_AT_STEP = 20     # rank 0's step at which Slurm's warning comes, inside the first run's training

CHECKPOINT_EVERY = 25   # rank 0's steps (of about 290 in the job)


def manifests_in(folder):
    from eddis.core.checkpoint import folders as layout

    return [layout.read_manifest(path) for _, path in layout.complete_checkpoints(str(folder))]


def submit_lossy_checkpointing_job(cluster, tmp_path, kill_rank, **options):
    """A job that checkpoints every CHECKPOINT_EVERY steps into ``<tmp>/checkpoints`` (resuming
    from there) and loses ``kill_rank`` at KILL_STEP: (the checkpoints, an empty folder for the
    job that resumes them, the job's (id, out, log))."""
    checkpoints = tmp_path / "checkpoints"
    lossy, resumed = tmp_path / "lossy", tmp_path / "resumed"
    lossy.mkdir()
    resumed.mkdir()
    job = submit_elastic_job(cluster, lossy, "--kill-rank", kill_rank, "--kill-step", KILL_STEP, "--resume",
                             checkpoints, EDDIS_CHECKPOINT_DIR=str(checkpoints),
                             EDDIS_CHECKPOINT_INTERVAL=str(CHECKPOINT_EVERY), EDDIS_CHECKPOINT_KEEP="0", **options)
    return checkpoints, resumed, job


@pytest.mark.slurm
@pytest.mark.timeout(420)
def test_easgd_checkpoints_the_live_ranks_after_a_loss_and_a_new_job_resumes_them(slurm_cluster, tmp_path):
    """2 easgd ranks (n1, n2) with periodic checkpoints; rank 1 kills itself: rank 0 goes on
    checkpointing, each checkpoint after the loss naming the rank in it and the lost one, and a
    fresh job of 2 ranks resumes the newest as one of 1 worker, continuing the global learning
    counter to the total."""
    import h5py

    from eddis.core.checkpoint import folders as layout

    checkpoints, resumed, (job_id, out, log) = submit_lossy_checkpointing_job(slurm_cluster, tmp_path, 1)
    text, results = rank_0_finished_without_killed_rank_1(slurm_cluster, job_id, out, log)
    manifests = manifests_in(checkpoints)
    held = [[m["ranks"], m["lost_ranks"]] for m in manifests]
    # before the loss both ranks, after it the survivor
    assert all(h in ([[0, 1], []], [[0], [1]]) for h in held), held
    after_loss = [m for m in manifests if m["lost_ranks"] == [1]]
    assert after_loss, held
    assert all([r["rank"] for r in m["per_rank"]] == [0] and m["world_size"] == 2 for m in after_loss)

    # a fresh job of 2 ranks resumes the newest checkpoint, one after the loss
    newest = layout.latest(str(checkpoints))
    assert layout.read_manifest(newest)["lost_ranks"] == [1], held
    with h5py.File(os.path.join(newest, layout.TRAINING_STATE), "r") as h5:
        consumed = int(h5["progress"].attrs["consumed"])
        assert h5["progress"]["steps_done"][1] == -1   # the lost rank's count went with it
    assert 0 < consumed < TOTAL
    job_id, out, log = submit_elastic_job(slurm_cluster, resumed, "--resume", newest)
    state = wait_job_end(slurm_cluster, job_id, 240, log)
    text = log.read_text(errors="replace")
    assert state == ("COMPLETED", "0:0"), text[-4000:]
    assert "finished degraded" not in text, text[-4000:]
    results = rank_results(out)
    assert sorted(results) == [0, 1], text[-4000:]
    for result in results.values():
        # the same number of ranks, but a checkpoint of one worker: both start from the centre
        assert result["start"] == {"path": newest, "step": 0}, results
        assert result["counter"] == TOTAL, results
    assert consumed + sum(r["steps"] for r in results.values()) == TOTAL, (consumed, results)


@pytest.mark.slurm
@pytest.mark.timeout(420)
def test_hybrid_checkpoints_the_live_group_after_a_loss_and_a_new_job_resumes_it(slurm_cluster, tmp_path):
    """2 x 2 hybrid ranks, a group per node, with periodic checkpoints; rank 3 kills itself and
    rank 2 ends with its group: group 0 goes on checkpointing, the checkpoints after the loss
    name ranks 0 and 1 and the lost ones, and a fresh 2 x 2 job resumes the newest as one of 1
    group, continuing the global learning counter to the total."""
    import h5py

    from eddis.core.checkpoint import folders as layout

    checkpoints, resumed, (job_id, out, log) = submit_lossy_checkpointing_job(
        slurm_cluster, tmp_path, 3, components=TWO_BY_TWO, mode="hybrid")
    state = wait_job_end(slurm_cluster, job_id, 240, log)
    text = log.read_text(errors="replace")
    assert state == ("COMPLETED", "0:0"), text[-4000:]
    assert "finished degraded: rank 3 on host n2 was lost" in text, text[-4000:]
    held = [[m["ranks"], m["lost_ranks"]] for m in manifests_in(checkpoints)]
    # before the loss every rank; after it group 0 (rank 2 may still be counted live once,
    # between its partner's loss and its own end)
    assert all(h in ([[0, 1, 2, 3], []], [[0, 1, 2], [3]], [[0, 1], [2, 3]]) for h in held), held
    assert [[0, 1], [2, 3]] in held, held

    newest = layout.latest(str(checkpoints))
    assert layout.read_manifest(newest)["lost_ranks"] == [2, 3], held
    with h5py.File(os.path.join(newest, layout.TRAINING_STATE), "r") as h5:
        consumed = int(h5["progress"].attrs["consumed"])
    assert 0 < consumed < TOTAL
    job_id, out, log = submit_elastic_job(slurm_cluster, resumed, "--resume", newest, components=TWO_BY_TWO,
                                          mode="hybrid")
    state = wait_job_end(slurm_cluster, job_id, 240, log)
    text = log.read_text(errors="replace")
    assert state == ("COMPLETED", "0:0"), text[-4000:]
    assert "finished degraded" not in text, text[-4000:]
    results = rank_results(out)
    assert sorted(results) == [0, 1, 2, 3], text[-4000:]
    for result in results.values():
        assert result["start"]["path"] == newest and result["counter"] == TOTAL, results
    # a hybrid step consumes one iteration per rank of the group: each group's ranks step together
    assert consumed + sum(r["steps"] for r in results.values()) == TOTAL, (consumed, results)
