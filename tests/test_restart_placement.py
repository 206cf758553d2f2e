"""Where a restarted job runs: Slurm's node states and the job's node list read from scontrol's
lines, the plan that leaves failed nodes out (spare nodes, the batch host last), the steps'
command lines on those nodes, and the job script and ``eddis submit`` with spare nodes. The
whole restart runs on the real cluster in test_restart_requeue.py."""
import pytest

from eddis.errors import ConfigError, NodeFailureError
from eddis.launch import allocation, placement, stepcommands
from eddis.launch.allocation import Component
from eddis.launch.stepcommands import server_step_command, trainer_step_command
from eddis.slurm.discovery import parse_sinfo
from eddis.slurm.nodes import (NodeHealth, job_no_kill, parse_job_node_lists, parse_node_lines,
                               script_asks_no_kill, state_words)
from eddis.slurm.script import JobComponent, render_job_script
from eddis.slurm.submit import plan_components

# scontrol show node -o, as Slurm 22.05 writes it (fields shortened)
NODES = (
    "NodeName=n1 Arch=x86_64 CPUAlloc=2 CPUTot=4 Gres=gpu:a100:2 NodeAddr=198.19.210.1 "
    "OS=Linux 6.1 #1 SMP State=MIXED ThreadsPerCore=1 AllocTRES=cpu=2 CapWatts=n/a\n"
    "NodeName=n2 Arch=x86_64 CPUAlloc=0 CPUTot=4 Gres=gpu:v100:2 NodeAddr=198.19.210.2 "
    "OS=Linux 6.1 #1 SMP State=DOWN ThreadsPerCore=1 AllocTRES= CapWatts=n/a "
    "Reason=eddis test: node lost [root@2026-12-01T22:40:01]\n"
    "NodeName=n3 CPUTot=4 State=IDLE+DRAIN Reason=disk errors [admin@2026-12-01T20:00:00]\n"
    "NodeName=n4 CPUTot=4 State=IDLE* Reason=Not responding [slurm@2026-12-01T21:00:00]\n")


def test_node_states_and_reasons_are_read_from_scontrol():
    found = parse_node_lines(NODES)
    assert found["n1"] == NodeHealth("n1", ("MIXED",), "") and not found["n1"].failed
    assert found["n2"].describe() == "n2 (DOWN: eddis test: node lost)" and found["n2"].failed
    assert found["n3"].describe() == "n3 (DRAIN: disk errors)"
    assert found["n4"].describe() == "n4 (NOT_RESPONDING: Not responding)"
    assert state_words("ALLOCATED+DRAIN+FAIL") == ("ALLOCATED", "DRAIN", "FAIL")
    assert not NodeHealth("n5", state_words("ALLOCATED+COMPLETING")).failed


def test_the_jobs_current_node_lists_are_read_per_component():
    text = ("JobId=7 JobName=eddis UserId=root(0) JobState=RUNNING Reason=None NodeList=n1 "
            "BatchHost=n1 NumNodes=1\n"
            "JobId=8 HetJobId=7 HetJobOffset=1 JobState=RUNNING NodeList=n[3-4] NumNodes=2\n")
    assert parse_job_node_lists(text) == ["n1", "n[3-4]"]
    assert parse_job_node_lists("JobId=9 JobState=RUNNING NodeList=(null)\n") == [""]


def test_failed_nodes_are_those_in_a_failed_state_or_removed_from_the_job():
    health = parse_node_lines(NODES)
    failed = placement.failed_nodes(["n1", "n2", "n3", "n4"], {"n1", "n3", "n4"}, health)
    assert failed == {"n2": "n2 (DOWN: eddis test: node lost; removed from the job)",
                      "n3": "n3 (DRAIN: disk errors)", "n4": "n4 (NOT_RESPONDING: Not responding)"}
    assert placement.failed_nodes(["n1", "n5"], {"n1"}, health) == {"n5": "n5 (removed from the job)"}
    assert placement.failed_nodes(["n1"], {"n1"}, health) == {}


def test_the_batch_host_is_the_first_spare_and_failed_nodes_are_left_out():
    nodes = ("n1", "n2", "n3")
    first = placement.plan(nodes, 1, 2, batch_host="n1")
    assert first == placement.Placement(("n2", "n3"), 2, narrowed=True)
    assert placement.plan(nodes, 1, 2, {"n3": "n3 (DOWN)"}, batch_host="n1").nodes == ("n1", "n2")
    assert placement.plan(nodes, 0, None).narrowed is False
    with pytest.raises(NodeFailureError) as failure:
        placement.plan(nodes, 1, 2, {"n2": "n2 (DOWN: fan)", "n3": "n3 (DRAIN: disk)"}, batch_host="n1")
    message = str(failure.value)
    assert message.startswith("node(s) n2 (DOWN: fan); n3 (DRAIN: disk) of this job failed, and its trainers "
                              "need 2 node(s) where 1 healthy one(s) remain (n1): not restarted")
    assert "--spare-nodes K" in message and "fixed global batch" in message
    with pytest.raises(NodeFailureError, match="need 2 node"):
        placement.plan(("n1", "n2"), 0, None, ["n2"])
    with pytest.raises(ConfigError, match="EDDIS_SPARE_NODES=2, but the job holds 2 node"):
        placement.plan(("n1", "n2"), 2, 1)


