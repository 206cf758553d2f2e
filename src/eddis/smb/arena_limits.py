"""Whether an smb-server's arena fits this node, and reserving it before the server serves.

An arena of normal pages is POSIX shared memory: a tmpfs file in ``/dev/shm`` whose
pages the kernel allocates only when they are first written. A server lending more
than the node can give therefore starts fine and is killed by SIGBUS on the first
large write, long after the job began. So the server checks the limits that bite
(the node's available memory, the job's Slurm allocation, the free space of
``/dev/shm``) before it creates the arena, and then allocates every page of it at
once (:func:`reserve`), which turns a shortage the checks could not see (another
process filling ``/dev/shm`` meanwhile) into an error at start too.

Hugetlb arenas need neither: the kernel reserves their pages when the server maps
them, and :mod:`eddis.smb.hugepages` checks the free pages beforehand.
"""
import ctypes
import errno
import os
import re

from ..errors import SMBMemoryError

SHM_DIR = "/dev/shm"          # where glibc's shm_open creates POSIX shared memory
MEMINFO = "/proc/meminfo"
MADV_POPULATE_WRITE = 23      # Linux 5.14+


def format_size(nbytes):
    """Bytes as GiB above 1 GiB, else MiB, one decimal: what a user compares with SMB_MEMORY."""
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.1f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"


def _meminfo(path):
    try:
        with open(path) as f:
            return {key: int(kb) * 1024 for key, kb in re.findall(r"^(\w+):\s+(\d+) kB", f.read(), re.M)}
    except OSError:
        return {}


def _slurm_megabytes(environ, name):
    value = environ.get(name, "").strip()
    return int(value) if value.isdigit() else 0


def memory_limits(environ=None, meminfo=MEMINFO, shm_dir=SHM_DIR):
    """[(bytes, what the limit is, how else to lift it or None)] for an arena of normal pages."""
    environ = os.environ if environ is None else environ
    limits = []
    info = _meminfo(meminfo)
    if "MemAvailable" in info:
        # beyond what the node can give without swapping, filling the arena calls the OOM killer
        limits.append((info["MemAvailable"],
                       f"this node's available memory ({format_size(info['MemAvailable'])} of "
                       f"{format_size(info.get('MemTotal', 0))}, MemAvailable in {meminfo})",
                       "stop what else uses the node's memory"))
    per_node = _slurm_megabytes(environ, "SLURM_MEM_PER_NODE")
    per_cpu = _slurm_megabytes(environ, "SLURM_MEM_PER_CPU")
    cpus = _slurm_megabytes(environ, "SLURM_CPUS_ON_NODE")
    # 0 is Slurm's "all of the node's memory", which the node's own limit covers
    if per_node:
        limits.append((per_node << 20, f"the job's Slurm allocation on this node ({format_size(per_node << 20)}, "
                                       f"SLURM_MEM_PER_NODE={per_node} MB)",
                       "ask Slurm for more memory (sbatch --mem)"))
    elif per_cpu and cpus:
        limits.append((per_cpu * cpus << 20,
                       f"the job's Slurm allocation on this node ({format_size(per_cpu * cpus << 20)}, "
                       f"SLURM_MEM_PER_CPU={per_cpu} MB x SLURM_CPUS_ON_NODE={cpus})",
                       "ask Slurm for more memory (sbatch --mem-per-cpu or --mem)"))
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        st = None
    if st is not None and st.f_blocks:
        free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        limits.append((free, f"the free space of {shm_dir} ({format_size(free)} free of {format_size(size)})",
                       f"make {shm_dir} larger (as root: mount -o remount,size=N {shm_dir})"))
    return limits


def refusal(nbytes, limits):
    """Why an arena of `nbytes` cannot be lent (the tightest limit it exceeds), or None."""
    exceeded = [limit for limit in limits if nbytes > limit[0]]
    if not exceeded:
        return None
    limit, what, remedy = min(exceeded, key=lambda item: item[0])
    advice = f"Lend at most {format_size(limit)}: set SMB_MEMORY (or smb-server --memory) lower"
    return (f"SMB_MEMORY={format_size(nbytes)} ({nbytes} bytes) is more than {what}; the server would die "
            f"(SIGBUS, or the OOM killer) when that memory is first used. {advice}" + (f", or {remedy}" if remedy else ""))


def check_fits(nbytes, environ=None):
    """SMBMemoryError naming the limit when an arena of `nbytes` normal pages does not fit."""
    message = refusal(nbytes, memory_limits(environ))
    if message:
        raise SMBMemoryError(message, errno.ENOMEM)


def _shortage(nbytes, err):
    limits = memory_limits()
    shm = [limit for limit in limits if limit[1].startswith(f"the free space of {SHM_DIR}")]
    node = [limit for limit in limits if limit[1].startswith("this node's")]
    seen = "; ".join(what for _, what, _ in shm + node) or "no limit could be read"
    return SMBMemoryError(
        f"cannot reserve the {format_size(nbytes)} ({nbytes} bytes) of SMB_MEMORY: {os.strerror(err)} "
        f"({seen}); set SMB_MEMORY (or smb-server --memory) lower, or free memory on this node",
        err)


def fallocate(fd, nbytes):
    """Allocate the pages of the arena file `fd` (tmpfs), or SMBMemoryError on a shortage."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise _shortage(nbytes, exc.errno) from None
        raise SMBMemoryError(f"cannot reserve the arena's {nbytes} bytes: {exc}", exc.errno) from None


def reserve(fd, address, nbytes, transparent=False):
    """Allocate every page of the arena mapped at `address` (file `fd`) now.

    fallocate on the file, the quickest; with transparent huge pages through the
    mapping instead (MADV_POPULATE_WRITE, Linux 5.14+), so the pages come as a first
    write would get them, huge as madvise(MADV_HUGEPAGE) asked, which fallocate
    does not honour under the usual shmem_enabled=advise."""
    if not transparent:
        fallocate(fd, nbytes)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(address, nbytes, MADV_POPULATE_WRITE) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EINVAL:          # a kernel before 5.14
        fallocate(fd, nbytes)
        return
    # EFAULT: a write there would raise SIGBUS (the tmpfs is full); ENOMEM: no memory
    raise _shortage(nbytes, err)


__all__ = ["memory_limits", "refusal", "check_fits", "reserve", "fallocate", "format_size"]
