"""The ``eddis`` command: one subcommand per module.

To add a subcommand, append one line to :data:`SUBCOMMANDS`:
``(name, "package.module", "one-line help")``, where the module defines

- ``add_arguments(parser)``: add its options to an ``argparse`` parser, and
- ``run(args) -> int``: do the work; the return value is the exit status.

A target may also name an object inside a module (``"package.module:Object"``)
that has the same two functions. Only the chosen subcommand's module is
imported, so ``eddis doctor`` does not pay for matplotlib or TensorFlow.
An :class:`eddis.errors.EddisError` leaving ``run`` is printed as one line
(``eddis <cmd>: error: ...``) with exit status 1 (2 for a bad setting or usage).
"""
import argparse
import importlib
import sys

from . import __version__
from .errors import ConfigError, EddisError

SUBCOMMANDS = [
    ("doctor", "eddis.doctor", "check UCX, InfiniBand, MPI, Slurm, GPUs and frameworks on this machine"),
    ("settings", "eddis.cli:SettingsCommand", "list every EDDIS_/SMB_ setting (markdown table) or check the environment"),
    ("prof", "eddis.timeline.cli", "merge timelines (prof merge DIR) and report training profiles (prof report RUN.h5)"),
    ("submit", "eddis.slurm.submit", "write the sbatch script for GPU partitions (--gpus a100:4,v100:8) and submit it"),
    ("plan", "eddis.plan.command", "predict every mode's step time on a cluster (calibrated) and recommend one"),
]


class SettingsCommand:
    """``eddis settings``: the settings registry as a markdown table; ``--check`` validates the environment."""

    @staticmethod
    def add_arguments(parser):
        parser.add_argument("--check", action="store_true",
                            help="check the EDDIS_/SMB_ variables of this environment (misspelt names, bad values)")
        parser.add_argument("--get", metavar="NAME", help="print the effective value of one setting")

    @staticmethod
    def run(args):
        from . import settings

        if args.check:
            settings.check_environment()
            print("environment ok: every EDDIS_/SMB_ variable is known and valid")
        elif args.get:
            print(settings.get(args.get))
        else:
            print(settings.markdown_table())
        return 0


def load_target(target):
    """The object a SUBCOMMANDS target names ("module" or "module:attribute")."""
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module


def _chosen_subcommand(argv):
    names = {name for name, _, _ in SUBCOMMANDS}
    for word in argv:
        if not word.startswith("-"):
            return word if word in names else None
    return None


def build_parser(argv=()):
    parser = argparse.ArgumentParser(
        prog="eddis", description="EDDIS: distributed training over SMB shared memory on Slurm clusters.")
    parser.add_argument("--version", action="version", version=f"eddis {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = _chosen_subcommand(argv)
    for name, target, help_text in SUBCOMMANDS:
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_target=target)
        if name == chosen:
            try:
                handler = load_target(target)
            except ImportError as exc:
                parser.exit(2, f"eddis {name}: not available: cannot import {target} ({exc})\n")
            handler.add_arguments(sub_parser)
            sub_parser.set_defaults(_handler=handler)
    return parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        status = args._handler.run(args)
    except ConfigError as exc:
        print(f"eddis {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except EddisError as exc:
        print(f"eddis {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
