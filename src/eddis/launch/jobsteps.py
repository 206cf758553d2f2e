"""The small steps of a job around the trainers: run dir, server wait, trainer guard, report.

The run directory and the server files belong to :mod:`eddis.smb.rundir` (team
contract); these helpers only call it and turn its errors into clear exits.
"""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .. import settings
from ..errors import SMBServerError, SMBTimeoutError, SMBValueError
from .report import (LAUNCH_DIR, describe_exit, finished_ranks, format_report, launches, read_records,
                     root_cause)
from .startbeats import StartWatch, announce
from .status import exit_status, run_status

# what eddis-train and the job say when the trainers refused a checkpoint request (rank 0's
# answer in the run dir) because it came after training had ended on some rank
COMPLETE_BEFORE_CHECKPOINT = ("a checkpoint was asked for after training had ended on a rank: "
                              "training is complete, nothing to checkpoint")


def run_dir():
    """EDDIS_RUN_DIR, else the contract's default (~/.eddis/run/<SLURM_JOB_ID> or local-<pid>)."""
    explicit = settings.get("EDDIS_RUN_DIR")
    if explicit:
        return Path(explicit).resolve()
    from ..smb.rundir import default_run_dir

    return Path(default_run_dir())


def create_run_dir(path):
    """The job's run directory, made ready for a new run: job ids start again when a
    cluster is rebuilt, and a requeued job keeps its id, so what an earlier run left
    there (its ranks' exit records, its servers' addresses, its checkpoint request)
    must not be read as this run's."""
    from ..smb.rundir import CHECKPOINT_ANSWER_FILE, CHECKPOINT_REQUEST_FILE, SERVERS_DIR, create_run_dir as create

    path = Path(create(Path(path).expanduser().resolve()))
    shutil.rmtree(path / LAUNCH_DIR, ignore_errors=True)
    for request in (CHECKPOINT_REQUEST_FILE, CHECKPOINT_ANSWER_FILE):  # the last run's
        (path / request).unlink(missing_ok=True)
    for stale in (path / SERVERS_DIR).glob("*.json"):
        stale.unlink(missing_ok=True)
    return path


