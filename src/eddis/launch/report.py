"""Where ranks record what happened to them, and the root-cause report built from it.

Layout under the run directory, one folder per launch (a Slurm step or one
``--local`` run)::

    launch/<key>/ranks/<rank>.json     written at start: host, pids, command
    launch/<key>/exits/<rank>.json     written at the end: code, signal, why
    launch/<key>/failures/<rank>.json  only for a rank whose trainer failed on its own (or hung)
    launch/<key>/training/<rank>.json  elastic runs: written by the trainer once its set-up is over
    launch/<key>/initialized/<rank>.json  written by the trainer once eddis.init() returned
    launch/<key>/beats/<rank>.json     elastic runs: its supervisor's beat until the training started
    launch/smb-servers/started|exits|failures/<index>.json   the same for the smb-servers
    launch/supervisors/failures/<name>.json   the top eddis-train (--local, --job), found hung (.topwatch)
    launch/stop                        written by a launcher that wants every rank to stop

A rank that the launcher stopped because a peer failed is not a failure. The
root cause is the failure recorded first, except that a failed smb-server comes
before the ranks that failed within moments of it (they failed because of it);
the report names its rank (or server index), host, exit code (or signal, or why
it counts as hung) and the first Python traceback (or the stack) it printed.
"""
import json
import os
import signal
import time
from pathlib import Path

from ..smb.rundir import write_json_atomic as _write_json_atomic
from .output import FATAL_END, FATAL_START

LAUNCH_DIR = "launch"
STOP_FILE = "stop"  # <run dir>/launch/stop: every supervisor of the run dir stops its trainer
# <run dir>/launch/smb-servers-stop: every smb-server's supervisor stops its server and ends its
# step with status 0 (a step cancelled with scancel makes slurmstepd print an error line)
SERVERS_STOP_FILE = "smb-servers-stop"
SERVERS_KEY = "smb-servers"  # launch/smb-servers/: the records of the smb-server supervisors
# launch/supervisors/: the failure of a top eddis-train (--local, --job) that its sentinel found hung;
# a rank's or a server's supervisor found hung is recorded as its rank's or server's, with "supervisor"
SUPERVISORS_KEY = "supervisors"
# A rank that fails this soon before a server's failure is recorded failed because of it: the
# error of a dead server's connection reaches a rank about as fast as the exit reaches the
# server's supervisor, and a hung server is found only after EDDIS_LIVENESS_TIMEOUT anyway.
SERVER_FAILURE_SLACK = 5.0
# what a process dies of when it crashes (rather than being stopped): before eddis.init()
# returned, the start-up crash of EDDIS_START_RETRIES
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE)
# the ``why`` of a failure the launcher recorded for a rank that vanished with its supervisor
# before its training started (eddis.launch.startbeats)
VANISHED = "vanished"


def request_stop(run_dir, reason, signum=signal.SIGTERM):
    """Ask every rank of the run dir to stop, naming why. ``signum`` is what its trainer gets
    first: SIGTERM (stop), or SIGINT for an interrupt, which the script may catch as
    KeyboardInterrupt (SIGTERM and SIGKILL follow if it does not end)."""
    write_json_atomic(Path(run_dir) / LAUNCH_DIR / STOP_FILE,
                      {"reason": reason, "time": time.time(), "signal": signal.Signals(signum).name})


def stop_request(run_dir):
    """The stop request as ``(reason, signal number)``, or None."""
    try:
        with open(Path(run_dir) / LAUNCH_DIR / STOP_FILE) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "stop requested", signal.SIGTERM
    name = record.get("signal")
    signum = signal.Signals[name] if name in ("SIGINT", "SIGTERM") else signal.SIGTERM
    return record.get("reason", "stop requested"), signum


def request_servers_stop(run_dir, reason):
    """Ask every smb-server of the run dir to stop and its step to end by itself."""
    write_json_atomic(Path(run_dir) / LAUNCH_DIR / SERVERS_STOP_FILE, {"reason": reason, "time": time.time()})


def servers_stop_requested(run_dir):
    return (Path(run_dir) / LAUNCH_DIR / SERVERS_STOP_FILE).exists()


def stop_requested(run_dir):
    """The stop request's reason, or None."""
    request = stop_request(run_dir)
    return None if request is None else request[0]


def launch_key(env):
    """A name for this launch, shared by all its ranks and distinct between launches."""
    # Open MPI gives every process of one mpirun the same job id; first, because the ranks of
    # an mpirun inside a Slurm job (elastic trainers) each see the step of their node's daemon
    for name in ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid"):
        if env.get(name):
            key = f"mpirun-{env[name]}"
            return f"{env['SLURM_JOB_ID']}.{key}" if env.get("SLURM_JOB_ID") else key
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID"):
        return f"{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"
    return f"single-{os.getpid()}"


