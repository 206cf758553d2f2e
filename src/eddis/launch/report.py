"""Where ranks record what happened to them, and the root-cause report built from it.

Layout under the run directory, one folder per launch (a Slurm step or one
``--local`` run)::

    launch/<key>/ranks/<rank>.json     written at start: host, pids, command
    launch/<key>/exits/<rank>.json     written at the end: code, signal, why
    launch/<key>/failures/<rank>.json  only for a rank whose trainer failed on its own
    launch/stop                        written by a launcher that wants every rank to stop

A rank that the launcher stopped because a peer failed is not a failure. The
root cause is the failure recorded first; the report names its rank, host, exit
code (or signal) and the first Python traceback that rank printed.
"""
import json
import os
import signal
import time
from pathlib import Path

LAUNCH_DIR = "launch"
STOP_FILE = "stop"  # <run dir>/launch/stop: every supervisor of the run dir stops its trainer


def request_stop(run_dir, reason):
    """Ask every rank of the run dir to stop (gracefully, like SIGTERM), naming why."""
    write_json_atomic(Path(run_dir) / LAUNCH_DIR / STOP_FILE, {"reason": reason, "time": time.time()})


def stop_requested(run_dir):
    """The stop request's reason, or None."""
    try:
        with open(Path(run_dir) / LAUNCH_DIR / STOP_FILE) as f:
            return json.load(f).get("reason", "stop requested")
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "stop requested"


def launch_key(env):
    """A name for this launch, shared by all its ranks and distinct between launches."""
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID"):
        return f"{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"
    # Open MPI gives every process of one mpirun the same job id.
    for name in ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid"):
        if env.get(name):
            return f"mpirun-{env[name]}"
    return f"single-{os.getpid()}"


def write_json_atomic(path, record):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


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


class LaunchRecords:
    """The record folders of one launch."""

    def __init__(self, run_dir, key):
        self.root = Path(run_dir) / LAUNCH_DIR / key
        self.ranks = self.root / "ranks"
        self.exits = self.root / "exits"
        self.failures = self.root / "failures"

    def start(self, rank, record):
        write_json_atomic(self.ranks / f"{rank}.json", record)

    def finish(self, rank, record):
        write_json_atomic(self.exits / f"{rank}.json", record)

    def fail(self, rank, record):
        write_json_atomic(self.failures / f"{rank}.json", record)

    def failure_names(self):
        try:
            return [n for n in os.listdir(self.failures) if n.endswith(".json") and not n.startswith(".")]
        except OSError:
            return []

    def first_failure(self, exclude_rank=None):
        failures = [r for r in read_records(self.failures) if r.get("rank") != exclude_rank]
        return min(failures, key=lambda r: r.get("time", 0.0)) if failures else None

    def exited_ranks(self):
        return {r.get("rank") for r in read_records(self.exits)}


def launches(run_dir):
    """Launch record folders of a run dir, oldest first."""
    root = Path(run_dir) / LAUNCH_DIR
    try:
        keys = [p for p in root.iterdir() if p.is_dir()]  # (not the stop file)
    except OSError:
        return []
    return [LaunchRecords(run_dir, p.name) for p in sorted(keys, key=lambda p: p.stat().st_mtime)]


def root_cause(run_dir):
    """(first failure record, all failure records, exit records) of the latest failed launch."""
    for records in reversed(launches(run_dir)):
        failures = read_records(records.failures)
        if failures:
            failures.sort(key=lambda r: r.get("time", 0.0))
            return failures[0], failures, read_records(records.exits)
    return None, [], []


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
    lines.append(f"eddis-train: ROOT CAUSE: rank {first['rank']} on host {first['host']} "
                 f"{describe_exit(first.get('code'), first.get('signal'))} at {stamp}")
    if first.get("command"):
        lines.append(f"  command: {' '.join(first['command'])}")
    if first.get("traceback"):
        lines.append(f"  first traceback (rank {first['rank']}):")
        lines.extend("    " + t for t in first["traceback"].splitlines())
    elif first.get("tail"):
        lines.append(f"  last lines of rank {first['rank']}'s stderr:")
        lines.extend("    " + t for t in first["tail"])
    later = [f for f in failures if f is not first]
    if later:
        lines.append("  failed after it (probably as a consequence): " + ", ".join(
            f"rank {f['rank']}@{f['host']} ({describe_exit(f.get('code'), f.get('signal'))})" for f in later))
    stopped = sorted(e["rank"] for e in exits if e.get("why") == "stopped")
    if stopped:
        lines.append(f"  stopped by the launcher: rank {', '.join(map(str, stopped))}")
    if run_dir is not None:
        lines.append(f"  records: {Path(run_dir) / LAUNCH_DIR}")
    return "\n".join(lines)
