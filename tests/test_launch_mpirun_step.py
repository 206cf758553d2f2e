"""The elastic trainers' mpirun inside a Slurm job (eddis.launch.mpirun_step): where the ranks go,
how each learns its group, and the srun the remote agent runs on each node. The launch itself
is tested on the dev cluster (tests/test_elastic_slurm.py)."""
import shlex
import subprocess
import sys

import pytest

from eddis.errors import ConfigError
from eddis.launch.mpirun_step import (TrainerHost, host_groups_text, mpirun_command, needs_mpirun,
                                      parse_host_groups, trainer_hosts)
from eddis.launch.orted_agent import daemon_argv, srun_command
from eddis.launch.placement import Placement
from eddis.launch.rankenv import detect, from_openmpi
from eddis.launch.report import launch_key

PLAIN = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1"}
HETJOB = {"SLURM_JOB_ID": "8", "SLURM_HET_SIZE": "2",
          "SLURM_JOB_NODELIST_HET_GROUP_0": "a[1-2]", "SLURM_TASKS_PER_NODE_HET_GROUP_0": "4(x2)",
          "SLURM_JOB_NODELIST_HET_GROUP_1": "v1", "SLURM_TASKS_PER_NODE_HET_GROUP_1": "2"}


def test_a_plain_jobs_nodes_are_its_groups_in_srun_block_order():
    assert trainer_hosts(PLAIN) == [TrainerHost("n1", 2, 0), TrainerHost("n2", 2, 1), TrainerHost("n3", 1, 2)]
    spares_left_out = Placement(("n1", "n3"), 2, narrowed=True)
    assert trainer_hosts(PLAIN, spares_left_out) == [TrainerHost("n1", 2, 0), TrainerHost("n3", 2, 1)]
    assert trainer_hosts(PLAIN, Placement(("n1", "n2", "n3"), 2, narrowed=False)) == trainer_hosts(PLAIN)
    assert needs_mpirun(trainer_hosts(PLAIN))
    assert not needs_mpirun(trainer_hosts(dict(PLAIN, SLURM_TASKS_PER_NODE="1(x3)")))


def test_a_hetjobs_components_are_its_groups():
    hosts = trainer_hosts(HETJOB)
    assert hosts == [TrainerHost("a1", 4, 0, 0), TrainerHost("a2", 4, 0, 0), TrainerHost("v1", 2, 1, 1)]
    assert host_groups_text(hosts) == "a1:0:4,a2:0:4,v1:1:2"
    assert parse_host_groups(host_groups_text(hosts)) == {"a1": (0, 4), "a2": (0, 4), "v1": (1, 2)}


def test_layouts_mpirun_cannot_place_are_refused_by_name():
    shared = dict(HETJOB, SLURM_JOB_NODELIST_HET_GROUP_1="a2", SLURM_TASKS_PER_NODE_HET_GROUP_1="2")
    with pytest.raises(ConfigError, match="node.s. a2 belong to more than one component"):
        trainer_hosts(shared)
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE='2' does not give a task count for each"):
        trainer_hosts(dict(PLAIN, SLURM_TASKS_PER_NODE="2"))
    with pytest.raises(ConfigError, match="'n1:x:2' is not node:group:ranks"):
        parse_host_groups("n1:x:2")


def test_mpirun_names_every_host_the_agent_and_the_orte_options(monkeypatch, tmp_path):
    mpirun = tmp_path / "mpirun"
    mpirun.write_text("#!/bin/sh\n")
    mpirun.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    command = mpirun_command(trainer_hosts(PLAIN), ["train.py", "--epochs", "3"])
    assert command[:5] == ["mpirun", "-n", "5", "--host", "n1:2,n2:2,n3:1"]
    assert command[-4:] == ["eddis-train", "train.py", "--epochs", "3"]
    options = dict(zip(command[1::2], command[2::2]))
    pairs = list(zip(command, command[1:], command[2:]))
    for name, value in (("plm", "rsh"), ("ras", "^slurm"), ("orte_enable_recovery", "1"),
                        ("orte_allowed_exit_without_sync", "1"), ("orte_abort_on_non_zero_status", "0"),
                        ("plm_rsh_pass_environ_mca_params", "0")):
        assert ("--mca", name, value) in pairs, (name, command)
    agent = command[command.index("plm_rsh_agent") + 1]
    assert agent.endswith(" -m eddis.launch.orted_agent")
    assert "--leave-session-attached" in command and options["--bind-to"] == "none"
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="mpirun is not on PATH.*EDDIS_ELASTIC"):
        mpirun_command(trainer_hosts(PLAIN), ["train.py"])


