"""The rate one link of the emulated cluster really carries, and the floor it puts under a step.

``measure(cluster_dir)`` streams TCP bytes from the first node's network namespace to the
second's for a bounded time, inside the namespaces the cluster made (no traffic leaves
them), and returns the receiver's bytes per second. The HTB class of a 1gbit link carries
about 0.94 Gbit/s of payload, and at 10gbit two CPUs may be what limits it, so the floor
is drawn from this measure, not from the configured rate.

``floor_step_s(...)`` is what the hardware allows one step of a contender: the longer of
the step the ranks take with no communication at all (the ``solo`` contender's) and the
time the busiest link and way needs for the bytes the contender put on it.
"""
import subprocess
import sys

PORT = 18990
SECONDS = 2.0
MAX_BYTES = 4 << 30
CHUNK = 1 << 20

RECEIVER = """
import socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1); srv.settimeout(30)
print("listening", flush=True)
conn, _ = srv.accept(); conn.settimeout(30)
got, first, last = 0, None, None
while True:
    data = conn.recv(1 << 20)
    if not data:
        break
    now = time.perf_counter()
    if first is None:
        first = now
    got, last = got + len(data), now
print(got, (last or 0) - (first or 0), flush=True)
"""

SENDER = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
buf, end, sent = b"\\0" * int(sys.argv[5]), time.monotonic() + float(sys.argv[3]), 0
while time.monotonic() < end and sent < int(sys.argv[4]):
    s.sendall(buf); sent += len(buf)
s.close()
"""


def _in_netns(netns, code, *argv):
    return ["ip", "netns", "exec", netns, sys.executable, "-c", code, *map(str, argv)]


def measure(cluster_dir, seconds=SECONDS):
    """Bytes per second from node 1 to node 2 of the netns cluster at ``cluster_dir``."""
    from eddis.slurm import devcluster

    found = devcluster.nodes(cluster_dir)
    if len(found) < 2 or not all(n.netns for n in found[:2]):
        raise RuntimeError(f"the cluster at {cluster_dir} has no two nodes in network namespaces to measure")
    source, sink = found[0], found[1]
    receiver = subprocess.Popen(_in_netns(sink.netns, RECEIVER, sink.address, PORT), stdout=subprocess.PIPE,
                                text=True)
    try:
        if receiver.stdout.readline().strip() != "listening":
            raise RuntimeError("the link probe's receiver did not start")
        subprocess.run(_in_netns(source.netns, SENDER, sink.address, PORT, seconds, MAX_BYTES, CHUNK),
                       check=True, timeout=seconds + 60)
        out, _ = receiver.communicate(timeout=60)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    got, elapsed = out.split()
    if float(elapsed) <= 0:
        raise RuntimeError(f"the link probe received {got} bytes in no measurable time")
    return int(got) / float(elapsed)


def busiest_way_bytes(record):
    """The bytes a step put on its busiest node link and direction."""
    return max(max(record["tx_per_step"]), max(record["rx_per_step"]))


def floor_step_s(record, solo, link_bytes_per_s):
    """The floor of ``record``'s step in seconds: max(solo step, busiest link way / link rate);
    None without the solo contender's record or a measured link rate."""
    if solo is None or not link_bytes_per_s:
        return None
    solo_step = solo["global_batch"] / solo["samples_per_s"]
    return max(solo_step, busiest_way_bytes(record) / link_bytes_per_s)


def step_s(record):
    return record["global_batch"] / record["samples_per_s"]
