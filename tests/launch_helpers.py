"""Helpers of the launcher tests: entry-point wrappers on PATH, leftovers of a run, job polling."""
import json
import os
import re
import stat
import time
from pathlib import Path

from conftest import PYTHON, REPO, SRC

TRAINER = REPO / "tests" / "launch_scripts" / "mpi_trainer.py"


def make_bin(directory):
    """eddis-train and smb-server as the installed entry points would be, running this checkout."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, target in (("eddis-train", "eddis.launch.train"), ("smb-server", "eddis.smb.server")):
        path = directory / name
        path.write_text(f"#!/bin/sh\nexport PYTHONPATH={SRC}${{PYTHONPATH:+:$PYTHONPATH}}\n"
                        f"exec {PYTHON} -c 'import sys; from {target} import main; sys.exit(main())' \"$@\"\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return directory


def environ_of(pid):
    """A process's environment as a dict (raises OSError once it is gone)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.decode(errors="replace").partition("=")[::2] for item in f.read().split(b"\0") if item)


def processes_with_env(name, value):
    """PIDs of live processes whose environment has name=value (our run dir marks every process of a job)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if environ_of(entry).get(name) == value:
                with open(f"/proc/{entry}/cmdline", "rb") as c:
                    found.append((int(entry), c.read().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:
            continue
    return found


def shm_leftovers(run_dir, launch_marker):
    """Shared-memory files of this run still in /dev/shm: SMB arenas and Open MPI segments of its launches."""
    from eddis.smb.server import arena_name

    arena_prefix = arena_name(run_dir, 0)[1:].rsplit("-", 1)[0] + "-"
    left = []
    for root, dirs, files in os.walk("/dev/shm"):
        for name in dirs + files:
            if name.startswith(arena_prefix) or name.startswith(launch_marker):
                left.append(os.path.join(root, name))
    return left


def wait_until(predicate, timeout, interval=0.2, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def stop_every_thread(pid, timeout=10.0):
    """SIGSTOP ``pid`` and wait until every thread of it is stopped: kill() only queues the
    signal, and a server thread still running for a moment answers one more request."""
    import signal

    from eddis.launch.liveness import process_state

    os.kill(pid, signal.SIGSTOP)

    def stopped():
        tids = os.listdir(f"/proc/{pid}/task")
        return all(process_state(pid, tid) in ("T", None) for tid in tids)

    wait_until(stopped, timeout, interval=0.01, what=f"every thread of process {pid} to stop")


START_RETRY = re.compile(r"^eddis_job: .*\(start retry \d+ of \d+, EDDIS_START_RETRIES\)$", re.M)


def last_start_attempt(text):
    """The part of a job's output after its last start retry: Open MPI under Slurm's PMIx
    crashes inside MPI_Init about once in 250 starts, and the job reports that crash (a ROOT
    CAUSE) before it starts the steps again; what a test checks is the attempt that ran."""
    retries = list(START_RETRY.finditer(text))
    return text[retries[-1].end():] if retries else text


def current_rank_records(run_dir, ranks):
    """{rank: record} of the launch that is training now, or None before its ``ranks`` records
    are all there. A start retry (EDDIS_START_RETRIES) leaves the crashed launch's records,
    whose supervisors are gone, beside the new launch's; call it once that launch trains."""
    launches = {}
    for path in Path(run_dir).glob("launch/*/ranks/*.json"):
        record = json.loads(path.read_text())
        if "rank" in record:
            launches.setdefault(path.parent.parent.name, {})[record["rank"]] = record
    full = [records for records in launches.values() if len(records) == ranks]
    return max(full, key=lambda records: max(r["time"] for r in records.values())) if full else None


def wait_for_training(run_dir, out, ranks=4, timeout=120):
    """{rank: record} once every rank of the job's current launch is training: each printed
    its step 2 after the last start retry (``out``: the job's output) and the launch's records
    are all there."""
    def running():
        text = last_start_attempt(out.read_text()) if out.exists() else ""
        return all(re.search(rf"^\[{r}@\S+\] step 2 ", text, re.M) for r in range(ranks)) and \
            current_rank_records(run_dir, ranks)
    return wait_until(running, timeout, interval=0.5, what="all ranks to be training")


