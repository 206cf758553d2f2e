"""``python -m eddis.launch.orted_agent NODE WORD...``: Open MPI's remote agent inside a Slurm job.

``mpirun``'s rsh launcher (:mod:`eddis.launch.mpirun_step`) runs its agent as ssh: the node, then
the words of a shell command that starts that node's ``orted``. This runs them there as one
Slurm step of the trainers (``--job-name`` as the srun trainer step's, so the job's step
bookkeeping finds it), beside the smb-servers (``--overlap``), with the node's GPUs (a step gets
the job's GPUs on its node by default) and without Slurm's MPI plugin, which would kill the step
when a rank is lost (the reason for ``mpirun``). ``--kill-on-bad-exit=0``: the step of a lost
node must not end the others.
"""
import os
import sys

from .jobsteps import TRAINER_STEP_NAME
from .mpirun_step import parse_host_groups

USAGE = "usage: python -m eddis.launch.orted_agent NODE COMMAND... (mpirun's plm_rsh_agent in an elastic job)"


def srun_command(node, words, env):
    """The srun that runs ``words`` (a shell command line, as ssh would) on ``node``."""
    het = []
    if int(env.get("SLURM_HET_SIZE") or 1) > 1:
        group, _ = parse_host_groups(env.get("EDDIS_HOST_GROUPS")).get(node, (None, 0))
        if group is None:
            raise SystemExit(f"eddis orted agent: node {node} is not in EDDIS_HOST_GROUPS="
                             f"{env.get('EDDIS_HOST_GROUPS')!r}")
        het = [f"--het-group={group}"]
    return ["srun", *het, f"--job-name={TRAINER_STEP_NAME}", "--overlap", "--nodes=1", "--ntasks=1",
            f"--nodelist={node}", "--mpi=none", "--kill-on-bad-exit=0", "/bin/sh", "-c", " ".join(words)]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        raise SystemExit(USAGE)
    command = srun_command(argv[0], argv[1:], os.environ)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