def test_the_agent_runs_each_nodes_daemon_as_a_trainer_step_there():
    words = ["orted", "-mca", "ess", '"env"']
    assert srun_command("n2", words, PLAIN) == [
        "srun", "--job-name=eddis-train", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n2", "--mpi=none",
        "--kill-on-bad-exit=0", sys.executable, "-m", "eddis.launch.orted_agent", "--daemon", *words]
    het = dict(HETJOB, EDDIS_HOST_GROUPS="a1:0:4,a2:0:4,v1:1:2")
    assert srun_command("v1", words, het)[:2] == ["srun", "--het-group=1"]
    with pytest.raises(ConfigError, match="node x9 is not in EDDIS_HOST_GROUPS"):
        srun_command("x9", words, het)
    # run as mpirun runs it: the reason and status 2, no traceback
    proc = subprocess.run([sys.executable, "-m", "eddis.launch.orted_agent", "x9", "orted"], capture_output=True,
                          text=True, timeout=60, env=dict(het, PATH="/usr/bin:/bin"))
    assert proc.returncode == 2 and "eddis orted agent: error: node x9" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_mpirun_rank_inside_slurm_takes_mpiruns_rank_and_its_nodes_group():
    # the rank on v1 sees the variables of the 1-task step that holds its node's daemon
    env = {"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "10", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "4242", "SLURM_JOB_ID": "8",
           "SLURM_STEP_ID": "3", "SLURM_PROCID": "0", "SLURMD_NODENAME": "v1",
           "EDDIS_HOST_GROUPS": "a1:0:4,a2:0:4,v1:1:2", "EDDIS_GPU_TYPE": "v100"}
    info = detect(env, gres_lookup=None)
    assert (info.launcher, info.rank, info.size, info.local_rank, info.local_size) == ("mpirun", 9, 10, 1, 2)
    assert (info.group, info.num_groups, info.group_size, info.hostname) == (1, 2, 2, "v1")
    on_a2 = from_openmpi(dict(env, SLURMD_NODENAME="a2"))
    assert (on_a2.group, on_a2.num_groups, on_a2.group_size) == (0, 2, 8)
    with pytest.raises(ConfigError, match="node x9 is not among the trainer nodes"):
        from_openmpi(dict(env, SLURMD_NODENAME="x9"))
    # every rank of the mpirun shares one launch, whichever step holds its node's daemon
    assert launch_key(env) == launch_key(dict(env, SLURM_STEP_ID="batch", SLURM_PROCID="0")) == "8.mpirun-4242"
    assert launch_key({"SLURM_JOB_ID": "8", "SLURM_STEP_ID": "3"}) == "8.3"
    assert launch_key({"OMPI_MCA_ess_base_jobid": "4242"}) == "mpirun-4242"


def test_only_an_elastic_rank_under_mpirun_ends_without_mpi_finalize():
    from eddis.core.comm.runtime import _skips_mpi_finalize

    launched = {"EDDIS_LAUNCHED": "1", "OMPI_COMM_WORLD_RANK": "0"}
    assert _skips_mpi_finalize(dict(launched, EDDIS_ELASTIC="1"))
    assert not _skips_mpi_finalize(launched)
    assert not _skips_mpi_finalize({"EDDIS_LAUNCHED": "1", "EDDIS_ELASTIC": "1", "SLURM_PROCID": "0"})
    assert not _skips_mpi_finalize({"OMPI_COMM_WORLD_RANK": "0", "EDDIS_ELASTIC": "1"})


def test_the_daemon_runs_without_a_shell_and_with_sigterm_blocked():
    """What the daemon step becomes on the node: the command itself, its quoting undone, with
    SIGTERM blocked (a preemption's SIGTERM must reach the ranks, not end them through their
    daemon); a command line that needs a shell keeps one."""
    assert daemon_argv(["orted", "-mca", "ess", '"env"', "-mca", "orte_hnp_uri", '"1.0;tcp://10.0.0.1:5"']) == \
        ["orted", "-mca", "ess", "env", "-mca", "orte_hnp_uri", "1.0;tcp://10.0.0.1:5"]
    assert daemon_argv(["PATH=/opt/ompi/bin:$PATH", ";", "export", "PATH", ";", "orted"]) is None
    probe = "import signal; print(signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []))"
    proc = subprocess.run([sys.executable, "-m", "eddis.launch.orted_agent", "--daemon", sys.executable, "-c",
                           shlex.quote(probe)], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (0, "True"), proc.stderr
