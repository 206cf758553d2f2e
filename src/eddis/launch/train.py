"""``eddis-train``: start EDDIS trainers.

Usage::

    eddis-train --job -- train.py [args]          # the command of a job script (eddis_job.sh)
    srun --mpi=pmix eddis-train train.py [args]   # one rank's supervisor, as the job starts them
    eddis-train --local -n 4 train.py [args]      # one machine, no Slurm: server + 4 ranks
    eddis-train --local -n 4 -m pkg.train [args]  # a module, as python -m runs it (every form)
    eddis-train train.py [args]                   # the same as --local -n 1

Under srun (or under the mpirun that ``--local`` starts) ``eddis-train`` is the
supervisor of one rank: it maps the launcher's variables onto the EDDIS_* rank
environment, binds the rank to one GPU, runs the trainer as its child with every
output line prefixed ``[rank@host]``, and stops the rank when a peer fails (see
:mod:`eddis.launch.supervisor`). ``--job`` runs a whole job inside its Slurm
allocation (:mod:`eddis.launch.jobrun`): servers, trainers, their supervision and
the report. Helper modes for hand-written job scripts and for the steps ``--job``
starts: ``--check``, ``--create-run-dir DIR``, ``--smb-server I``,
``--wait-servers N``, ``--guard-trainers PID``, ``--report`` and ``--retire-run-dir``.

Every mode checks the settings first (a misspelt EDDIS_/SMB_ variable is an error
naming the closest registered one), and a launch checks that the training script
exists, before anything is started.
"""
import argparse
import os
import sys

from .. import settings
from ..errors import ConfigError, EddisError
from ..slurm.command import missing_script


def build_parser():
    p = argparse.ArgumentParser(
        prog="eddis-train",
        description="Run an EDDIS training script on every rank of a Slurm step (srun) "
                    "or locally with an SMB server and N MPI ranks (--local).",
        epilog="Settings (EDDIS_*, SMB_*) are read from the environment: see `eddis settings` "
               "and docs/user-guide.md.")
    p.add_argument("--local", action="store_true",
                   help="start an smb-server and N ranks with mpirun on this machine (no Slurm needed)")
    p.add_argument("-n", "--np", type=settings.REGISTRY["EDDIS_SIZE"].flag_type("-n"), default=None, metavar="N",
                   help="number of ranks for --local (default 1)")
    p.add_argument("--memory", default=None, metavar="SIZE", type=settings.REGISTRY["SMB_MEMORY"].flag_type(keep_text=True),
                   help="memory the local smb-server lends, e.g. 1G (default: SMB_MEMORY)")
    p.add_argument("--mode", default=None, type=settings.REGISTRY["EDDIS_MODE"].flag_type(),
                   help="training mode, exported as EDDIS_MODE: " + ", ".join(settings.REGISTRY["EDDIS_MODE"].choices))
    p.add_argument("--timeline", default=None, metavar="DIR", type=settings.REGISTRY["EDDIS_TIMELINE"].flag_type(),
                   help="Chrome-trace timeline of every rank and server into DIR (EDDIS_TIMELINE); "
                        "merge with `eddis prof merge DIR`")
    p.add_argument("--profile", action="store_true",
                   help="record per-step figures into <run dir>/profile.h5 (EDDIS_PROFILE=1); "
                        "read with `eddis prof report`")
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="run directory (default: EDDIS_RUN_DIR, else ~/.eddis/run/<job>)")
    p.add_argument("--job", action="store_true",
                   help="run the EDDIS job of this Slurm allocation, the one command of a job script: "
                        "one smb-server per node, then the trainers (srun), their supervision and the "
                        "root-cause report; exits with the job's status")
    helpers = p.add_argument_group("helpers for job scripts")
    helpers.add_argument("--check", action="store_true",
                         help="check the settings in the environment and that the training script exists, "
                              "then exit (0: fine, 2: not, with the reason)")
    helpers.add_argument("--smb-server", type=int, metavar="INDEX",
                         help="run smb-server INDEX of the run dir under a supervisor that records how it "
                              "ends and names it when it dies or hangs (EDDIS_LIVENESS_TIMEOUT)")
    helpers.add_argument("--create-run-dir", metavar="DIR", help="create DIR with its token and exit")
    helpers.add_argument("--wait-servers", type=int, metavar="N",
                         help="wait until N smb-servers have published in the run dir, then exit")
    helpers.add_argument("--timeout", type=float, default=None,
                         help="seconds for --wait-servers (default EDDIS_SERVER_WAIT)")
    helpers.add_argument("--watch-pid", type=int, action="append", default=[],
                         help="with --wait-servers: fail at once if this process (a server step) ends")
    helpers.add_argument("--guard-trainers", type=int, metavar="PID",
                         help="return when the trainers' srun PID ends; if it has not EDDIS_STEP_END_GRACE s "
                              "after every rank recorded its exit, end it and write launch/trainers.status")
    helpers.add_argument("--report", action="store_true",
                         help="print the root-cause report of the run dir's last failed launch on stderr, "
                              "and the job's status on stdout: the root cause's, else --exit-code")
    helpers.add_argument("--retire-run-dir", action="store_true",
                         help="at the job's end: delete the run dir's token and address files, keep the "
                              "job's outputs")
    helpers.add_argument("--exit-code", type=int, default=None,
                         help="with --report: the job's exit code, for the report")
    p.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE [ARGS]",
                   help="-m MODULE [ARGS]: run library module MODULE as the training script, as "
                        "python -m does; the arguments after it are the module's, passed on untouched")
    p.add_argument("script", nargs=argparse.REMAINDER,
                   help="training script and its arguments (a .py file, or a program)")
    return p