def test_tasks_per_node_of_a_job_with_spares():
    assert placement.tasks_per_node({"SLURM_NTASKS_PER_NODE": "4", "SLURM_TASKS_PER_NODE": "4(x2)"}) == 4
    assert placement.tasks_per_node({"SLURM_TASKS_PER_NODE": "2(x3)"}) == 2
    with pytest.raises(ConfigError, match="the same number of tasks on every node"):
        placement.tasks_per_node({"SLURM_TASKS_PER_NODE": "2,1"})


def test_steps_name_their_nodes_only_when_the_job_holds_spares():
    component = Component(None, 2, 4)
    narrowed = placement.Placement(("n2",), 2, narrowed=True)
    assert server_step_command(component, 0, narrowed)[3:7] == [
        "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--nodelist=n2"]
    assert trainer_step_command([component], ["t.py"], narrowed) == [
        "srun", "--job-name=eddis-train", "--mpi=pmix", "--kill-on-bad-exit=1", "--nodes=1", "--ntasks=2",
        "--ntasks-per-node=2", "--nodelist=n2", "eddis-train", "t.py"]
    whole = placement.Placement(("n1", "n2"), 2, narrowed=False)
    assert server_step_command(component, 0, whole) == server_step_command(component, 0)
    assert trainer_step_command([component], ["t.py"], whole) == trainer_step_command([component], ["t.py"])
    assert stepcommands.server_count([component], narrowed) == 1 and stepcommands.server_count([component]) == 2


def test_job_nodes_span_every_component():
    assert allocation.job_nodes({"SLURM_JOB_NODELIST": "n[1-3]"}) == ("n1", "n2", "n3")
    assert allocation.job_nodes({"SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "a[1-2]",
                             "SLURM_JOB_NODELIST_HET_GROUP_1": "v1"}) == ("a1", "a2", "v1")


def test_a_job_script_with_spare_nodes_asks_for_them_and_for_no_kill():
    text = render_job_script(components=[JobComponent("a100", nodes=2, tasks_per_node=4, gpu_type="a100",
                                                      gpus_per_node=4, spare_nodes=1)])
    assert "#SBATCH --nodes=3\n" in text and "#SBATCH --no-kill\n" in text
    assert "export EDDIS_SPARE_NODES=1\n" in text
    plain = render_job_script(components=[JobComponent("a100", nodes=2, tasks_per_node=4)])
    assert "--no-kill" not in plain and "EDDIS_SPARE_NODES" not in plain
    with pytest.raises(ConfigError, match="spare nodes are for a job of one component"):
        render_job_script(components=[JobComponent("a100", 1, 1, spare_nodes=1), JobComponent("v100", 1, 1)])


def test_no_kill_is_read_from_the_scripts_sbatch_lines_and_sbatchs_variable():
    spare = render_job_script(components=[JobComponent("all", nodes=1, tasks_per_node=1, spare_nodes=1)])
    assert script_asks_no_kill(spare)
    assert not script_asks_no_kill(render_job_script(components=[JobComponent("all", nodes=2, tasks_per_node=1)]))
    assert script_asks_no_kill("#!/bin/bash\n# a comment\n\n#SBATCH -N 2 -k  # keep it\nsrun x\n")
    assert not script_asks_no_kill("#!/bin/bash\n#SBATCH --no-kill\n#SBATCH --no-kill=off\n")
    assert script_asks_no_kill("#!/bin/bash\n#SBATCH --no-kill=set\n")
    # sbatch stops reading #SBATCH lines at the first command, and "# SBATCH" is a comment
    assert not script_asks_no_kill("#!/bin/bash\nexport A=1\n#SBATCH --no-kill\n")
    assert not script_asks_no_kill("#!/bin/bash\n# SBATCH --no-kill\n #SBATCH --no-kill\n")
    # the variable overrides the script, which is then not read (no Slurm asked)
    assert job_no_kill("1", {"SBATCH_NO_KILL": "set"}) is True
    assert job_no_kill("1", {"SBATCH_NO_KILL": "off"}) is False


def test_spare_nodes_without_no_kill_are_a_loud_warning_naming_the_fix():
    warning = placement.spares_without_no_kill(["n1"], no_kill=False)
    assert warning.startswith("WARNING: EDDIS_SPARE_NODES=1, but this job did not ask for --no-kill")
    assert "spare node(s) n1 are never used" in warning and "`#SBATCH --no-kill`" in warning
    assert "command line is invisible to the job" in warning
    assert "could not show this job's batch script" in placement.spares_without_no_kill(["n1"], None)
    assert placement.spares_without_no_kill(["n1"], True) is None
    assert placement.spares_without_no_kill([], False) is None