def process_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (ended, not yet reaped by the job shell) counts as ended.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def wait_servers(path, count, timeout=None, watch_pids=()):
    """Exit 0 once ``count`` servers published and the job's SMB transport is recorded (the
    run directory's smb-transport.json); 1 with a clear message on timeout, a dead server
    step or a transport the servers do not offer."""
    from ..smb.rundir import record_transport, wait_for_servers

    timeout = settings.get("EDDIS_SERVER_WAIT") if timeout is None else timeout

    def no_server_step_ended():  # wait_for_servers stops waiting on what its check raises
        dead = [pid for pid in watch_pids if not process_alive(pid)]
        if dead:
            raise SMBServerError(f"the smb-server step (pid {', '.join(map(str, dead))}) ended before all "
                                 f"{count} servers published in {path}/servers; see its output above.")

    try:
        no_server_step_ended()
        servers = wait_for_servers(path, count, timeout=timeout, check=no_server_step_ended)
    except SMBServerError as exc:
        print(f"eddis-train: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except SMBTimeoutError as exc:
        print(f"eddis-train: error: {exc}. The servers did not publish within {timeout:.0f} s "
              "(EDDIS_SERVER_WAIT); see the smb-server lines above.", file=sys.stderr, flush=True)
        return 1
    print("eddis-train: smb-servers ready: " + ", ".join(
        f"{s['index']}@{s.get('hostname', s.get('host'))}:{s.get('port')}" for s in servers), flush=True)
    try:
        chosen = record_transport(path, servers)
    except SMBValueError as exc:
        print(f"eddis-train: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"eddis-train: smb transport {chosen['transport']}: {chosen['reason']}", flush=True)
    return 0


def report_failure(path, job_code=None):
    """Print the report on stderr; return the job's status, as docs/user-guide.md promises: the
    root cause's exit status (srun's own can be a peer's SIGKILL), else ``job_code``; and
    whether a root cause was found."""
    first, failures, exits = root_cause(path)
    print(format_report(first, failures, exits, run_dir=path, job_code=job_code), file=sys.stderr, flush=True)
    return run_status(first, 1 if job_code is None else job_code), first is not None


def print_report(path, job_code=None):
    """The report on stderr; on stdout the job's status (see :func:`report_failure`)."""
    status, found = report_failure(path, job_code)
    print(status, flush=True)
    return 0 if found else 1


def remove_elastic_commits(path):
    """Once the training finished: the commits a sync elastic script left in the run directory."""
    from ..smb.rundir import ELASTIC_COMMITS_DIR, remove_elastic_commits as remove

    removed = remove(path)
    if removed:
        print(f"eddis-train: the training finished: removed its {removed} elastic commit(s) from "
              f"{Path(path) / ELASTIC_COMMITS_DIR}", file=sys.stderr, flush=True)


def ranks_without_exit(path):
    """The ranks of the newest launch that recorded no exit; none when it recorded no start.
    srun (Slurm 22.05) returns 0 when a node of a ``--no-kill`` job fails under its step: the
    tasks there are killed with their supervisors, which then record nothing."""
    newest, size = _newest_launch(path)
    if newest is None:
        return []
    exited = newest.exited_ranks()
    return [rank for rank in range(size) if rank not in exited]


def every_rank_finished(path):
    """Whether every rank of the newest launch finished the training (exited on its own with
    status 0) and none recorded a failure: then a signal that ended srun afterwards is srun's
    own failure at the step's end (Slurm 22.05's srun can abort there, "double free or
    corruption"), not the training's."""
    newest, size = _newest_launch(path)
    if newest is None or size == 0 or newest.failure_names():
        return False
    return finished_ranks(read_records(newest.exits)) == list(range(size))


def _newest_launch(path):
    """The newest launch's records and its world size (from its start records); (None, 0)."""
    newest = launches(path)[-1:]
    if not newest:
        return None, 0
    return newest[0], max((r.get("size") or 0 for r in read_records(newest[0].ranks)), default=0)


def every_rank_interrupted(path):
    """Whether every rank of the newest launch recorded that SIGINT stopped it. The first rank
    to exit 130 is a bad exit to ``srun --kill-on-bad-exit``, which may end the last ones with
    SIGTERM after they recorded it: srun's status is then 143, yet the job was interrupted."""
    newest, size = _newest_launch(path)
    if newest is None:
        return False
    exits = read_records(newest.exits)
    return size > 0 and len({e.get("rank") for e in exits}) >= size and all(
        e.get("why") == "stopped" and e.get("stop_signal") == signal.SIGINT for e in exits)


TRAINERS_STATUS_FILE = "trainers.status"


def trainers_status(run_dir, status):
    """The status the trainer guard wrote when it had to end srun, else ``status``."""
    try:
        return int((Path(run_dir) / LAUNCH_DIR / TRAINERS_STATUS_FILE).read_text().strip())
    except (FileNotFoundError, ValueError):
        return status


def descendants(pid):
    """pid and every process below it, from /proc."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, ()))
    return found


def _status_of(exits):
    """What srun would have returned for these exit records: the first bad exit's status
    (a rank the launcher stopped exits 0), else 0."""
    for record in sorted(exits, key=lambda r: r.get("time", 0.0)):
        if record.get("signal") or (record.get("code") and record.get("why") != "stopped"):
            return exit_status(record.get("code"), record.get("signal"))
    return 0


TRAINER_STEP_NAME = "eddis-train"  # srun --job-name of the trainers (eddis.launch.jobrun)
# Once Slurm lists the trainer step no more, srun waits for nothing that can still come: it gets
# this long to return (its own output drains in well under a second) before the guard ends it.
STEP_GONE_GRACE = 3.0


def job_ids(env):
    """The job's ids as squeue takes them: every component's for a hetjob, else SLURM_JOB_ID."""
    components = int(env.get("SLURM_HET_SIZE") or 1)
    if components > 1:
        return [env[f"SLURM_JOB_ID_HET_GROUP_{g}"] for g in range(components)
                if env.get(f"SLURM_JOB_ID_HET_GROUP_{g}")]
    return [env["SLURM_JOB_ID"]] if env.get("SLURM_JOB_ID") else []


def steps_named(listing, name):
    """The step ids of squeue's ``%i %j`` lines whose step name is ``name``."""
    return [fields[0] for fields in map(str.split, listing.splitlines()) if fields[1:2] == [name]]


def step_ids(name, env=None, timeout=10.0):
    """The ids of this job's steps named ``name`` that Slurm lists; None when it cannot be asked."""
    env = os.environ if env is None else env
    ids = job_ids(env)
    if not ids:
        return None
    try:
        proc = subprocess.run(["squeue", "-h", "-s", "-j", ",".join(ids), "-o", "%i %j"], capture_output=True,
                              text=True, timeout=timeout, env=dict(env))
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return steps_named(proc.stdout, name)


def slurm_lists_step(name, env=None, timeout=10.0):
    """Whether Slurm lists a step of this job named ``name``; None when it cannot be asked."""
    steps = step_ids(name, env, timeout)
    return None if steps is None else bool(steps)


def guard_trainer_step(path, srun_pid, grace=None, poll=1.0, env=None, elastic=False, watch_start=False):
    """Bound the job's wait for the trainers' srun (or an elastic run's mpirun).

    srun can miss the end of a step whose tasks have all exited (seen with
    hetjob steps on a loaded host: every rank gone, srun waiting on). Once every
    rank of the newest launch has recorded its exit, srun gets ``grace``
    seconds to return, or STEP_GONE_GRACE once Slurm lists the trainer step no
    more; after that this kills srun, writes the status the exit records stand
    for to ``<run dir>/launch/trainers.status`` and says so. Returns when srun
    has ended either way.

    ``elastic`` (the mpirun of an elastic run): mpirun never learns that the ranks of a lost
    node ended, and those leave no exit record. Once a rank has recorded that it finished the
    training, the others get ``grace`` + EDDIS_ELASTIC_LOST_AFTER seconds (a live rank stops
    at its next step, having found the global counter at the total); then mpirun is ended the
    same way, and the ranks without an exit record are reported lost.

    ``watch_start`` (an elastic run): until every rank's training started, ranks whose
    supervisors stopped beating are recorded as failed (:mod:`.startbeats`), which stops the
    others, and count as ended here: nothing records their exit.
    """
    grace = settings.get("EDDIS_STEP_END_GRACE") if grace is None else grace
    all_exited_at = step_gone_at = finished_at = watch = None
    while process_alive(srun_pid):
        newest = launches(path)[-1:] or [None]
        records = newest[0]
        if records is not None:
            starts = read_records(records.ranks)
            size = max((r.get("size") or 0 for r in starts), default=0)
            exits = read_records(records.exits)
            if watch_start:
                if watch is None or watch.records.root != records.root:
                    watch = StartWatch(records, env=env)
                for line in announce(watch.look(starts, exits, size)):
                    print(line, file=sys.stderr, flush=True)
            vanished = (watch.vanished if watch is not None else set()) - {e.get("rank") for e in exits}
            now = time.monotonic()
            if size and len(exits) + len(vanished) >= size:
                all_exited_at = all_exited_at or now
                if step_gone_at is None and not elastic and slurm_lists_step(TRAINER_STEP_NAME, env) is False:
                    step_gone_at = now
                step_gone = step_gone_at is not None and now - step_gone_at >= min(grace, STEP_GONE_GRACE)
                if step_gone or now - all_exited_at >= grace:
                    _end_stuck_launcher(path, srun_pid, exits, size,
                                        f"Slurm had ended the step {now - step_gone_at:.0f} s earlier" if step_gone
                                        else f"still waiting {grace:.0f} s later (EDDIS_STEP_END_GRACE)",
                                        ended=len(exits) if vanished else None)
                    return 0
            elif elastic and size and finished_ranks(exits):
                finished_at = finished_at or now
                wait = grace + settings.get("EDDIS_ELASTIC_LOST_AFTER")
                if now - finished_at >= wait:
                    silent = sorted(set(range(size)) - {e.get("rank") for e in exits})
                    _end_stuck_launcher(path, srun_pid, exits, size,
                                        f"rank(s) {', '.join(map(str, silent))} recorded no exit {wait:.0f} s after "
                                        "the first rank finished the training (EDDIS_STEP_END_GRACE + "
                                        "EDDIS_ELASTIC_LOST_AFTER): lost with their node", ended=len(exits))
                    return 0
        time.sleep(poll)
    return 0


def _end_stuck_launcher(path, pid, exits, size, why, ended=None):
    # the job's status, by the rule the job applies once srun has ended: a rank that vanished
    # has a failure record and no exit record, and a peer stopped by a signal is no root cause
    status = run_status(root_cause(path)[0], _status_of(exits))
    (Path(path) / LAUNCH_DIR / TRAINERS_STATUS_FILE).write_text(f"{status}\n")
    outcomes = ", ".join(sorted({describe_exit(e.get("code"), e.get("signal")) for e in exits}))
    launcher = process_name(pid) or "the launcher"
    count = f"all {size}" if ended is None else f"{ended} of {size}"
    print(f"eddis-train: {count} ranks exited ({outcomes}) but {launcher} (pid {pid}) had not returned: "
          f"{why}; ending it. Job status {status}, from the ranks' records.", file=sys.stderr, flush=True)
    kill_tree(pid)


def process_name(pid):
    """The command name of process ``pid`` (/proc), or None."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() or None
    except OSError:
        return None


def kill_tree(pid):
    """SIGKILL to ``pid`` and every process below it, the deepest first."""
    for found in reversed(descendants(pid)):
        try:
            os.kill(found, signal.SIGKILL)
        except OSError:
            pass