def write_json_atomic(path, record):
    """A launch record, indented for the people who read them (``launch/`` of the run dir)."""
    return _write_json_atomic(path, record, indent=1)


def read_records(folder):
    records = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return records
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                records.append(json.load(f))
        except (OSError, ValueError):
            pass  # half-written by a rank that died; the tmp+rename makes this rare
    return records


def describe_exit(code, sig):
    if sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"was killed by signal {sig} ({name})"
    return f"exited with code {code}"


def finished_ranks(exits):
    """The ranks of these exit records that finished the training: exited on their own, status 0."""
    return sorted(e["rank"] for e in exits if e.get("why") == "exited" and e.get("code") == 0)


def who(record):
    """'rank 3 on host n2', 'smb-server 1 on host n2 (pid 4711)', 'the eddis-train supervisor of
    rank 3 on host n2 (pid 4712)' or 'eddis-train --job on host n1 (pid 4700)'."""
    kind = record.get("supervisor")
    if "server" in record:
        what = f"smb-server {record['server']} on host {record.get('host')}"
    elif "rank" in record:
        what = f"rank {record.get('rank')} on host {record.get('host')}"
    else:
        return f"{kind} on host {record.get('host')} (pid {record.get('pid')})"
    if kind:
        return f"the {kind} of {what} (pid {record.get('pid')})"
    return f"{what} (pid {record.get('pid')})" if "server" in record else what


def _name(record):
    """'rank 3', 'smb-server 1', 'the supervisor of rank 3' or 'eddis-train --job'."""
    if "server" not in record and "rank" not in record:
        return record.get("supervisor")
    name = f"smb-server {record['server']}" if "server" in record else f"rank {record.get('rank')}"
    return f"the supervisor of {name}" if record.get("supervisor") else name


def describe_failure(record):
    """What happened to a failed rank or server, in words."""
    if record.get("why") == "hung":
        return f"{who(record)} hung ({record.get('hung')}) and was killed"
    if record.get("why") == VANISHED:
        return (f"{who(record)} was lost before its training started (no sign of life from its "
                f"eddis-train supervisor for {record.get('waited')} s: lost with its node?)")
    return f"{who(record)} {describe_exit(record.get('code'), record.get('signal'))}"


def _short(record):
    name = _name(record)
    what = record.get("why") if record.get("why") in ("hung", VANISHED) else \
        describe_exit(record.get("code"), record.get("signal"))
    return f"{name}@{record.get('host')} ({what})"


class LaunchRecords:
    """The record folders of one launch."""

    def __init__(self, run_dir, key):
        self.root = Path(run_dir) / LAUNCH_DIR / key
        self.ranks = self.root / "ranks"
        self.exits = self.root / "exits"
        self.failures = self.root / "failures"
        self.training = self.root / "training"
        self.initialized = self.root / "initialized"
        self.beats = self.root / "beats"

    def start(self, rank, record):
        write_json_atomic(self.ranks / f"{rank}.json", record)

    def finish(self, rank, record):
        write_json_atomic(self.exits / f"{rank}.json", record)

    def fail(self, rank, record):
        write_json_atomic(self.failures / f"{rank}.json", record)

    def started_file(self, rank):
        """Where the trainer of ``rank`` notes that its training started (EDDIS_STARTED_FILE)."""
        return self.training / f"{rank}.json"

    def has_started(self, rank):
        return self.started_file(rank).exists()

    def init_file(self, rank):
        """Where the trainer of ``rank`` notes that eddis.init() returned (EDDIS_INIT_FILE)."""
        return self.initialized / f"{rank}.json"

    def beat_file(self, rank):
        """Where the supervisor of ``rank`` beats until its training started (elastic runs)."""
        return self.beats / f"{rank}.json"

    def has_initialized(self, rank):
        return self.init_file(rank).exists()

    def failure_names(self):
        try:
            return [n for n in os.listdir(self.failures) if n.endswith(".json") and not n.startswith(".")]
        except OSError:
            return []

    def first_failure(self, exclude_rank=None, lost=None):
        """The first failure record, not of ``exclude_rank``; with ``lost``, only those whose
        ``lost`` (an elastic run's rank lost after its training started) is that."""
        failures = [r for r in read_records(self.failures) if r.get("rank") != exclude_rank
                    and (lost is None or bool(r.get("lost")) == lost)]
        return min(failures, key=lambda r: r.get("time", 0.0)) if failures else None

    def exited_ranks(self):
        return {r.get("rank") for r in read_records(self.exits)}


def launches(run_dir):
    """Launch record folders of a run dir, oldest first."""
    root = Path(run_dir) / LAUNCH_DIR
    try:
        keys = [p for p in root.iterdir() if p.is_dir() and p.name not in (SERVERS_KEY, SUPERVISORS_KEY)]
    except OSError:
        return []
    return [LaunchRecords(run_dir, p.name) for p in sorted(keys, key=lambda p: p.stat().st_mtime)]


