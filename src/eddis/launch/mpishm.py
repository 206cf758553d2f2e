"""Open MPI's shared-memory (vader) segments of an eddis-train launch, kept in one folder per node.

Open MPI names the segments ``vader_segment.<host>.<jobid>.<local rank>`` and
unlinks them only at a clean ``MPI_Finalize``: a killed rank leaves its segment
behind in /dev/shm. Every launch therefore gets its own folder,
``<backing dir>/eddis-<launch key>-<host>``, so that what a launch leaves can be
found and removed without touching anybody else's segments.

Two parties remove it. Each supervisor removes its own rank's segment as soon as
the trainer has exited, and the folder when it is the last one out. A supervisor
that is itself killed (srun's SIGKILL, the job's time limit) cannot, and
"last one out" is a race between the supervisors of a node; so the job's
smb-server's supervisor (:mod:`.serverstep`), the last EDDIS process of the job on
each node, removes every folder of its job on that node when its server has stopped (:func:`remove_job_folders`).
"""

import os
import shutil

from .. import identity

VARIABLE = "OMPI_MCA_btl_vader_backing_directory"


def backing_directory(env):
    return env.get(VARIABLE) or "/dev/shm"


class MpiShm:
    """The folder of one launch on this node."""

    def __init__(self, env, key, hostname):
        self.path = os.path.join(backing_directory(env), f"eddis-{key}-{hostname}")

    def prepare(self, child_env):
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        child_env[VARIABLE] = self.path

    def cleanup(self, local_rank):
        try:
            names = os.listdir(self.path)
        except OSError:
            return
        for name in names:
            if name.endswith(f".{local_rank}"):
                try:
                    os.unlink(os.path.join(self.path, name))
                except OSError:
                    pass
        try:
            os.rmdir(self.path)
        except OSError:
            pass  # other local ranks still use it; the smb-server removes it at the end


def job_folders(env, hostname=None):
    """This Slurm job's launch folders on this node (any step); [] outside a job."""
    job_ids = {env.get(name) for name in ("SLURM_HET_JOB_ID", "SLURM_JOB_ID") if env.get(name)}
    if not job_ids:
        return []
    hostname = hostname or identity.node_name(env)
    base = backing_directory(env)
    try:
        names = os.listdir(base)
    except OSError:
        return []
    found = []
    for name in names:
        for job_id in job_ids:
            if name.startswith(f"eddis-{job_id}.") and name.endswith(f"-{hostname}"):
                found.append(os.path.join(base, name))
    return sorted(found)


def remove_job_folders(env, hostname=None):
    """Remove this job's launch folders on this node with what is in them; returns the paths removed.

    Called once the job's trainers have ended (the smb-server stops after them),
    so every segment in them belongs to a process that is gone.
    """
    removed = []
    for path in job_folders(env, hostname):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed
