"""eddis plan's calibration: the ranks and buckets from a run's profile and timeline, and the
probes inside a job.

The unit tests write the profile and the timeline with EDDIS's own writers (StepProfiler,
Timeline) and known figures; the last test trains for real under ``eddis-train --local``
with the profile and the timeline on, then runs ``eddis plan --calibrate`` as a job of
its own (a real smb-server, real MPI ranks) and plans from what both wrote.
"""
import json
import sys

import pytest

from conftest import PYTHON, REPO, python_env, run_process_group
from launch_helpers import make_bin

from eddis import cli
from eddis.errors import ConfigError
from eddis.plan import calibrate, spec

MS = 1_000_000   # ns


def write_profile(run_dir, speeds, nodes, steps=10, batch=8, sent=1_000_000):
    """A merged profile of ranks with the given compute speeds (samples/s) on the given nodes."""
    from eddis.timeline.profile import StepProfiler, merge_profiles

    for rank, (speed, node) in enumerate(zip(speeds, nodes)):
        prof = StepProfiler(run_dir, rank, size=len(speeds), gpu_type=f"g{speed:g}", mode="sync", node=node)
        compute = batch / speed
        for step in range(1, steps + 1):
            prof.record(step, compute + 0.1, compute, 0.05, 0.1, batch, sent, sent)
        prof.close()
    return merge_profiles(run_dir)


