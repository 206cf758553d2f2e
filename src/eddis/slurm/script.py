"""The sbatch script of an EDDIS job, as text, from typed options.

:func:`render_job_script` is pure: the same options give the same text (a golden
file test holds it). Its keyword-only parameters are the valid options; anything
else raises :class:`~eddis.errors.ConfigError` listing them. ``eddis submit``
fills the options from ``--gpus`` and Slurm's partitions; ``scripts/eddis_job.sh``
is this function's output for an a100 + v100 hetjob, for users to copy and edit.

The script is the ``#SBATCH`` lines, the settings it exports and one command,
``exec eddis-train --job -- train.py ...`` (as submitit's scripts are): the job
itself (the check of settings and script, the run directory, one ``smb-server``
per node, the trainers, their supervision and the report) is
:mod:`eddis.launch.jobrun`, so a fix there reaches scripts users copied before it.
"""
import dataclasses
import functools
import inspect
import os
import shlex
import unicodedata
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from ..errors import ConfigError
from ..settings import check_environment

# Long enough for the slowest checkpoint of a large model to reach a parallel file system;
# Slurm may send the signal up to a minute earlier than asked.
CHECKPOINT_SIGNAL_SECONDS = 300


@dataclass(frozen=True)
class JobComponent:
    """One partition of the job (one hetjob component): nodes, ranks and GPUs per node, and
    ``spare_nodes`` asked for beyond ``nodes``, which the trainers use only after a node failed
    (EDDIS_SPARE_NODES, :mod:`eddis.launch.placement`)."""

    partition: str
    nodes: int
    tasks_per_node: int
    gpu_type: Optional[str] = None
    gpus_per_node: int = 0
    spare_nodes: int = 0

    def sbatch_lines(self, time):
        lines = [f"#SBATCH --partition={self.partition}",
                 f"#SBATCH --nodes={self.nodes + self.spare_nodes}",
                 f"#SBATCH --ntasks-per-node={self.tasks_per_node}"]
        if self.gpus_per_node:
            gres = f"gpu:{self.gpu_type}:{self.gpus_per_node}" if self.gpu_type else f"gpu:{self.gpus_per_node}"
            lines.append(f"#SBATCH --gres={gres}")
        lines.append(f"#SBATCH --time={time}")
        return lines


def keyword_options(func):
    """Accept only the function's keyword-only parameters; name the valid ones otherwise."""
    params = inspect.signature(func).parameters
    valid = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    required = [n for n in valid if params[n].default is inspect.Parameter.empty]

    @functools.wraps(func)
    def wrapper(*args, **options):
        if args:
            raise ConfigError(f"{func.__name__}() takes keyword options only; valid options: {', '.join(valid)}")
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ConfigError(f"{func.__name__}(): unknown option{'s' if len(unknown) > 1 else ''} "
                              f"{', '.join(unknown)}; valid options: {', '.join(valid)}")
        missing = [n for n in required if n not in options]
        if missing:
            raise ConfigError(f"{func.__name__}(): missing option {', '.join(missing)}; "
                              f"valid options: {', '.join(valid)}")
        return func(**options)

    wrapper.valid_options = tuple(valid)
    return wrapper


JOB_BODY = r'''
set -u

# Settings of every rank and server: EDDIS_* and SMB_* (table in docs/user-guide.md).
@EXPORTS@
# What to run: the arguments after the script name (sbatch eddis_job.sh train.py --epochs 3),
# else the command written here. eddis-train --job runs the servers, the trainers and the report.
[ $# -gt 0 ] || set -- @COMMAND@
exec eddis-train --job -- "$@"
'''


# Where each option comes from in eddis submit, for the user who never called the renderer.
SUBMIT_SOURCES = {"components": "eddis submit --gpus", "command": "eddis submit's training command",
                  "job_name": "eddis submit --job-name", "time": "eddis submit --time",
                  "output": "eddis submit --output", "account": "eddis submit --account", "mode": "eddis submit --mode"}