def peers_ended_after_root_cause(report):
    """The ranks a failure report says ended after its root cause: those the launcher stopped
    and those that failed on their own first (an MPI peer can see the lost rank's broken
    connection and abort before its supervisor's next look at the run dir, 1 s at most)."""
    stopped = re.search(r"^  stopped by the launcher: rank ([\d, ]+)$", report, re.M)
    failed = re.search(r"^  failed after it \(probably as a consequence\): (.*)$", report, re.M)
    ranks = [int(r) for r in stopped.group(1).split(", ")] if stopped else []
    ranks += [int(r) for r in re.findall(r"rank (\d+)@", failed.group(1))] if failed else []
    return sorted(ranks)


# what a job's state is while scontrol cannot say (a busy slurmctld): not an end
UNREACHABLE = "UNREACHABLE"
NOT_ENDED = ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", UNREACHABLE)


def job_state(cluster, job_id):
    """(state, exit code) of a job from scontrol (no accounting on the dev cluster); None once
    forgotten; (UNREACHABLE, why) while scontrol fails otherwise ("Socket timed out on
    send/recv operation" from a slurmctld busy on 2 cores): a wait takes that for no end."""
    proc = cluster.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=30, check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        said = (proc.stdout + proc.stderr).strip()
        return None if "Invalid job id" in said else (UNREACHABLE, said)
    first = proc.stdout.splitlines()[0]  # the het leader (component 0) carries the batch script's exit
    fields = dict(f.split("=", 1) for f in first.split() if "=" in f)
    return fields.get("JobState"), fields.get("ExitCode")


def wait_job_end(cluster, job_id, timeout, output=None):
    """Block until the job has ended and Slurm has reaped its processes; returns (state, exit code).

    On timeout the assertion carries what explains it: the job's state, the steps Slurm still
    lists and the end of the job's output (``output``: its path)."""
    def ended():
        state = job_state(cluster, job_id)
        if state is None:
            return ("FORGOTTEN", None)
        return state if state[0] not in NOT_ENDED else None
    try:
        return wait_until(ended, timeout, interval=0.5, what=f"job {job_id} to end")
    except AssertionError as exc:
        detail = _job_detail(cluster, job_id, output)
        # a job left running would hold the nodes and stall every later test
        cluster.run(["scancel", str(job_id)], timeout=30, check=False)
        raise AssertionError(f"{exc}\n{detail}") from None


# a job being requeued shows an ended state (FAILED) for a moment before it is PENDING again
REQUEUE_SETTLED_SECONDS = 10.0


def wait_requeued_job_end(cluster, job_id, timeout, output, on_poll=None):
    """Block until a job that requeues itself has ended for good; returns (state, exit code).

    An ended state counts once it has lasted REQUEUE_SETTLED_SECONDS. ``on_poll()`` runs at
    every poll (twice a second). On timeout the job is cancelled and the assertion says why."""
    deadline = time.monotonic() + timeout
    ended_since = None
    while time.monotonic() < deadline:
        state = job_state(cluster, job_id)
        if state is not None and state[0] not in NOT_ENDED + ("REQUEUED",):
            ended_since = ended_since or time.monotonic()
            if time.monotonic() - ended_since > REQUEUE_SETTLED_SECONDS:
                return state
        else:
            ended_since = None
        if on_poll is not None:
            on_poll()
        time.sleep(0.5)
    detail = _job_detail(cluster, job_id, output)
    cluster.run(["scancel", str(job_id)], timeout=30, check=False)
    raise AssertionError(f"job {job_id} did not end within {timeout} s\n{detail}")


def requeue_hold_seconds(cluster):
    """How long Slurm holds a requeued job before it may start again: AuthInfo's cred_expire
    (120 s by default) + 1 (slurmctld's job_mgr.c, Slurm 22.05)."""
    proc = cluster.run(["scontrol", "show", "config"], timeout=30)
    auth = next((line.split("=", 1)[1] for line in proc.stdout.splitlines()
                 if line.split("=", 1)[0].strip() == "AuthInfo"), "")
    expire = re.search(r"cred_expire=(\d+)", auth)
    return (int(expire.group(1)) if expire else 120) + 1


def _job_detail(cluster, job_id, output):
    steps = cluster.run(["squeue", "-h", "-s", "-o", "%i %j %M"], timeout=30, check=False).stdout
    lines = [f"job state: {job_state(cluster, job_id)}", "steps Slurm lists:", steps.rstrip() or "  (none)"]
    if output is not None:
        path = Path(str(output).replace("%j", str(job_id)))
        text = path.read_text(errors="replace") if path.exists() else "(no output file)"
        lines += [f"last lines of {path}:", *text.splitlines()[-60:]]
    return "\n".join(lines)