def test_submit_adds_spare_nodes_the_partition_has():
    parts = parse_sinfo("all|gpu:a100:2|3|4|up\nv100|gpu:v100:2|1|4|up\n")
    (component,) = plan_components([("a100", 4)], parts, spare_nodes=1)
    assert (component.nodes, component.spare_nodes, component.tasks_per_node) == (2, 1, 2)
    with pytest.raises(ConfigError, match="with --spare-nodes 2 needs 4 node"):
        plan_components([("a100", 4)], parts, spare_nodes=2)
    with pytest.raises(ConfigError, match="--spare-nodes is for a job of one GPU type"):
        plan_components([("a100", 2), ("v100", 2)], parts, spare_nodes=1)


def test_ranks_that_recorded_no_exit_are_found(tmp_path):
    """srun returns 0 when Slurm kills a failed node's tasks under a --no-kill job; only the
    ranks' own records tell that those never exited."""
    from eddis.launch import jobsteps
    from eddis.launch.report import LaunchRecords

    assert jobsteps.ranks_without_exit(tmp_path) == []
    records = LaunchRecords(tmp_path, "46.1")
    for rank in (0, 1, 2):
        records.start(rank, {"rank": rank, "size": 4, "host": "n2"})
    records.finish(1, {"rank": 1, "code": 0, "why": "exited"})
    assert jobsteps.ranks_without_exit(tmp_path) == [0, 2, 3]
    for rank in (0, 2, 3):
        records.finish(rank, {"rank": rank, "code": 0, "why": "exited"})
    assert jobsteps.ranks_without_exit(tmp_path) == []


def test_an_interrupt_is_read_from_every_ranks_exit_record(tmp_path):
    """srun --kill-on-bad-exit can end the last ranks with SIGTERM after the first exited 130:
    the job was still interrupted when every rank recorded that SIGINT stopped it."""
    import signal

    from eddis.launch import jobsteps
    from eddis.launch.report import LaunchRecords

    assert not jobsteps.every_rank_interrupted(tmp_path)
    records = LaunchRecords(tmp_path, "31.2")
    for rank in range(4):
        records.start(rank, {"rank": rank, "size": 4, "host": "n1"})
    for rank in range(3):
        records.finish(rank, {"rank": rank, "code": 130, "why": "stopped", "stop_signal": int(signal.SIGINT)})
    assert not jobsteps.every_rank_interrupted(tmp_path)  # rank 3 recorded nothing
    records.finish(3, {"rank": 3, "code": None, "signal": 15, "why": "stopped", "stop_signal": int(signal.SIGTERM)})
    assert not jobsteps.every_rank_interrupted(tmp_path)  # scancel's SIGTERM, not an interrupt
    records.finish(3, {"rank": 3, "code": 0, "why": "stopped", "stop_signal": int(signal.SIGINT)})
    assert jobsteps.every_rank_interrupted(tmp_path)


def test_srun_dying_after_every_rank_finished_is_told_from_a_failed_training(tmp_path):
    """Slurm 22.05's srun can abort at the end of a hetjob step whose ranks all finished: the
    job reads its ranks' records, and only a training every rank finished outlives srun's signal."""
    from eddis.launch import jobsteps
    from eddis.launch.report import LaunchRecords

    assert not jobsteps.every_rank_finished(tmp_path)  # no launch at all
    records = LaunchRecords(tmp_path, "52.1")
    for rank in range(4):
        records.start(rank, {"rank": rank, "size": 4, "host": "n1"})
    for rank in range(3):
        records.finish(rank, {"rank": rank, "code": 0, "why": "exited"})
    assert not jobsteps.every_rank_finished(tmp_path)  # rank 3 recorded nothing
    records.finish(3, {"rank": 3, "code": 0, "why": "stopped", "stop_signal": 15})
    assert not jobsteps.every_rank_finished(tmp_path)  # stopped by its supervisor: not finished
    records.finish(3, {"rank": 3, "code": 0, "why": "exited"})
    assert jobsteps.every_rank_finished(tmp_path)
    records.fail(2, {"rank": 2, "code": 1, "why": "exited", "time": 1.0})
    assert not jobsteps.every_rank_finished(tmp_path)  # a failure record outweighs its exit


def test_eddis_submit_spare_nodes_reach_the_script():
    import argparse

    from eddis.slurm import submit

    parser = argparse.ArgumentParser()
    submit.add_arguments(parser)
    args = parser.parse_args(["--gpus", "a100:2", "--spare-nodes", "1", "--dry-run", "train.py"])
    text = submit.build_script(args, parse_sinfo("a100|gpu:a100:2|2|4|up\n"))
    assert "#SBATCH --nodes=2\n" in text and "#SBATCH --ntasks-per-node=2\n" in text
    assert "#SBATCH --no-kill\n" in text and "export EDDIS_SPARE_NODES=1\n" in text