def parse_args(argv=None):
    """The parsed command line; with -m, ``script`` is ``-m MODULE [ARGS]`` as it was given
    (argparse would take a ``--`` among the module's arguments for its own)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.module is not None:
        args.script = argv[argv.index("-m"):]
        if not args.module or args.module[0].startswith("-"):
            raise ConfigError("-m needs a module name right after it, as python -m does: "
                              "eddis-train --local -n 2 -m MODULE [ARGS]")
    return args


def main(argv=None):
    try:
        args = parse_args(argv)
        return _dispatch(args)
    except EddisError as exc:
        print(f"eddis-train: error: {exc}", file=sys.stderr, flush=True)
        return 2


def _script(args):
    script = list(args.script)
    return script[1:] if script and script[0] == "--" else script


def _dispatch(args):
    from . import jobsteps

    # before anything starts, once: under Slurm every later step would print it again
    settings.check_environment()
    if args.mode is not None:
        os.environ["EDDIS_MODE"] = args.mode
    if args.timeline is not None:
        os.environ["EDDIS_TIMELINE"] = os.path.abspath(os.path.expanduser(args.timeline))
    if args.profile:
        os.environ["EDDIS_PROFILE"] = "1"
    if args.run_dir is not None:
        os.environ["EDDIS_RUN_DIR"] = os.path.abspath(os.path.expanduser(args.run_dir))
    if args.check or args.job:
        problem = missing_script(_script(args))
        if problem is not None:
            raise ConfigError(f"{problem}; nothing was started")
        if args.check:
            return 0
        if not _script(args):
            raise ConfigError("--job needs the training command: eddis-train --job -- train.py [args]")
        from .jobrun import run_job

        return run_job(_script(args))
    if args.create_run_dir:
        print(jobsteps.create_run_dir(args.create_run_dir))
        return 0
    if args.smb_server is not None:
        from .serverstep import serve

        return serve(jobsteps.run_dir(), args.smb_server, args.memory)
    if args.guard_trainers is not None:
        return jobsteps.guard_trainer_step(jobsteps.run_dir(), args.guard_trainers)
    if args.wait_servers is not None:
        return jobsteps.wait_servers(jobsteps.run_dir(), args.wait_servers, args.timeout, args.watch_pid)
    if args.report:
        return jobsteps.print_report(jobsteps.run_dir(), args.exit_code)
    if args.retire_run_dir:
        from ..smb.rundir import retire_run_dir

        retire_run_dir(jobsteps.run_dir())
        return 0

    script = _script(args)
    if not script:
        build_parser().print_usage(sys.stderr)
        print("eddis-train: error: give the training script, e.g. eddis-train train.py", file=sys.stderr)
        return 2
    problem = missing_script(script)
    if problem is not None:  # before a server and every rank start only to find it
        raise ConfigError(f"{problem}; nothing was started")

    from .rankenv import CachedGres, detect
    from .report import LAUNCH_DIR, launch_key

    env = os.environ
    under_launcher = ("SLURM_PROCID" in env and "SLURM_STEP_ID" in env) or "OMPI_COMM_WORLD_RANK" in env
    if args.local or not under_launcher:
        from .local import run_local

        return run_local(script, ranks=args.np or 1, memory=args.memory)
    from .supervisor import Supervisor

    run_dir = jobsteps.run_dir()
    info = detect(env, gres_lookup=CachedGres(str(run_dir / LAUNCH_DIR / launch_key(env) / "nodes")))
    return Supervisor(script, info, run_dir).run()


if __name__ == "__main__":
    sys.exit(main())
