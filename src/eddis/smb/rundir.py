"""The job's run directory: token, server address files, readiness.

Layout::

    <run dir>/token               random job token, mode 0600
    <run dir>/servers/<i>.json    published by smb-server i once it serves
    <run dir>/checkpoint-request  written by the job when Slurm asked for a checkpoint
    <run dir>/checkpoint-written  the trainers' answer: the checkpoint they wrote, then stopped
    <run dir>/elastic-commits/    a sync Horovod elastic script's commits (no EDDIS_CHECKPOINT_DIR)

``python -m eddis.smb.rundir create DIR`` creates one (the launcher does this).
"""
import json
import os
import secrets
import shutil
import sys
import time
from pathlib import Path

from .. import settings
from ..errors import ConfigError, SMBPermissionError, SMBTimeoutError

TOKEN_FILE = "token"
SERVERS_DIR = "servers"
CHECKPOINT_REQUEST_FILE = "checkpoint-request"
CHECKPOINT_ANSWER_FILE = "checkpoint-written"
ELASTIC_COMMITS_DIR = "elastic-commits"
# the job's SMB transport and why (eddis.timeline.profile reads it by this name into profile.h5)
TRANSPORT_FILE = "smb-transport.json"


def note_training_started():
    """Elastic runs: say to this rank's eddis-train supervisor (EDDIS_STARTED_FILE) that the
    set-up every rank takes part in is over, so that from now on its loss leaves the others
    training; nothing outside eddis-train."""
    _note_to_supervisor("EDDIS_STARTED_FILE")


def note_initialized():
    """Say to this rank's eddis-train supervisor (EDDIS_INIT_FILE) that eddis.init() returned:
    a crash after it is no start-up crash (EDDIS_START_RETRIES); nothing outside eddis-train."""
    _note_to_supervisor("EDDIS_INIT_FILE")


def _note_to_supervisor(setting):
    path = settings.get(setting)
    if path:
        write_json_atomic(path, {"pid": os.getpid(), "time": time.time()})


def write_json_atomic(target, record, indent=None):
    """``record`` as JSON into ``target`` (its folders made if missing): a file of this process
    first, then renamed, so that a reader (another node's, through a shared file system) sees
    all of it or nothing. The run directory's records and the launch records both use it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=indent) + "\n")
    os.replace(tmp, target)
    return target


def remove_elastic_commits(path):
    """After a run that finished its training: the commits a sync Horovod elastic script left
    in the run directory (eddis.core.checkpoint.elastic_state) have no reader any more, and a large
    model's would fill the home directory run by run. How many checkpoints went (0: none)."""
    folder = Path(path) / ELASTIC_COMMITS_DIR
    if not folder.is_dir():
        return 0
    count = sum(1 for entry in folder.iterdir() if entry.name.startswith("ckpt-"))
    shutil.rmtree(folder, ignore_errors=True)
    return count


def default_run_dir(job_id=None):
    """$EDDIS_RUN_DIR, else ~/.eddis/run/<SLURM_JOB_ID>, else ~/.eddis/run/local-<pid>."""
    explicit = settings.get("EDDIS_RUN_DIR")
    if explicit:
        return Path(explicit)
    job_id = job_id or os.environ.get("SLURM_JOB_ID")
    name = str(job_id) if job_id else f"local-{os.getpid()}"
    return Path.home() / ".eddis" / "run" / name


def create_run_dir(path):
    """Create the run directory (mode 0700) and its token (mode 0600) if absent."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    (path / SERVERS_DIR).mkdir(mode=0o700, exist_ok=True)
    token = path / TOKEN_FILE
    if not token.exists():
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_hex(32).encode())
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    return path


def request_checkpoint(path, reason):
    """Leave a checkpoint request for trainers that start, or install their handler, after
    the signal that carries it was sent (``eddis.init()`` looks for it once its handler is in
    place, so no request falls between the two)."""
    request = Path(path) / CHECKPOINT_REQUEST_FILE
    request.write_text(f"{reason}\n")
    return request


def checkpoint_request(path):
    """The reason of the job's pending checkpoint request, or None."""
    try:
        return (Path(path) / CHECKPOINT_REQUEST_FILE).read_text().strip() or "requested"
    except (FileNotFoundError, NotADirectoryError):
        return None


def _write_answer(path, answer):
    return write_json_atomic(Path(path) / CHECKPOINT_ANSWER_FILE, answer)


def answer_checkpoint_request(path, checkpoint, step, terminated=False):
    """Rank 0, once the requested checkpoint is complete: the trainers stop (status 0) not
    because training is over but to be requeued, and the job reads this to tell the two apart.
    ``terminated``: SIGTERM asked for it (a preemption, or the steps were sent SIGTERM)."""
    return _write_answer(path, {"checkpoint": str(checkpoint), "step": int(step),
                                "terminated": bool(terminated)})


def answer_training_complete(path, step):
    """A rank whose checkpoint request came after training had ended on another rank: no
    checkpoint is written, the trainers exit 0 because training is over, and the job ends."""
    return _write_answer(path, {"complete": True, "step": int(step)})


