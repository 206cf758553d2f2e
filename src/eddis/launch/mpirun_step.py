"""The trainers of an elastic Slurm job with more than one rank on a node, started by Open MPI's
``mpirun`` inside the allocation.

Why not ``srun --mpi=pmix`` as for every other job: Slurm's PMIx plugin (22.05, ``mpi/pmix_v4``)
answers any PMIx error event of a step with ``slurm_kill_job_step(SIGKILL)``, and the PMIx server
in slurmstepd raises one (``status = -61``, lost connection) when an MPI process ends without
finalizing while another rank of the step shares its node. A lost rank beside a live one would
take the whole trainer step down, elastic or not; no setting turns that handler off. With one
rank a node the event does not come, and srun stays (:func:`needs_mpirun`), the launch every
other job has.

Under ``mpirun`` Open MPI's own daemons (``orted``) are the PMIx servers, and the ORTE parameters
of :data:`eddis.launch.elastic.MPIRUN_OPTIONS` keep the job up when a process ends badly. Each
node's ``orted`` still runs in a Slurm step: ``mpirun`` starts it through its rsh launcher, whose
agent (:mod:`eddis.launch.orted_agent`) is one ``srun`` per node, so Slurm accounts for it, gives
it the node's GPUs and ends it with the job. The batch host's ranks are ``mpirun``'s own children.

Open MPI's Slurm support is left out on purpose (``ras``/``plm`` slurm): it knows neither hetjob
components nor a placement that leaves spare nodes out; the hosts and their ranks are given
explicitly here. Each rank learns its group (the hetjob component, else its node) from
EDDIS_HOST_GROUPS, which :func:`host_groups_text` writes and
:func:`eddis.launch.rankenv.from_openmpi` reads.

``orte_enable_recovery``: when a node is lost with its ``orted``, ``mpirun`` goes on with the
others instead of aborting them; it also never learns that the lost ranks ended, so the trainer
guard (:func:`eddis.launch.jobsteps.guard_trainer_step`) ends it once the survivors have finished.
"""
import os
import shutil
import sys
from collections import Counter
from dataclasses import dataclass

from ..errors import ConfigError
from .elastic import MPIRUN_OPTIONS
from .hostlist import expand_hostlist, expand_tasks_per_node

AGENT_MODULE = "eddis.launch.orted_agent"
# node daemons started through our agent, not Open MPI's Slurm launcher; the node's own
# environment (its TaskProlog, its modules) must win over the batch host's OMPI_MCA_* values
ORTE_LAUNCH_OPTIONS = ("--mca", "plm", "rsh", "--mca", "ras", "^slurm",
                       "--mca", "plm_rsh_no_tree_spawn", "1",
                       "--mca", "plm_rsh_pass_environ_mca_params", "0",
                       "--mca", "orte_enable_recovery", "1")


@dataclass(frozen=True)
class TrainerHost:
    """One node of the trainer step: its ``ranks`` and its ``group`` (hetjob component, else node
    index); ``het_group``: the component srun must name for a step there, None in a plain job."""

    name: str
    ranks: int
    group: int
    het_group: object = None


def _tasks_on(nodes, text, what):
    counts = expand_tasks_per_node(text or "")
    if len(counts) != len(nodes):
        raise ConfigError(f"{what}={text!r} does not give a task count for each of the nodes "
                          f"{','.join(nodes)}: cannot place the elastic trainers")
    return counts


def trainer_hosts(env, placement=None):
    """The nodes of the trainer step and their ranks, in rank order (srun's block distribution),
    from the allocation's variables; on ``placement``'s nodes when it leaves spares out."""
    components = int(env.get("SLURM_HET_SIZE") or 1)
    if components <= 1:
        if placement is not None and placement.narrowed:
            return [TrainerHost(n, placement.tasks_per_node, i) for i, n in enumerate(placement.nodes)]
        nodes = expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
        counts = _tasks_on(nodes, env.get("SLURM_TASKS_PER_NODE"), "SLURM_TASKS_PER_NODE")
        return [TrainerHost(n, c, i) for i, (n, c) in enumerate(zip(nodes, counts))]
    hosts = []
    for g in range(components):
        nodes = expand_hostlist(env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{g}", ""))
        name = f"SLURM_TASKS_PER_NODE_HET_GROUP_{g}"
        hosts.extend(TrainerHost(n, c, g, g) for n, c in zip(nodes, _tasks_on(nodes, env.get(name), name)))
    shared = sorted(name for name, count in Counter(h.name for h in hosts).items() if count > 1)
    if shared:
        raise ConfigError(f"node(s) {','.join(shared)} belong to more than one component of this hetjob; an "
                          "elastic run (EDDIS_ELASTIC=1) starts its trainers with mpirun, which places ranks by "
                          "node: give each component its own nodes, or unset EDDIS_ELASTIC")
    return hosts


def needs_mpirun(hosts):
    """Whether an elastic job's trainers on ``hosts`` need mpirun: a node holds more than one rank."""
    return any(h.ranks > 1 for h in hosts)


def host_groups_text(hosts):
    """EDDIS_HOST_GROUPS: ``node:group:ranks`` for each node, comma-separated."""
    return ",".join(f"{h.name}:{h.group}:{h.ranks}" for h in hosts)


def parse_host_groups(text):
    """EDDIS_HOST_GROUPS as ``{node: (group, ranks)}``; a ConfigError names a malformed entry."""
    table = {}
    for entry in (text or "").split(","):
        fields = entry.split(":")
        if len(fields) != 3 or not fields[0] or not fields[1].isdigit() or not fields[2].isdigit():
            raise ConfigError(f"EDDIS_HOST_GROUPS={text!r}: {entry!r} is not node:group:ranks (the launcher "
                              "writes this variable for the ranks of an elastic Slurm job; do not set it)")
        table[fields[0]] = (int(fields[1]), int(fields[2]))
    return table


def agent_command():
    """mpirun's remote agent: the rsh launcher runs it as ``<agent> <node> <orted command>``."""
    return f"{sys.executable} -m {AGENT_MODULE}"


def mpirun_command(hosts, train):
    """The ``mpirun`` of the trainers on ``hosts`` (:func:`trainer_hosts`): one ``eddis-train``
    supervisor per rank, as under srun."""
    if shutil.which("mpirun") is None:
        raise ConfigError("mpirun is not on PATH, and an elastic job (EDDIS_ELASTIC=1) starts its trainers "
                          "with it: load the Open MPI module (or install openmpi-bin) in the job script's "
                          "environment, or unset EDDIS_ELASTIC")
    cmd = ["mpirun", "-n", str(sum(h.ranks for h in hosts)),
           "--host", ",".join(f"{h.name}:{h.ranks}" for h in hosts),
           "--bind-to", "none", "--leave-session-attached",   # each orted stays inside its srun step
           *ORTE_LAUNCH_OPTIONS, "--mca", "plm_rsh_agent", agent_command(), *MPIRUN_OPTIONS]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + ["eddis-train", *train]
