"""The small steps a job script needs around the trainers: run dir, server wait, report.

The run directory and the server files belong to :mod:`eddis.smb.rundir` (team
contract); these helpers only call it and turn its errors into clear exits.
"""
import os
import sys
import time
from pathlib import Path

from .. import settings
from ..errors import SMBTimeoutError
from .report import format_report, root_cause


def run_dir():
    """EDDIS_RUN_DIR, else the contract's default (~/.eddis/run/<SLURM_JOB_ID> or local-<pid>)."""
    explicit = settings.get("EDDIS_RUN_DIR")
    if explicit:
        return Path(explicit).resolve()
    from ..smb.rundir import default_run_dir

    return Path(default_run_dir())


def create_run_dir(path):
    from ..smb.rundir import create_run_dir as create

    return Path(create(Path(path).expanduser().resolve()))


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
    """Exit 0 once ``count`` servers published; 1 with a clear message on timeout or a dead server step."""
    from ..smb.rundir import wait_for_servers

    timeout = settings.get("SMB_CONNECT_TIMEOUT") if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while True:
        dead = [pid for pid in watch_pids if not process_alive(pid)]
        if dead:
            print(f"eddis-train: error: the smb-server step (pid {', '.join(map(str, dead))}) ended before "
                  f"all {count} servers published in {path}/servers; see its output above.",
                  file=sys.stderr, flush=True)
            return 1
        left = deadline - time.monotonic()
        try:
            servers = wait_for_servers(path, count, timeout=max(0.0, min(1.0, left)))
        except SMBTimeoutError as exc:
            if left <= 1.0:
                print(f"eddis-train: error: {exc}. The servers did not publish within {timeout:.0f} s "
                      "(SERVER_WAIT in eddis_job.sh); see the smb-server lines above.", file=sys.stderr, flush=True)
                return 1
            continue
        print("eddis-train: smb-servers ready: " + ", ".join(
            f"{s['index']}@{s.get('hostname', s.get('host'))}:{s.get('port')}" for s in servers), flush=True)
        return 0


def print_report(path, job_code=None):
    first, failures, exits = root_cause(path)
    print(format_report(first, failures, exits, run_dir=path, job_code=job_code), file=sys.stderr, flush=True)
    return 0 if first is not None else 1