def _read_answer(path):
    try:
        return json.loads((Path(path) / CHECKPOINT_ANSWER_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None


def checkpoint_answer(path):
    """``{"checkpoint": path, "step": n, "terminated": bool}`` when the trainers stopped after a
    requested checkpoint, else None; a request that came after training was over is answered
    as complete (:func:`answer_training_complete`) and reads as None here."""
    answer = _read_answer(path)
    return None if answer is None or answer.get("complete") else answer


def training_was_complete(path):
    """Whether a checkpoint request was answered as "training already complete"."""
    answer = _read_answer(path)
    return bool(answer is not None and answer.get("complete"))


def retire_run_dir(path):
    """At the end of a job: delete its secret (the token) and the address files, which
    name ports that are gone; keep what the job wrote for its user (profile, timeline,
    records) and remove the directory only if nothing else is left in it."""
    path = Path(path)
    (path / TOKEN_FILE).unlink(missing_ok=True)
    for request in (CHECKPOINT_REQUEST_FILE, CHECKPOINT_ANSWER_FILE):  # answered, or moot: the job is over
        (path / request).unlink(missing_ok=True)
    for record in (path / SERVERS_DIR).glob("*.json"):
        record.unlink(missing_ok=True)
    for empty in (path / SERVERS_DIR, path):
        try:
            empty.rmdir()
        except OSError:
            break       # not empty (or already gone): the user's outputs stay


def read_token(path):
    """The job token of a run directory (or of a token file given directly)."""
    path = Path(path)
    token_file = path / TOKEN_FILE if path.is_dir() else path
    try:
        text = token_file.read_text().strip()
    except FileNotFoundError:
        raise ConfigError(
            f"no job token at {token_file}; create the run directory first "
            f"(python -m eddis.smb.rundir create {path})"
        ) from None
    except PermissionError:
        raise SMBPermissionError(f"cannot read the job token {token_file}: permission denied") from None
    if not text:
        raise ConfigError(f"the job token file {token_file} is empty; delete it and recreate the run directory")
    return text


def server_file(path, index):
    return Path(path) / SERVERS_DIR / f"{int(index)}.json"


def publish_server(path, index, info):
    """Atomically write servers/<index>.json (write a temporary file, then rename)."""
    target = server_file(path, index)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return write_json_atomic(target, info)


def record_transport(path, records, requested=None):
    """Decide the job's SMB transport from what its servers' ``records`` offer (as every
    client of the job does, :func:`eddis.smb.transport.job_transport`) and record it in
    the run directory: {"transport", "reason", "servers": [[index, offer, why]]}.
    ``requested``: SMB_TRANSPORT (default: this process's). SMBValueError where it forces
    rdma and a server offers socket only."""
    from .. import settings
    from .transport import job_transport

    offers = [[int(r["index"]), r.get("transport", "socket"), r.get("transport_reason", "")] for r in records]
    transport, reason = job_transport(settings.get("SMB_TRANSPORT") if requested is None else requested, offers)
    record = {"transport": transport, "reason": reason, "servers": offers}
    write_json_atomic(Path(path) / TRANSPORT_FILE, record)
    return record


def read_transport(path):
    """The job's recorded SMB transport (:func:`record_transport`), or None."""
    try:
        return json.loads((Path(path) / TRANSPORT_FILE).read_text())
    except (OSError, ValueError):
        return None


def unpublish_server(path, index):
    try:
        server_file(path, index).unlink()
    except FileNotFoundError:
        pass


def read_servers(path):
    """All published server records, sorted by index."""
    folder = Path(path) / SERVERS_DIR
    records = []
    if folder.is_dir():
        for entry in folder.glob("*.json"):
            try:
                records.append(json.loads(entry.read_text()))
            except (OSError, ValueError):
                continue  # being replaced right now; the next poll sees it
    return sorted(records, key=lambda r: r["index"])


def wait_for_servers(path, count, timeout=None, check=None):
    """Wait until servers 0..count-1 have published; returns their records by index.

    ``check()``, when given, runs between polls and raises to stop waiting early (a
    server process that already exited will never publish)."""
    if timeout is None:
        timeout = settings.get("SMB_CONNECT_TIMEOUT")
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        records = {r["index"]: r for r in read_servers(path)}
        missing = [i for i in range(count) if i not in records]
        if not missing:
            return [records[i] for i in range(count)]
        if check is not None:
            check()
        if time.monotonic() >= deadline:
            raise SMBTimeoutError(
                f"SMB servers {missing} did not publish in {path}/{SERVERS_DIR} within {timeout:g} s; "
                "check that smb-server runs on every node (its log) or raise SMB_CONNECT_TIMEOUT"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(prog="python -m eddis.smb.rundir", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    create = sub.add_parser("create", help="create a run directory and its token")
    create.add_argument("dir", nargs="?", help="default: EDDIS_RUN_DIR or ~/.eddis/run/<job>")
    wait = sub.add_parser("wait", help="wait until N servers have published")
    wait.add_argument("dir")
    wait.add_argument("count", type=int)
    wait.add_argument("--timeout", type=float, default=None)
    args = parser.parse_args(argv)
    if args.command == "create":
        print(create_run_dir(args.dir or default_run_dir()))
    else:
        for record in wait_for_servers(args.dir, args.count, args.timeout):
            print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
