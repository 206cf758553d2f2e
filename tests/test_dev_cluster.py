"""scripts/eddis-dev-cluster: a real Slurm cluster of 2 to 8 nodes on this machine.

The lifecycle tests run their own cluster (own state directory and ports) so that
`down` never touches the shared cluster other tests use via `slurm_cluster`. Tests
marked netns run the nodes as network hosts of their own (EDDIS_DEV_CLUSTER_NET=netns).
"""
import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from conftest import DEV_CLUSTER, PYTHON, SRC, dev_cluster_dir, python_env
from eddis.slurm import devcluster

pytestmark = pytest.mark.skipif(shutil.which("sbatch") is None,
                                reason="slurm-wlm not installed (apt-get install slurm-wlm munge libpmix2)")


def free_port_base(start=26817, stop=40000):
    """First base port such that base, base+1 and base+2 are all free."""
    for base in range(start, stop, 10):
        ok = True
        for port in range(base, base + 3):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no three consecutive free ports")


def marked_processes(state_dir):
    """pids whose environment carries the cluster's marker."""
    mark = f"_EDDIS_DEV_CLUSTER={state_dir}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def leftover_network(names):
    """Which of these namespaces and interfaces (root namespace) still exist."""
    namespaces = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    return [n for n in names if n in namespaces or os.path.exists(f"/sys/class/net/{n}")]


def network_names(state):
    """The namespaces, veths and bridge of a netns cluster, from its record."""
    names = [n.netns for n in devcluster.nodes(state)] + [n.veth for n in devcluster.nodes(state)]
    return names + [devcluster.config(state)["BRIDGE"]]


@pytest.fixture
def private_cluster():
    # munged needs every directory on the socket path to be searchable by user munge.
    state = Path(tempfile.mkdtemp(prefix="eddis-dc-test-", dir="/tmp")) / "cluster"
    os.chmod(state.parent, 0o755)
    env = python_env({"EDDIS_DEV_CLUSTER_DIR": str(state),
                      "EDDIS_DEV_CLUSTER_PORT": str(free_port_base()),
                      "SLURM_CONF": str(state / "slurm.conf")})

    def run(*args, timeout=90):
        return subprocess.run([str(DEV_CLUSTER), *args], env=env, capture_output=True, text=True,
                              timeout=timeout)

    yield state, env, run
    run("down")
    shutil.rmtree(state.parent, ignore_errors=True)


