"""Which nodes of a running job failed, as Slurm sees them.

Two Slurm answers say it, and a job restarted within its allocation needs both:

- the nodes' state (``scontrol show node -o LIST``): a node that is DOWN, DRAIN(ED/ING),
  FAIL(ING) or NOT_RESPONDING (``*`` after the state) must not get the job's steps again;
- the job's current node list (``scontrol show job -o ID``): a job submitted with
  ``--no-kill`` keeps running when one of its nodes fails, and Slurm removes that node
  from the job ("Removing failed node n2 from JobId=..."), so it is gone from ``NodeList``
  while ``SLURM_JOB_NODELIST`` in the job's environment still names it; a step that asks
  for it is refused.

Whether the job itself asked Slurm to keep it when a node fails (``--no-kill``), without
which spare nodes are never used: Slurm 22.05 shows that flag neither in ``scontrol show job``
nor in ``squeue --json`` nor in the job's environment, so :func:`job_no_kill` reads the job's
batch script (``scontrol write batch_script ID -``) and sbatch's input variable
``SBATCH_NO_KILL``, which the job inherits; a ``--no-kill`` on sbatch's command line stays
invisible to it.

The parsers are pure; :func:`node_health`, :func:`job_node_lists` and :func:`job_no_kill` run
the Slurm CLI (pyslurm does not match Slurm 22.05, see :mod:`eddis.slurm.discovery`).
"""
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

SLURM_COMMAND_TIMEOUT = 10.0
# the state words (base state or flag, as scontrol writes them) of a node that must not run steps
FAILED_STATES = frozenset({"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING"})
# key=value fields of scontrol's one-line output; a value (Reason=...) may hold spaces
_FIELD = re.compile(r"(\w+)=(.*?)(?=\s+\w+=|\s*$)")


@dataclass(frozen=True)
class NodeHealth:
    """One node's state words (``State=IDLE+DRAIN`` -> ``("IDLE", "DRAIN")``) and Slurm's reason."""

    name: str
    states: Tuple[str, ...]
    reason: str = ""

    @property
    def failed(self):
        return any(word in FAILED_STATES for word in self.states)

    def condition(self):
        """``DOWN: disk gone``: its failed states (else all) and the reason an admin gave."""
        words = "+".join(w for w in self.states if w in FAILED_STATES) or "+".join(self.states)
        return f"{words}{': ' + self.reason if self.reason else ''}"

    def describe(self):
        """``n2 (DOWN: disk gone)``."""
        return f"{self.name} ({self.condition()})"


def parse_fields(line):
    """The ``Key=value`` fields of one line of ``scontrol show ... -o`` output."""
    return {key: value.strip() for key, value in _FIELD.findall(line)}


def state_words(state):
    """``IDLE*+DRAIN`` -> ``("IDLE", "NOT_RESPONDING", "DRAIN")``: a trailing ``*`` is Slurm's
    short way of saying the node does not respond."""
    words = []
    for word in (state or "").upper().split("+"):
        if not word:
            continue
        if word.endswith("*"):
            words += [word.rstrip("*"), "NOT_RESPONDING"]
        else:
            words.append(word)
    return tuple(dict.fromkeys(words))


def parse_node_lines(text):
    """``{name: NodeHealth}`` from ``scontrol show node -o`` output."""
    found = {}
    for line in text.splitlines():
        fields = parse_fields(line)
        if "NodeName" not in fields:
            continue
        reason = re.sub(r"\s*\[[^\]]*@[^\]]*\]$", "", fields.get("Reason", ""))  # "[root@time]"
        found[fields["NodeName"]] = NodeHealth(fields["NodeName"], state_words(fields.get("State")),
                                               "" if reason == "(null)" else reason)
    return found


def parse_job_node_lists(text):
    """The ``NodeList`` of each line of ``scontrol show job -o`` output (one line per hetjob
    component, in component order); ``""`` for a component that holds no node any more."""
    lists = []
    for line in text.splitlines():
        fields = parse_fields(line)
        if "JobId" in fields:
            value = fields.get("NodeList", "")
            lists.append("" if value == "(null)" else value)
    return lists


def _scontrol(argv, env):
    try:
        proc = subprocess.run(["scontrol", *argv], capture_output=True, text=True,
                              timeout=SLURM_COMMAND_TIMEOUT, env=None if env is None else dict(env))
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def node_health(nodes, env=None) -> Optional[Dict[str, NodeHealth]]:
    """``{name: NodeHealth}`` of a Slurm host list (``n[1-4]``); None when Slurm cannot be asked."""
    text = _scontrol(["show", "node", "-o", nodes], env)
    return None if text is None else parse_node_lines(text)


def job_node_lists(job_id, env=None):
    """The job's current ``NodeList`` per component (see :func:`parse_job_node_lists`); None
    when Slurm cannot be asked."""
    text = _scontrol(["show", "job", "-o", str(job_id)], env)
    return None if text is None else parse_job_node_lists(text)


def _no_kill_value(value):
    """sbatch's ``--no-kill[=set|off]``: kept (True) unless ``off``/``no``."""
    return value is None or value.strip().lower() not in ("off", "no")


def script_asks_no_kill(text):
    """Whether a batch script's ``#SBATCH`` lines ask for ``--no-kill`` (``-k``, ``--no-kill``,
    ``--no-kill=set``; ``--no-kill=off`` takes it back; the last one counts). sbatch reads them
    up to the script's first command, as this does."""
    asked = False
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not line.startswith("#SBATCH")):
            continue
        if not line.startswith("#SBATCH"):
            break
        try:
            words = shlex.split(line[len("#SBATCH"):], comments=True)
        except ValueError:
            continue
        for word in words:
            if word == "-k":
                asked = True
            elif word == "--no-kill" or word.startswith("--no-kill="):
                asked = _no_kill_value(word.partition("=")[2] if "=" in word else None)
    return asked


def job_no_kill(job_id, env=None) -> Optional[bool]:
    """Whether the running job asked for ``--no-kill``: ``SBATCH_NO_KILL`` in its environment
    (sbatch's input variable, which overrides the script), else its batch script's ``#SBATCH``
    lines; None when the script cannot be read."""
    value = (os.environ if env is None else env).get("SBATCH_NO_KILL")
    if value is not None:
        return _no_kill_value(value)
    text = _scontrol(["write", "batch_script", str(job_id), "-"], env)
    return None if text is None else script_asks_no_kill(text)
