"""The command lines of a Slurm job's steps: one smb-server per node, and the trainers."""
import os

from . import mpirun_step
from .elastic import elastic_run, survives_server_loss
from .jobsteps import TRAINER_STEP_NAME

SERVER_STEP_NAME = "smb-server"


def server_step_command(component, first_index, nodes=None):
    """The srun of one component's smb-servers, one per node, indexed from ``first_index``;
    on the nodes of ``nodes`` (a :class:`~eddis.launch.placement.Placement`) when given.

    The step may use every CPU the job holds on the node (it overlaps the trainers): the
    servers' reduction threads (SMB_REDUCE_THREADS) would share one bound CPU otherwise.
    An elastic run with mirrored state outlives a lost server, so its task must not take
    the other servers down with it."""
    where = (nodes.step_options(tasks_per_node=1) if nodes is not None and nodes.narrowed else
             [f"--nodes={component.nodes}", f"--ntasks={component.nodes}", "--ntasks-per-node=1"])
    kill = "--kill-on-bad-exit=0" if survives_server_loss() else "--kill-on-bad-exit=1"
    return ["srun", *component.het_group_option(), f"--job-name={SERVER_STEP_NAME}", "--overlap", *where,
            f"--cpus-per-task={component.cpus_per_node}", "--gres=none", kill,
            # a server's index needs its node's place in the step, which only that node knows
            "bash", "-c", f"exec eddis-train --smb-server $(({first_index} + SLURM_NODEID))"]


def trainer_step_command(parts, train, nodes=None, env=None):
    """The launch of the trainers: one rank per task of every component, one MPI world; on the
    nodes of ``nodes`` (a :class:`~eddis.launch.placement.Placement`) when given.

    ``srun --mpi=pmix``, except in an elastic run with more than one rank on a node: there
    ``mpirun`` inside the allocation (:mod:`eddis.launch.mpirun_step`), since Slurm's PMIx plugin
    kills the whole step when a rank that shares its node with another is lost. Sets
    EDDIS_HOST_GROUPS in ``env`` (default: this process's environment, which the launch
    inherits) for mpirun's ranks."""
    elastic = elastic_run()
    if elastic:
        env = os.environ if env is None else env
        hosts = mpirun_step.trainer_hosts(env, nodes)
        if mpirun_step.needs_mpirun(hosts):
            env["EDDIS_HOST_GROUPS"] = mpirun_step.host_groups_text(hosts)
            return mpirun_step.mpirun_command(hosts, train)
    het = [f"--het-group={','.join(str(c.group) for c in parts)}"] if len(parts) > 1 else []
    # elastic runs: a lost rank's task must not take the survivors' step down with it (said
    # explicitly: a cluster's KillOnBadExit=1 would otherwise)
    kill = "--kill-on-bad-exit=0" if elastic else "--kill-on-bad-exit=1"
    where = [] if nodes is None else nodes.step_options()
    return ["srun", *het, f"--job-name={TRAINER_STEP_NAME}", "--mpi=pmix", kill, *where, "eddis-train", *train]


def launched_by_mpirun(argv):
    return bool(argv) and argv[0] == "mpirun"


def server_steps_end_training(ended, steps, survivable):
    """Whether ``ended`` of the job's ``steps`` smb-server steps (one per hetjob component)
    having ended stops the trainers: any of them, unless the state outlives a lost server
    (``survivable``: elastic and mirrored), where only all of them do."""
    return ended >= steps if survivable else ended > 0


def server_count(parts, nodes=None):
    return len(nodes.nodes) if nodes is not None and nodes.narrowed else sum(c.nodes for c in parts)