@pytest.mark.slurm
@pytest.mark.timeout(240)
def test_up_twice_sinfo_and_down_leaves_nothing(private_cluster):
    state, env, run = private_cluster
    first = run("up")
    assert first.returncode == 0, first.stdout + first.stderr
    pids = {f.name: f.read_text().strip() for f in (state / "run").glob("*.pid")}
    assert len(pids) == 4

    second = run("up")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "already up" in second.stdout
    assert {f.name: f.read_text().strip() for f in (state / "run").glob("*.pid")} == pids

    sinfo = subprocess.run(["sinfo", "-h", "-o", "%P %N %G %t"], env=env, capture_output=True,
                           text=True, timeout=30)
    rows = {line.split()[0]: line.split()[1:] for line in sinfo.stdout.splitlines()}
    assert rows["a100"][:2] == ["n1", "gpu:a100:2"], sinfo.stdout
    assert rows["v100"][:2] == ["n2", "gpu:v100:2"], sinfo.stdout
    assert rows["a100"][2] == rows["v100"][2] == "idle"

    # A running job must not survive `down`.
    job = subprocess.run(["sbatch", "-p", "a100", "--wrap", "sleep 300", "-o", "/dev/null"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert job.returncode == 0, job.stderr
    deadline = time.time() + 30
    while time.time() < deadline:
        state_now = subprocess.run(["squeue", "-h", "-o", "%T"], env=env, capture_output=True,
                                   text=True, timeout=30).stdout.strip()
        if state_now == "RUNNING":
            break
        time.sleep(0.3)
    assert state_now == "RUNNING"
    assert len(marked_processes(state)) >= 4
    net = network_names(state) if devcluster.config(state)["NET"] == "netns" else []

    down = run("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert marked_processes(state) == []
    assert leftover_network(net) == []
    for pid in pids.values():
        assert not os.path.exists(f"/proc/{pid}"), f"daemon {pid} still alive after down"
    assert not state.exists()
    assert run("status").returncode == 3
    assert run("down").returncode == 0  # down twice is fine too


@pytest.mark.timeout(240)
def test_up_after_the_daemons_were_killed_starts_clean(private_cluster):
    # What a stopped session or CI machine leaves: daemons SIGKILLed, no `down`. Job ids
    # start again at 1 after `up`, so stale Open MPI folders must not survive it.
    state, env, run = private_cluster
    first = run("up")
    assert first.returncode == 0, first.stdout + first.stderr
    prolog = (state / "taskprolog.sh").read_text()
    shm = Path(prolog.split("OMPI_MCA_btl_vader_backing_directory=", 1)[1].split("/$SLURMD_NODENAME")[0])
    stale = shm / "n1" / "eddis-1.0-n1"
    stale.mkdir(parents=True)
    (stale / "vader_segment.n1.1.0").write_bytes(b"x")
    job = subprocess.run(["sbatch", "-p", "a100", "--wrap", "sleep 300", "-o", "/dev/null"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert job.returncode == 0, job.stderr
    for pid_file in (state / "run").glob("*.pid"):
        try:
            os.kill(int(pid_file.read_text().strip()), 9)
        except ProcessLookupError:
            pass
    old = set(marked_processes(state))

    second = run("up")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "already up" not in second.stdout
    assert not stale.exists()
    assert old.isdisjoint(marked_processes(state)), "a task of the killed cluster survived `up`"
    assert (shm / "n1").is_dir() and (shm / "n2").is_dir()


@pytest.mark.timeout(60)
def test_taken_port_is_refused_with_a_hint(private_cluster):
    state, env, run = private_cluster
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        env["EDDIS_DEV_CLUSTER_PORT"] = str(s.getsockname()[1])
        proc = run("up")
    assert proc.returncode != 0
    assert "EDDIS_DEV_CLUSTER_PORT" in proc.stderr
    assert marked_processes(state) == []


HELLO = textwrap.dedent("""
    import os
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    total = comm.allreduce(comm.Get_rank() + 1)
    print("rank", comm.Get_rank(), "size", comm.Get_size(), "node", os.environ["SLURMD_NODENAME"],
          "gpus", os.environ.get("CUDA_VISIBLE_DEVICES"), "het", os.environ.get("SLURM_HET_SIZE"),
          "vader", os.environ.get("OMPI_MCA_btl_vader_backing_directory"), "sum", total, flush=True)
""")


@pytest.mark.timeout(180)
def test_hetjob_runs_one_mpi_world_across_both_nodes(slurm_cluster, tmp_path):
    hello = tmp_path / "hello.py"
    hello.write_text(HELLO)
    out = tmp_path / "het.out"
    script = tmp_path / "het.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH -p a100 -n 2 --gres=gpu:a100:2 -o {out}
        #SBATCH hetjob
        #SBATCH -p v100 -n 2 --gres=gpu:v100:1
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
        export PYTHONPATH={SRC}
        srun --mpi=pmix --het-group=0,1 {PYTHON} {hello} &
        pid=$!
        # Slurm 22.05's srun can miss the end of a hetjob step whose tasks have all exited
        # (two slurmd on one host): once all four ranks have reported, it gets 10 s. Its
        # teardown of such a step can also abort ("double free or corruption"): once all four
        # ranks have reported, that is srun's failure, not the MPI world's, and is said so.
        deadline=
        while kill -0 $pid 2>/dev/null; do
            if [ -z "$deadline" ] && [ "$(grep -c '^rank ' {out})" -ge 4 ]; then deadline=$((SECONDS + 10)); fi
            if [ -n "$deadline" ] && [ $SECONDS -ge $deadline ]; then
                echo "srun missed the end of the step; ended it"; kill -9 $pid; exit 0
            fi
            sleep 0.5
        done
        wait $pid
        status=$?
        if [ $status -gt 128 ] && [ "$(grep -c '^rank ' {out})" -ge 4 ]; then
            echo "srun died of signal $((status - 128)) after all four ranks reported"; exit 0
        fi
        exit $status
        """))
    proc = slurm_cluster.run(["sbatch", "--wait", str(script)], timeout=150, check=False)
    output = out.read_text() if out.exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + output
    rows = [line.split() for line in output.splitlines() if line.startswith("rank ")]
    assert len(rows) == 4, output
    fields = [dict(zip(r[0::2], r[1::2])) for r in rows]
    assert sorted(int(f["rank"]) for f in fields) == [0, 1, 2, 3]
    assert {f["size"] for f in fields} == {"4"}
    assert {f["sum"] for f in fields} == {"10"}
    assert {f["het"] for f in fields} == {"2"}
    by_node = {}
    for f in fields:
        by_node.setdefault(f["node"], []).append(f)
    assert sorted(by_node) == ["n1", "n2"] and all(len(v) == 2 for v in by_node.values())
    assert {f["gpus"] for f in by_node["n1"]} == {"0,1"}
    assert {f["gpus"] for f in by_node["n2"]} == {"0"}  # node-local index
    assert by_node["n1"][0]["vader"] != by_node["n2"][0]["vader"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setting, value, allowed", [
    ("EDDIS_DEV_CLUSTER_NET", "bridge", "auto, netns, loopback"),
    ("EDDIS_DEV_CLUSTER_LINK", "5gbit", "unlimited, 100mbit, 1gbit, 10gbit"),
    ("EDDIS_DEV_CLUSTER_LINK", "1gbit,n1=5gbit", "RATE,nK=RATE,... with RATE one of unlimited, 100mbit, 1gbit, 10gbit"),
    ("EDDIS_DEV_CLUSTER_LINK", "1gbit,n3=unlimited", "n3 is not a node of this cluster"),
    ("EDDIS_DEV_CLUSTER_LINK", "1gbit,3=unlimited", "'3=unlimited' is neither a rate nor nK=RATE"),
    ("EDDIS_DEV_CLUSTER_NODES", "9", "from 2 to 8"),
    ("EDDIS_DEV_CLUSTER_NODES", "1", "from 2 to 8"),
    ("EDDIS_DEV_CLUSTER_NODES", "two", "from 2 to 8"),
])
def test_a_bad_setting_is_refused_naming_it_and_the_allowed_values(private_cluster, setting, value, allowed):
    state, env, run = private_cluster
    env[setting] = value
    proc = run("up")
    assert proc.returncode != 0
    assert f"{setting}='{value}'" in proc.stderr and allowed in proc.stderr, proc.stderr
    assert not state.exists()
    assert marked_processes(state) == []


@pytest.mark.timeout(60)
def test_a_link_rate_on_loopback_nodes_is_refused(private_cluster):
    state, env, run = private_cluster
    env.update(EDDIS_DEV_CLUSTER_NET="loopback", EDDIS_DEV_CLUSTER_LINK="1gbit")
    proc = run("up")
    assert proc.returncode != 0
    assert "EDDIS_DEV_CLUSTER_LINK=1gbit needs network mode netns" in proc.stderr, proc.stderr
    assert not state.exists()


def srun_lines(env, *argv, timeout=60):
    proc = subprocess.run(["srun", *argv], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.split("\n")


ALLREDUCE_BYTES = 20_000_000
ALLREDUCE = textwrap.dedent(f"""
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    send = np.ones({ALLREDUCE_BYTES // 8}, dtype=np.float64)
    recv = np.empty_like(send)
    comm.Allreduce(send, recv)
    print("rank", comm.Get_rank(), MPI.Get_processor_name(), recv[0], flush=True)
""")


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_netns_nodes_are_hosts_of_their_own_with_counted_limited_links(private_cluster):
    state, env, run = private_cluster
    env.update(EDDIS_DEV_CLUSTER_NET="netns", EDDIS_DEV_CLUSTER_LINK="1gbit",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    up = run("up")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "mode netns, 2 nodes, link 1gbit" in up.stdout
    nodes = {n.name: n for n in devcluster.nodes(state)}
    assert sorted(nodes) == ["n1", "n2"]
    status = run("status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert "mode netns, 2 nodes, link 1gbit" in status.stdout
    for node in nodes.values():
        assert node.address in status.stdout

    # Own host names; own addresses in 198.18.0.0/15, which the node's own name resolves to
    # and smb-server publishes; no route out.
    assert srun_lines(env, "-w", "n1", "hostname")[0] == "n1"
    assert srun_lines(env, "-w", "n2", "hostname")[0] == "n2"
    probe = ("import socket; from eddis.smb.server import _published_host; "
             "print(socket.gethostname(), socket.gethostbyname(socket.gethostname()), _published_host())")
    seen = {}
    for name in ("n1", "n2"):
        host, resolved, published = srun_lines(env, "-w", name, PYTHON, "-c", probe)[0].split()
        seen[host] = resolved
        assert resolved == published == nodes[name].address
        assert resolved.startswith(("198.18.", "198.19."))
        assert "default" not in "\n".join(srun_lines(env, "-w", name, "ip", "route"))
    assert seen["n1"] != seen["n2"]
    shared = Path(dev_cluster_dir()) / "nodes"
    if shared.exists():  # the shared cluster, when it runs in netns mode too, has another /24
        assert not {n.address for n in nodes.values()} & {n.address for n in devcluster.nodes(shared.parent)
                                                         if n.veth}

    # The link rate: an HTB class of 1gbit on both ends of each node's veth.
    for node in nodes.values():
        out_of_node = subprocess.run(["tc", "-n", node.netns, "class", "show", "dev", "eth0"],
                                     capture_output=True, text=True, timeout=30).stdout
        into_node = subprocess.run(["tc", "class", "show", "dev", node.veth], capture_output=True,
                                   text=True, timeout=30).stdout
        assert "htb" in out_of_node and "rate 1Gbit" in out_of_node, out_of_node
        assert "htb" in into_node and "rate 1Gbit" in into_node, into_node

    # A 2-node allreduce crosses both links: each node sends and receives at least the
    # 20 MB (each element leaves or enters each node once at least).
    before = devcluster.traffic(state)
    lines = srun_lines(env, "--mpi=pmix", "-N2", "-n2", PYTHON, "-c", ALLREDUCE, timeout=120)
    assert sorted(line.split()[2] for line in lines if line.startswith("rank ")) == ["n1", "n2"], lines
    grown = devcluster.difference(before, devcluster.traffic(state))
    for name in ("n1", "n2"):
        assert grown[name]["tx"] >= ALLREDUCE_BYTES and grown[name]["rx"] >= ALLREDUCE_BYTES, grown
    script = subprocess.run([str(DEV_CLUSTER), "traffic", "--json"], env=env, capture_output=True, text=True,
                            timeout=30)
    assert script.returncode == 0, script.stderr
    counted = __import__("json").loads(script.stdout)
    assert all(counted[n]["tx"] >= before[n]["tx"] + ALLREDUCE_BYTES for n in ("n1", "n2")), counted

    # Another link rate rebuilds the cluster.
    env["EDDIS_DEV_CLUSTER_LINK"] = "100mbit"
    again = run("up")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "rebuilding" in again.stdout and "link 100mbit" in again.stdout
    veth = devcluster.nodes(state)[0].veth
    assert "rate 100Mbit" in subprocess.run(["tc", "class", "show", "dev", veth], capture_output=True,
                                            text=True, timeout=30).stdout
    pids = [f.read_text().strip() for f in (state / "run").glob("*.pid")]
    net = network_names(state)
    assert leftover_network(net) == net

    down = run("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert marked_processes(state) == []
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    assert leftover_network(net) == []
    assert not state.exists()


def htb_rates(node):
    """The HTB class lines on both ends of a node's link: (out of the node, into it)."""
    out_of_node = subprocess.run(["tc", "-n", node.netns, "class", "show", "dev", "eth0"],
                                 capture_output=True, text=True, timeout=30).stdout
    into_node = subprocess.run(["tc", "class", "show", "dev", node.veth], capture_output=True,
                               text=True, timeout=30).stdout
    return out_of_node, into_node


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_netns_per_node_link_rates_are_shaped_shown_and_rebuilt(private_cluster):
    state, env, run = private_cluster
    env.update(EDDIS_DEV_CLUSTER_NET="netns", EDDIS_DEV_CLUSTER_LINK="1gbit,n2=100mbit")
    up = run("up")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "mode netns, 2 nodes, link 1gbit,n2=100mbit" in up.stdout
    assert devcluster.config(state)["LINK"] == "1gbit,n2=100mbit"
    nodes = {n.name: n for n in devcluster.nodes(state)}
    assert {name: n.link for name, n in nodes.items()} == {"n1": "1gbit", "n2": "100mbit"}

    # Each node's link has its own rate, on both ends of its veth.
    for name, rate in (("n1", "rate 1Gbit"), ("n2", "rate 100Mbit")):
        for side in htb_rates(nodes[name]):
            assert "htb" in side and rate in side, (name, side)

    status = run("status")
    assert status.returncode == 0, status.stdout + status.stderr
    rows = {line.split()[0]: line for line in status.stdout.splitlines() if line.split()[:1] in (["n1"], ["n2"])}
    assert "1gbit up/down" in rows["n1"] and "100mbit up/down" in rows["n2"], status.stdout

    # The same rates in another order are the same cluster; other per-node rates rebuild it.
    env["EDDIS_DEV_CLUSTER_LINK"] = "N2=100mbit, 1gbit"
    same = run("up")
    assert same.returncode == 0 and "already up" in same.stdout, same.stdout + same.stderr
    env["EDDIS_DEV_CLUSTER_LINK"] = "1gbit,n1=unlimited"
    again = run("up")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "rebuilding" in again.stdout and "link 1gbit,n1=unlimited" in again.stdout
    nodes = {n.name: n for n in devcluster.nodes(state)}
    assert {name: n.link for name, n in nodes.items()} == {"n1": "unlimited", "n2": "1gbit"}
    assert not any("htb" in side for side in htb_rates(nodes["n1"])), htb_rates(nodes["n1"])
    assert all("htb" in side and "rate 1Gbit" in side for side in htb_rates(nodes["n2"])), htb_rates(nodes["n2"])
    assert "unlimited up/down" in run("status").stdout

    net = network_names(state)
    down = run("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert marked_processes(state) == [] and leftover_network(net) == []


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_the_shared_cluster_runs_in_netns_mode_in_ci(slurm_cluster):
    if os.environ.get("CI") != "true":
        pytest.skip("checks the mode of CI's shared cluster (CI=true); a developer's may be either")
    if os.environ.get("EDDIS_DEV_CLUSTER_NET", "auto") not in ("auto", "netns"):
        pytest.skip(f"EDDIS_DEV_CLUSTER_NET={os.environ['EDDIS_DEV_CLUSTER_NET']} asks for another mode")
    assert devcluster.config(slurm_cluster.state_dir)["NET"] == "netns"
    assert [slurm_cluster.run(["srun", "-w", n, "hostname"], timeout=60).stdout.strip() for n in ("n1", "n2")] \
        == ["n1", "n2"]