def write_timeline(directory, ranks=2, steps=6, buckets=((300, 4000), (500, 8000), (600, 2000)),
                   updates=(50, 50, 50), compressed=False):
    """Traces of ``ranks`` ranks: step s runs from s seconds to s + 1 s; bucket b is ready
    ``buckets[b][0]`` ms in and pushes ``buckets[b][1]`` bytes; the optimizer runs ``updates``
    ms after the last one; the step's final wait ends it."""
    from eddis.timeline.trace import Timeline

    for rank in range(ranks):
        tl = Timeline(directory, role="rank", index=rank)
        for s in range(steps):
            start = (s + 1) * 1000 * MS
            for b, (ready, nbytes) in enumerate(buckets):
                tl.record("i", "bucket_ready", None, start + ready * MS, 0, {"step": s, "bucket": b})
                if compressed:
                    tl.record("X", "compress", None, start + ready * MS, MS, {"step": s, "bucket": b})
                tl.record("X", "push", None, start + (ready + 1) * MS, 5 * MS,
                          {"step": s, "bucket": b, "bytes": nbytes // (2 if compressed else 1)})
            t = start + 700 * MS
            for u in updates:
                tl.record("X", "optimizer_step", None, t, u * MS, {"bucket": 0})
                t += (u + 10) * MS
            tl.record("X", "wait", None, start + 880 * MS, 120 * MS, {"step": s, "mode": "sync"})
        tl.close()


def test_ranks_and_nodes_from_a_profile(tmp_path):
    path = write_profile(tmp_path / "run", [20.0, 20.0, 10.0, 10.0], ["n1", "n1", "n2", "n2"])
    nodes, batch, sent, modes = calibrate.ranks_from_profile(path)
    assert [name for name, _ in nodes] == ["n1", "n2"]
    assert [[r.samples_per_s for r in ranks] for _, ranks in nodes] == [[20.0, 20.0], [10.0, 10.0]]
    assert {r.kind for _, ranks in nodes for r in ranks} == {"g20", "g10"}
    assert (batch, sent, modes) == (8, 1_000_000, ["sync"])
    # the run directory does as well as its profile.h5
    assert calibrate.ranks_from_profile(tmp_path / "run")[0] == nodes


def test_buckets_and_their_readiness_from_a_timeline(tmp_path):
    write_timeline(tmp_path / "tl")
    buckets, update, wire = calibrate.buckets_from_timeline(tmp_path / "tl")
    assert [b.nbytes for b in buckets] == [4000, 8000, 2000] and wire == 4
    assert [b.ready for b in buckets] == pytest.approx([0.5, 500 / 600, 1.0])
    assert update == pytest.approx(0.150)     # 150 ms of updates in a 1 s step
    write_timeline(tmp_path / "fp16", compressed=True)
    buckets, _, wire = calibrate.buckets_from_timeline(tmp_path / "fp16")
    assert [b.nbytes for b in buckets] == [4000, 8000, 2000] and wire == 2   # as fp32


def test_what_calibration_cannot_use_is_an_error_that_says_what_to_give(tmp_path):
    with pytest.raises(ConfigError, match="rank-\\*.trace.json.*--timeline"):
        calibrate.buckets_from_timeline(tmp_path)
    with pytest.raises(ConfigError, match="--from-profile.*--timeline"):
        calibrate.workload_from_run(None, None)
    (tmp_path / "x.h5").write_text("not hdf5")
    with pytest.raises(ConfigError, match="not an EDDIS profile"):
        calibrate.ranks_from_profile(tmp_path / "x.h5")
    idle = write_profile(tmp_path / "idle", [10.0, 10.0], ["n1", "n1"], sent=0)
    with pytest.raises(ConfigError, match="pushed no gradient bytes"):
        calibrate.workload_from_run(idle, None)


def test_plan_from_a_profile_and_a_timeline(tmp_path, capsys):
    profile = write_profile(tmp_path / "run", [20.0, 20.0, 10.0, 10.0], ["n1", "n1", "n2", "n2"])
    write_timeline(tmp_path / "tl")
    status = cli.main(["plan", "--from-profile", str(profile), "--timeline", str(tmp_path / "tl"), "--link",
                       "100gbit", "--nodes", "4", "--write", str(tmp_path / "used")])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "cluster: 4 nodes, 8 ranks (4 x g20, 4 x g10)" in out
    assert "S = 0.0 MB in 3 bucket(s)" in out and "local batch 8" in out and "update 15% of a step" in out
    model = json.loads((tmp_path / "used" / "model.json").read_text())
    assert [b["bytes"] for b in model["buckets"]] == [4000, 8000, 2000]
    cluster = spec.load_cluster(tmp_path / "used" / "cluster.json")
    assert [len(n.ranks) for n in cluster.nodes] == [2, 2, 2, 2]
    # without the timeline: one bucket of the pushed bytes, ready at the backward's end
    status = cli.main(["plan", "--from-profile", str(profile), "--link", "100gbit"])
    assert status == 0 and "S = 1.0 MB in 1 bucket(s)" in capsys.readouterr().out


# ---------------------------------------------------------------- a real run and the probes
BATCH = 16


def worker(steps):
    """One rank of the profiled run (this file, started by eddis-train --local)."""
    import torch
    import torch.nn.functional as F

    import eddis.torch as eddis

    eddis.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                           named_parameters=model.named_parameters())
    optimizer.set_sample_count(BATCH)
    eddis.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.manual_seed(eddis.rank())
    for _ in range(steps):
        x, y = torch.randn(BATCH, 64), torch.randint(0, 10, (BATCH,))
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    eddis.shutdown()


LINK_PROBE = """
import time
from mpi4py import MPI
from eddis.plan import probe
comm = MPI.COMM_WORLD
hosts = probe._hosts(comm, time.monotonic() + 60)
figures = probe.link_probe(comm, 1, 1 << 20, 3, time.monotonic() + 120)
print("RESULT", comm.Get_rank(), len(set(hosts)), figures is not None and all(f > 0 for f in figures))
"""


def test_the_link_probe_between_two_ranks(run_mpi):
    # one machine, so this measures MPI between two processes, not a link: what it checks is that
    # both ends take part, finish within the deadline and report positive rates and a latency
    proc = run_mpi(2, [PYTHON, "-c", LINK_PROBE], timeout=180, check=True)
    results = sorted(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    assert results == [["0", "1", "True"], ["1", "1", "True"]], proc.stdout + proc.stderr


ALLREDUCE_PROBE = """
import time
from mpi4py import MPI
from eddis.plan import probe
comm = MPI.COMM_WORLD
deadline = time.monotonic() + 120
two, one = probe.allreduce_probe(comm, 2, 1 << 20, 3, deadline), probe.allreduce_probe(comm, 1, 1 << 20, 3, deadline)
print("RESULT", comm.Get_rank(), two is not None and two > 0, one)
"""


def test_the_allreduce_probe_on_every_rank(run_mpi):
    # as if the two ranks were on two nodes (one machine here): every rank takes part and gets
    # the same positive rate; on one node there is no link for it to say anything of
    proc = run_mpi(2, [PYTHON, "-c", ALLREDUCE_PROBE], timeout=180, check=True)
    results = sorted(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    assert results == [["0", "True", "None"], ["1", "True", "None"]], proc.stdout + proc.stderr


def local_job(tmp_path, name, *argv, env=None, timeout=300, status=0):
    run_env = python_env({"PATH": f"{make_bin(tmp_path / 'bin')}:{python_env()['PATH']}",
                          "SMB_MEMORY": "64M", **(env or {})})
    proc = run_process_group(["eddis-train", "--local", "-n", "2", "--run-dir", str(tmp_path / name), *argv],
                             run_env, timeout, cwd=str(REPO))
    assert (proc.returncode == 0) == (status == 0), f"{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_calibrate_from_a_real_run_and_the_probes(tmp_path, capsys):
    local_job(tmp_path, "train", "--profile", "--timeline", str(tmp_path / "tl"), PYTHON, __file__, "20",
              env={"EDDIS_MODE": "sync", "EDDIS_BUCKET_BYTES": "16K"})
    profile = tmp_path / "train" / "profile.h5"
    assert profile.exists()
    proc = local_job(tmp_path, "probe", PYTHON, "-m", "eddis.cli", "plan", "--calibrate", "--from-profile",
                     str(profile), "--timeline", str(tmp_path / "tl"), "--out", str(tmp_path / "cal"),
                     "--link", "10gbit", "--probe-bytes", "1M", "--repeats", "2")
    assert "wrote" in proc.stdout and "server reduce" in proc.stdout
    cluster = spec.load_cluster(tmp_path / "cal" / "cluster.json")
    model = spec.load_model(tmp_path / "cal" / "model.json")
    # one node: the link is the one given, SMB was mapped (no network rate), the reduce measured
    assert cluster.num_nodes == 1 and cluster.size == 2
    assert cluster.put_bps is None and cluster.reduce_bps > 0
    assert all(r.samples_per_s > 0 for r in cluster.ranks)
    params = 64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    assert model.gradient_bytes == 4 * params and len(model.buckets) >= 3
    assert model.local_batch == BATCH and all(0 < b.ready <= 1 for b in model.buckets)
    assert max(b.ready for b in model.buckets) == 1.0
    status = cli.main(["plan", "--cluster", str(tmp_path / "cal" / "cluster.json"), "--model",
                       str(tmp_path / "cal" / "model.json"), "--nodes", "4"])
    out = capsys.readouterr().out
    assert status == 0 and "recommendation:" in out and "cluster: 4 nodes, 8 ranks" in out
    # one node and no --link: nothing to measure the link with, and the job says so
    proc = local_job(tmp_path, "nolink", PYTHON, "-m", "eddis.cli", "plan", "--calibrate", "--out",
                     str(tmp_path / "nolink-out"), status=1)
    assert "one node, so there is no link to measure" in proc.stdout + proc.stderr
    assert not (tmp_path / "nolink-out" / "cluster.json").exists()


if __name__ == "__main__":
    worker(int(sys.argv[1]))