def _texts(label, value):
    """(label, text) of every text the option ``value`` puts into the script: strings, and
    those inside sequences, mappings (keys too) and dataclasses (JobComponent), at any depth."""
    if value is None or isinstance(value, (bool, int, float)):
        return
    if isinstance(value, (str, os.PathLike)):
        yield label, os.fspath(value)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _texts(f"{label} key", key)
            yield from _texts(f"{label}[{key!r}]", item)
    elif dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            yield from _texts(f"{label}.{field.name}", getattr(value, field.name))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _texts(f"{label}[{i}]", item)
    else:
        yield label, str(value)


def refuse_control_characters(options, multiline=("comment",)):
    """Every text of every option is printable: a newline (or CR, NUL, any other control
    character) in a value written into the script would start a line of its own there, a command
    the job runs (``eddis submit --job-name $'x\\necho INJECTED'``). ``multiline`` options may
    hold newlines, since each of their lines is written as a comment line."""
    for option, value in options.items():
        allowed = "\n" if option in multiline else ""
        for label, text in _texts(option, value):
            bad = [(i, ch) for i, ch in enumerate(text) if unicodedata.category(ch) == "Cc" and ch not in allowed]
            if bad:
                where, char = bad[0]
                source = SUBMIT_SOURCES.get(option)
                raise ConfigError(
                    f"{label}{f' ({source})' if source else ''} {text!r} holds the control character "
                    f"{char!r} at position {where}, and a value written into the job script must hold none "
                    "(newline, CR, NUL, ...): it would add lines, and commands, of its own to the script. "
                    "Remove it" + ("; pass multi-line data to the training script in a file instead"
                                   if option == "command" else ""))


def time_limit_seconds(text):
    """Seconds in a Slurm time limit: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S; "UNLIMITED" is infinite."""
    spec = str(text).strip()
    if spec.upper() in ("UNLIMITED", "INFINITE"):
        return float("inf")
    days, dash, rest = spec.rpartition("-") if "-" in spec else ("0", "", spec)
    parts = rest.split(":")
    if not (days.isdigit() and parts and len(parts) <= 3 and all(p.isdigit() for p in parts)):
        raise ConfigError(f"time limit {text!r}: write minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]] "
                          "(as sbatch --time)")
    numbers = [int(p) for p in parts]
    if dash:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = (numbers + [0, 0])[:3]
    else:  # M, M:S, H:M:S
        hours, minutes, seconds = {1: (0, *numbers, 0), 2: (0, *numbers), 3: tuple(numbers)}[len(numbers)]
    return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds


@keyword_options
def render_job_script(*, components: Sequence[JobComponent], command: Sequence[str] = ("train.py",),
                      job_name: str = "eddis", time: str = "01:00:00", output: str = "eddis-%j.out",
                      account: Optional[str] = None, mode: Optional[str] = None,
                      settings: Optional[Mapping[str, str]] = None, server_wait: Optional[float] = None,
                      comment: Optional[str] = None,
                      checkpoint_signal: Optional[int] = CHECKPOINT_SIGNAL_SECONDS) -> str:
    """The sbatch script text: one #SBATCH block per component (hetjob when several).

    ``checkpoint_signal`` (seconds, None or 0 for none): Slurm sends the job SIGUSR1 that
    long before its time limit, the trainers write a checkpoint and the job requeues itself
    (:mod:`eddis.launch.jobrun`); the output file is appended to, so that every run of the
    job writes into one file."""
    refuse_control_characters(dict(locals()))  # first, and every option: no value passes unchecked
    components = list(components)
    if not components:
        raise ConfigError("render_job_script(): components is empty; give one JobComponent per partition")
    for c in components:
        if not isinstance(c, JobComponent):
            raise ConfigError(f"render_job_script(): components must be JobComponent, got {c!r}")
        if c.nodes < 1 or c.tasks_per_node < 1:
            raise ConfigError(f"component {c.partition}: nodes and tasks_per_node must be >= 1")
        if c.spare_nodes < 0:
            raise ConfigError(f"component {c.partition}: spare_nodes must be >= 0")
    spare = [c for c in components if c.spare_nodes]
    if spare and len(components) > 1:
        raise ConfigError("spare nodes are for a job of one component (one GPU type): each hetjob "
                          "component's trainers use all its nodes. Ask for one GPU type, or no spare nodes")
    if not command:
        raise ConfigError("render_job_script(): command is empty; give the training script, e.g. ('train.py',)")
    exports = dict(settings or {})
    if spare:
        exports["EDDIS_SPARE_NODES"] = str(spare[0].spare_nodes)
    if mode is not None:
        exports["EDDIS_MODE"] = mode
    if server_wait is not None:
        if isinstance(server_wait, bool) or not isinstance(server_wait, (int, float)):
            raise ConfigError(f"render_job_script(): server_wait must be a number of seconds, got {server_wait!r}")
        exports["EDDIS_SERVER_WAIT"] = f"{server_wait:g}"
    if checkpoint_signal is not None and (isinstance(checkpoint_signal, bool)
                                          or not isinstance(checkpoint_signal, int) or checkpoint_signal < 0):
        raise ConfigError(f"render_job_script(): checkpoint_signal must be whole seconds >= 0 (0: no "
                          f"warning signal, no requeue), got {checkpoint_signal!r}")
    if checkpoint_signal and checkpoint_signal >= time_limit_seconds(time):
        raise ConfigError(f"the checkpoint signal ({checkpoint_signal} s before the time limit) must come "
                          f"after the job starts, but the time limit is {time}: ask for a longer time "
                          "or a shorter signal lead (eddis submit --checkpoint-signal SECONDS; 0: none)")
    for name in exports:
        if not name.startswith(("EDDIS_", "SMB_")):
            raise ConfigError(f"setting {name}: only EDDIS_* and SMB_* settings go into the job script")
    # what the job would refuse at its start (unknown name, bad value, out of range) is refused now
    check_environment({name: str(value) for name, value in exports.items()})

    head = ["#!/bin/bash"]
    head += [f"# {line}" if line else "#" for line in (comment or "").splitlines()]
    head += ["# An EDDIS job: one smb-server per node, then the trainers (eddis-train --job).",
             "# Submit: sbatch eddis_job.sh train.py [args]   (eddis submit writes scripts like this one)",
             f"#SBATCH --job-name={job_name}",
             f"#SBATCH --output={output}"]
    if account:
        head.append(f"#SBATCH --account={account}")
    if checkpoint_signal:
        # B: the batch step only, which is eddis-train --job; it asks the trainers itself
        head += [f"#SBATCH --signal=B:USR1@{checkpoint_signal}", "#SBATCH --requeue", "#SBATCH --open-mode=append"]
    if spare:
        # Slurm keeps the job when one of its nodes fails, and removes that node from it
        head.append("#SBATCH --no-kill")
    for i, component in enumerate(components):
        if i:
            head.append("#SBATCH hetjob")
        head += component.sbatch_lines(time)
    export_lines = ("".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in sorted(exports.items()))
                    or "# export EDDIS_MODE=hybrid\n")
    body = (JOB_BODY.replace("@COMMAND@", " ".join(shlex.quote(str(a)) for a in command))
            .replace("@EXPORTS@", export_lines))
    return "\n".join(head) + "\n" + body


def example_components():
    """The a100 + v100 hetjob of scripts/eddis_job.sh (2 nodes' worth of the dev cluster)."""
    return [JobComponent("a100", nodes=1, tasks_per_node=2, gpu_type="a100", gpus_per_node=2),
            JobComponent("v100", nodes=1, tasks_per_node=2, gpu_type="v100", gpus_per_node=2)]


def example_job_script():
    return render_job_script(
        components=example_components(), command=("train.py",),
        comment="Copy and edit: one #SBATCH block per GPU partition, separated by '#SBATCH hetjob'.\n"
                "Generated by eddis.slurm.script.example_job_script(); tests keep them equal.")