class ServerRecords(LaunchRecords):
    """The smb-servers' records: ``started/`` in place of ``ranks/``, which names ranks only."""

    def __init__(self, run_dir):
        super().__init__(run_dir, SERVERS_KEY)
        self.ranks = self.root / "started"


def server_records(run_dir):
    return ServerRecords(run_dir)


def supervisor_records(run_dir):
    return LaunchRecords(run_dir, SUPERVISORS_KEY)


def _latest_failed(every):
    """(records, failure records) of the newest of the launches ``every`` with a failure,
    else (None, [])."""
    for records in reversed(every):
        failed = read_records(records.failures)
        if failed:
            return records, failed
    return None, []


def root_cause(run_dir):
    """(root-cause record, all failure records, exit records) of the latest failed launch.

    Failed smb-servers take part: a server failure is the root cause unless a rank
    failed more than SERVER_FAILURE_SLACK s before it."""
    return _root_cause_and_launch(run_dir)[:3]


def _root_cause_and_launch(run_dir):
    """root_cause's three, and the LaunchRecords of the latest launch with a rank's failure
    (None when no rank failed)."""
    servers = read_records(server_records(run_dir).failures)
    every = launches(run_dir)
    latest, ranks = _latest_failed(every)
    exits = read_records((latest or every[-1]).exits) if every else []
    tops = read_records(supervisor_records(run_dir).failures)
    failures = sorted(servers + ranks + tops, key=lambda r: r.get("time", 0.0))
    if not failures:
        return None, [], exits, latest
    first = failures[0]
    if servers and "server" not in first:
        server = min(servers, key=lambda r: r.get("time", 0.0))
        if server["time"] - first.get("time", 0.0) <= SERVER_FAILURE_SLACK:
            first = server
    return first, [first] + [f for f in failures if f is not first], exits, latest


def start_up_crash(run_dir):
    """The root cause of the latest failed launch when it is a rank that crashed (a signal of
    CRASH_SIGNALS) before its eddis.init() returned, else None."""
    first, _, _, latest = _root_cause_and_launch(run_dir)   # latest: the root cause's launch
    if first is None or "server" in first or first.get("why") == "hung" \
            or first.get("signal") not in CRASH_SIGNALS:
        return None
    return None if latest.has_initialized(first.get("rank")) else first


def format_report(first, failures, exits, run_dir=None, job_code=None):
    """The human report of why a job failed (no prefix: it is the launcher speaking)."""
    lines = []
    if first is None:
        what = f"exited with code {job_code}" if job_code is not None else "failed"
        lines.append(f"eddis-train: the job {what}, but no rank recorded a failure: see the lines "
                     "above (an smb-server, srun or node died, or the job was cancelled).")
        if run_dir is not None:
            lines.append(f"  run dir: {run_dir}")
        return "\n".join(lines)
    stamp = time.strftime("%H:%M:%S", time.localtime(first.get("time", 0)))
    lines.append(f"eddis-train: ROOT CAUSE: {describe_failure(first)} at {stamp}")
    name = _name(first)
    if first.get("command"):
        lines.append(f"  command: {' '.join(first['command'])}")
    if first.get("stack"):
        lines.append(f"  its Python stack when it was found hung ({name}):")
        lines.extend("    " + t for t in first["stack"].splitlines())
    elif first.get("why") == "hung" and not first.get("supervisor"):  # (a supervisor's is not taken)
        lines.append(f"  no Python stack could be had from {name} (not a Python process, or it never started)")
    fatal = (first.get("traceback") or "").startswith(FATAL_START)
    if first.get("traceback"):
        lines.append(f"  {'its Python stack at the fatal signal' if fatal else 'first traceback'} ({name}):")
        lines.extend("    " + t for t in first["traceback"].splitlines())
    tail = first.get("tail") or []
    if fatal:  # what the native handler wrote after faulthandler: the stacks are above
        ends = [i for i, t in enumerate(tail) if t.startswith(FATAL_END)]
        tail = tail[ends[-1] + 1:] if ends else tail
    if tail and (fatal or not first.get("traceback")):
        lines.append(f"  last lines of {name}'s stderr:")
        lines.extend("    " + t for t in tail)
    later = [f for f in failures if f is not first]
    if later:
        lines.append("  failed after it (probably as a consequence): " + ", ".join(map(_short, later)))
    stopped = sorted(e["rank"] for e in exits if e.get("why") == "stopped")
    if stopped:
        lines.append(f"  stopped by the launcher: rank {', '.join(map(str, stopped))}")
    if run_dir is not None:
        lines.append(f"  records: {Path(run_dir) / LAUNCH_DIR}")
    return "\n".join(lines)
