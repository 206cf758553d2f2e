"""Where this process runs, as the launcher described it: one accessor per fact.

Every layer asks here, so that the server, the client, the runtime, the
timeline and the profile agree on a process's node and group even before
``eddis.init()``. After it, :mod:`eddis.core.comm.runtime` holds the answers MPI
confirmed (``eddis.group()`` falls back to the node index there, as hybrid
needs); before it, or in a process without the runtime (an smb-server), these
are the launcher's word, or None where it said nothing.

The variables are the launcher's (``eddis-train`` exports them to each rank,
see :mod:`eddis.launch.rankenv`); they are typed entries of the settings
registry, marked internal, so a malformed value fails with the registry's
message.
"""
import socket

from . import settings


def node_name(environ=None):
    """The node this process is on: the name that decides same-node memory mapping.

    EDDIS_HOSTNAME (the launcher sets it for ranks; the dev cluster's fake
    nodes set it for servers), else SLURMD_NODENAME (srun sets it for every
    step on a node, and it differs between the nodes of a dev cluster that
    share one kernel), else the host name.
    """
    env = settings.environ(environ)
    return (settings.get("EDDIS_HOSTNAME", env) or env.get("SLURMD_NODENAME")
            or socket.gethostname())


def launcher_rank(environ=None):
    """EDDIS_RANK from the launcher, or None outside eddis-train."""
    return settings.get("EDDIS_RANK", environ)


def launcher_size(environ=None):
    return settings.get("EDDIS_SIZE", environ)


def launcher_group(environ=None):
    """The rank's group (hetjob component, else node) as the launcher numbered it, or None."""
    return settings.get("EDDIS_GROUP", environ)


def launcher_num_groups(environ=None):
    return settings.get("EDDIS_NUM_GROUPS", environ)


def gpu_type(environ=None):
    """The ranks' GPU generation (EDDIS_GPU_TYPE), or None when nobody said."""
    return settings.get("EDDIS_GPU_TYPE", environ)
