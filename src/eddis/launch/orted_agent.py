"""``python -m eddis.launch.orted_agent NODE WORD...``: Open MPI's remote agent inside a Slurm job.

``mpirun``'s rsh launcher (:mod:`eddis.launch.mpirun_step`) runs its agent as ssh: the node, then
the words of a shell command that starts that node's ``orted``. This runs them there as one
Slurm step of the trainers (``--job-name`` as the srun trainer step's, so the job's step
bookkeeping finds it), beside the smb-servers (``--overlap``), with the node's GPUs (a step gets
the job's GPUs on its node by default) and without Slurm's MPI plugin, which would kill the step
when a rank is lost (the reason for ``mpirun``). ``--kill-on-bad-exit=0``: the step of a lost
node must not end the others.

On the node the step runs ``python -m eddis.launch.orted_agent --daemon WORD...``, which blocks
SIGTERM and becomes the ``orted`` (:func:`exec_daemon`): at a preemption Slurm sends SIGTERM to
every process of every step, and an ``orted`` that took it would end its ranks at once, before
they write the checkpoint that SIGTERM asks them for (their own SIGTERM reaches them directly;
the ranks start with every signal unblocked). The daemon still ends when ``mpirun`` tells it to,
and with SIGKILL at the end of Slurm's grace time or ``KillWait``.
"""
import os
import shlex
import signal
import sys

from ..errors import ConfigError
from .jobsteps import TRAINER_STEP_NAME
from .mpirun_step import AGENT_MODULE, parse_host_groups

USAGE = "usage: python -m eddis.launch.orted_agent NODE COMMAND... (mpirun's plm_rsh_agent in an elastic job)"
DAEMON_FLAG = "--daemon"
SHELL_SYNTAX = (";", "&&", "||", "|", "&", "<", ">", "(", ")")


def srun_command(node, words, env):
    """The srun that runs ``words`` (a shell command line, as ssh would) on ``node``."""
    het = []
    if int(env.get("SLURM_HET_SIZE") or 1) > 1:
        group, _ = parse_host_groups(env.get("EDDIS_HOST_GROUPS")).get(node, (None, 0))
        if group is None:
            raise ConfigError(f"node {node} is not in EDDIS_HOST_GROUPS={env.get('EDDIS_HOST_GROUPS')!r}: "
                              "mpirun was given a host the job did not place")
        het = [f"--het-group={group}"]
    return ["srun", *het, f"--job-name={TRAINER_STEP_NAME}", "--overlap", "--nodes=1", "--ntasks=1",
            f"--nodelist={node}", "--mpi=none", "--kill-on-bad-exit=0",
            sys.executable, "-m", AGENT_MODULE, DAEMON_FLAG, *words]


def daemon_argv(words):
    """The daemon's command line as argv, or None when it needs a shell (``;``, ``&&``,
    redirections, ``VAR=value`` prefixes: what mpirun writes with --prefix)."""
    argv = shlex.split(" ".join(words))
    if not argv or any(w in SHELL_SYNTAX for w in argv) or "=" in argv[0]:
        return None
    return argv


def exec_daemon(words):
    """Become the node's daemon with SIGTERM blocked (see the module docstring); a command that
    needs a shell runs under /bin/sh, which unblocks it again."""
    argv = daemon_argv(words) or ["/bin/sh", "-c", " ".join(words)]
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    os.execvp(argv[0], argv)


def main(argv=None):
    """Exec the srun (or, with --daemon, the daemon); status 2 and the reason when it cannot."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == [DAEMON_FLAG] and len(argv) > 1:
            exec_daemon(argv[1:])
        if len(argv) < 2:
            raise ConfigError(USAGE)
        command = srun_command(argv[0], argv[1:], os.environ)
        os.execvp(command[0], command)
    except (ConfigError, OSError) as exc:
        print(f"eddis orted agent: error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
