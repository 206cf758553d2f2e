"""An smb-server refuses memory the node cannot give, and reserves what it lends.

SMB_MEMORY larger than /dev/shm's free space (or the node's memory, or the job's
Slurm allocation) was accepted; the server then died of SIGBUS on the first large
write. The /dev/shm cases run the server in a mount namespace of its own with a
small tmpfs on /dev/shm (root, or unprivileged user namespaces).
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import python_env

from eddis.smb import Client, create_run_dir, rundir
from eddis.smb.testing import LocalServers

MiB = 1 << 20


def in_private_shm(size, argv):
    """argv run with a tmpfs of `size` bytes as its own /dev/shm (a private mount namespace)."""
    prefix = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-r", "-m"]
    script = f'mount -t tmpfs -o size={size} eddis-test-shm /dev/shm && exec "$@"'
    return [*prefix, "sh", "-c", script, "sh", *argv]


@pytest.fixture(scope="module")
def private_shm():
    probe = subprocess.run(in_private_shm(MiB, ["df", "-B1", "/dev/shm"]), capture_output=True, text=True,
                           timeout=30)
    if probe.returncode != 0 or str(MiB) not in probe.stdout:
        pytest.skip("cannot mount a tmpfs of its own on /dev/shm here (needs root or unprivileged user "
                    f"namespaces): {probe.stderr.strip()}")
    return in_private_shm


def server_argv(run_dir, memory):
    return [sys.executable, "-m", "eddis.smb.server", "--run-dir", str(run_dir), "--memory", memory,
            "--host", "127.0.0.1"]


def refused(argv, env=None):
    proc = subprocess.run(argv, env=python_env(env), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, f"the server did not refuse ({proc.returncode}):\n{proc.stderr[-2000:]}"
    message = proc.stderr.strip().splitlines()[-1]
    assert "SMB_MEMORY" in message and "smb-server --memory" in message, message
    return message


def meminfo(field):
    with open("/proc/meminfo") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


@pytest.mark.timeout(120)
def test_more_than_dev_shm_is_refused(tmp_path, private_shm):
    run_dir = create_run_dir(tmp_path / "run")
    message = refused(private_shm(32 * MiB, server_argv(run_dir, "64M")))
    assert message == (
        "smb-server: SMB_MEMORY=64.0 MiB (67108864 bytes) is more than the free space of /dev/shm "
        "(32.0 MiB free of 32.0 MiB); the server would die (SIGBUS, or the OOM killer) when that memory "
        "is first used. Lend at most 32.0 MiB: set SMB_MEMORY (or smb-server --memory) lower, or make "
        "/dev/shm larger (as root: mount -o remount,size=N /dev/shm) (code 12)")
    assert not rundir.read_servers(run_dir), "a refused server published its address"


@pytest.mark.timeout(120)
def test_more_than_the_node_memory_is_refused(tmp_path, private_shm):
    """/dev/shm as large as twice the node's memory, so the node's memory is what bites."""
    run_dir = create_run_dir(tmp_path / "run")
    asked = meminfo("MemAvailable") + (1 << 30)
    message = refused(private_shm(2 * meminfo("MemTotal"), server_argv(run_dir, str(asked))))
    assert f"SMB_MEMORY={asked / (1 << 30):.1f} GiB ({asked} bytes) is more than this node's available " \
           f"memory (" in message, message
    assert "MemAvailable in /proc/meminfo" in message and "Lend at most" in message


@pytest.mark.timeout(120)
def test_more_than_the_slurm_allocation_is_refused(tmp_path):
    run_dir = create_run_dir(tmp_path / "run")
    message = refused(server_argv(run_dir, "64M"), {"SLURM_MEM_PER_NODE": "48"})
    assert ("is more than the job's Slurm allocation on this node (48.0 MiB, SLURM_MEM_PER_NODE=48 MB)"
            in message), message
    assert "Lend at most 48.0 MiB" in message and "sbatch --mem" in message
    message = refused(server_argv(run_dir, "64M"), {"SLURM_MEM_PER_CPU": "16", "SLURM_CPUS_ON_NODE": "2"})
    assert "(32.0 MiB, SLURM_MEM_PER_CPU=16 MB x SLURM_CPUS_ON_NODE=2)" in message, message
    # Slurm's 0 means the whole node, and an allocation that holds the memory is no limit
    for allocation in ({"SLURM_MEM_PER_NODE": "0"}, {"SLURM_MEM_PER_NODE": "64"}):
        with LocalServers(1, memory="64M", env=allocation) as servers:
            with Client(servers.run_dir, expected_servers=1, timeout=20) as client:
                assert client.counter("c").fetch_add(1) == 0


SERVE_THEN_FILL = """
import os, sys
from eddis.smb import Server
server = Server(sys.argv[1], memory=24 << 20, host="127.0.0.1").start()
# another process now wants /dev/shm: the server's 24 MiB must already be its own
try:
    with open("/dev/shm/eddis-test-filler", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 16 << 20)
    print("filler fit", flush=True)
except OSError as exc:
    print("filler refused:", exc.strerror, flush=True)
sys.stdin.read()
server.stop()
"""


@pytest.mark.timeout(120)
def test_the_lent_memory_is_reserved_at_start(tmp_path, private_shm):
    """A server lending 24 MiB of a 32 MiB /dev/shm, which another process then fills: before,
    the filler took the pages and the client's write killed the server with SIGBUS."""
    run_dir = create_run_dir(tmp_path / "run")
    argv = private_shm(32 * MiB, [sys.executable, "-c", SERVE_THEN_FILL, str(run_dir)])
    proc = subprocess.Popen(argv, env=python_env({"EDDIS_HOSTNAME": "shm-node"}), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        rundir.wait_for_servers(run_dir, 1, 30)
        assert proc.stdout.readline().strip() == "filler refused: No space left on device"
        os.environ["EDDIS_HOSTNAME"] = "client-node"      # the server's memory over the network
        try:
            with Client(run_dir, expected_servers=1, timeout=20) as client:
                pool = client.pool("big", 5 * MiB, dtype="float32")
                data = np.arange(5 * MiB, dtype=np.float32)
                pool.write(data)
                np.testing.assert_array_equal(pool.read(), data)
        finally:
            del os.environ["EDDIS_HOSTNAME"]
        assert proc.poll() is None, "the server died"
    finally:
        out, err = proc.communicate("", timeout=30)
    assert proc.returncode == 0, err[-2000:]


RESERVE = """
import mmap, os
from eddis.errors import SMBMemoryError
from eddis.smb import arena_limits
for transparent in (False, True):
    fd = os.open("/dev/shm/arena-" + str(transparent), os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 16 << 20)
    arena = mmap.mmap(fd, 16 << 20)
    address = __import__("ctypes").addressof(__import__("ctypes").c_char.from_buffer(arena))
    try:
        arena_limits.reserve(fd, address, 16 << 20, transparent=transparent)
        print("reserved")
    except SMBMemoryError as exc:
        print(exc.message)
"""


@pytest.mark.timeout(60)
def test_reserve_reports_a_full_dev_shm(private_shm):
    """Both ways of reserving (fallocate; populating the mapping for transparent huge pages)
    turn a tmpfs too small into SMBMemoryError, never a SIGBUS."""
    proc = subprocess.run(private_shm(8 * MiB, [sys.executable, "-c", RESERVE]), env=python_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout
    for line in lines:
        assert line.startswith("cannot reserve the 16.0 MiB (16777216 bytes) of SMB_MEMORY: "), line
        assert "the free space of /dev/shm (" in line and "set SMB_MEMORY (or smb-server --memory) lower" in line
