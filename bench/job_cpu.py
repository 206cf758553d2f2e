"""The CPU seconds one benchmark job's processes used, by role: where a step's CPU goes.

The emulated cluster's nodes share this machine's CPUs, so the processes of a job are all
visible in ``/proc``. ``sample(run_dir)`` finds those whose environment holds the job's run
directory (``EDDIS_RUN_DIR``, which every step of the job inherits) and adds up their user
and system CPU seconds by role: ``ranks`` (the trainers), ``servers`` (``smb-server``) and
``launch`` (srun, the supervisors, the launcher). ``difference(before, after)`` is what each
role used between two samples. The kernel's own work (softirqs of the veth links and their
qdiscs) belongs to no process and is not counted.
"""
import os

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ROLES = ("ranks", "servers", "launch")


def role_of(comm, cmdline):
    """A process's role from its name (``/proc/PID/comm``) and its arguments."""
    # the launcher's supervisor runs the server as ``python -c "... eddis.smb.server ..."``
    if comm.startswith("smb-server") or any(a.endswith("smb-server") for a in cmdline[:2]) or any(
            "eddis.smb.server" in a for a in cmdline[:3]):
        return "servers"
    if "--worker" in cmdline:
        return "ranks"
    return "launch"


def cpu_seconds(stat):
    """utime + stime in seconds from the text of ``/proc/PID/stat``."""
    # the name in parentheses may hold spaces: the fields after it are fixed
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def sample(run_dir, proc="/proc"):
    """{role: CPU seconds} of the live processes whose environment names ``run_dir``."""
    marker = f"EDDIS_RUN_DIR={run_dir}".encode()
    totals = dict.fromkeys(ROLES, 0.0)
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        base = os.path.join(proc, pid)
        try:
            with open(os.path.join(base, "environ"), "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            with open(os.path.join(base, "stat")) as f:
                seconds = cpu_seconds(f.read())
            with open(os.path.join(base, "comm")) as f:
                comm = f.read().strip()
            with open(os.path.join(base, "cmdline"), "rb") as f:
                cmdline = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        totals[role_of(comm, cmdline)] += seconds
    return totals


def difference(before, after):
    """CPU seconds of each role between two samples (a process that ended between them is
    missed: the benchmark samples while every process of the job is alive)."""
    return {role: max(0.0, after[role] - before[role]) for role in ROLES}
