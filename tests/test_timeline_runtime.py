"""A real EDDIS training run with the timeline and the profile on.

Two smb-server processes (index 0 and 1) serve a run directory; 4 Open MPI ranks
train a small torch model with eddis.torch's DistributedOptimizer in mode sync
(gradient buckets reduced on the servers, fp16 on the wire; small buckets, so
several per step).
The merged trace must hold every rank and both servers on one clock, each push
after its bucket-ready; the profile must be in the run directory. A second run
slows rank 2 down 2x (it sleeps as long as its forward took, before backward)
and the report must name it the straggler.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PYTHON, python_env

import eddis.smb._core  # noqa: F401  (required: missing is a failure, not a skip)

BATCH = 16


def worker(steps, slow_rank, window=None):
    """One rank of the training run (started through mpirun by the tests)."""
    import torch
    import torch.nn.functional as F

    import eddis.torch as eddis

    eddis.init()
    rank = eddis.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 10))
    # the mode given to the optimizer (not EDDIS_MODE) is the one the profile must record
    optimizer = eddis.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                           named_parameters=model.named_parameters(),
                                           mode=os.environ.get("TEST_OPTIMIZER_MODE") or None)
    optimizer.set_sample_count(BATCH)
    eddis.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.manual_seed(rank)
    for step in range(steps):
        if window and step == window[1]:
            eddis.stop_timeline()
        if window and step == window[0]:
            eddis.start_timeline(window[2])  # collective: every rank, same step
        x, y = torch.randn(BATCH, 64), torch.randint(0, 10, (BATCH,))
        optimizer.zero_grad()
        start = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        if rank == slow_rank:
            time.sleep(max(time.perf_counter() - start, 0.002))  # at least twice as slow
        loss.backward()
        optimizer.step()
    eddis.shutdown()
    print(f"rank {rank} trained {steps} steps, loss {loss.item():.4f}", flush=True)


class Servers:
    """``count`` smb-server processes on one run directory, stopped (SIGTERM) at exit."""

    def __init__(self, run_dir, count, env):
        from eddis.smb import rundir

        self.run_dir = Path(run_dir)
        rundir.create_run_dir(self.run_dir)
        self.procs = []
        for index in range(count):
            self.procs.append(subprocess.Popen(
                [PYTHON, "-c", "import sys; from eddis.smb.server import main; sys.exit(main())",
                 "--run-dir", str(self.run_dir), "--index", str(index), "--memory", "64M"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))
        try:
            rundir.wait_for_servers(self.run_dir, count, timeout=120)
        except Exception as exc:
            outputs = self.stop()
            pytest.fail(f"smb-servers did not start: {exc}\n" + "\n".join(outputs), pytrace=False)

    def stop(self):
        outputs = []
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                out, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
            outputs.append(out)
        return outputs


def train(run_mpi, tmp_path, name, servers=2, ranks=4, steps=30, slow_rank=-1, compression="none"):
    run_dir = tmp_path / name / "run"
    timeline_dir = tmp_path / name / "timeline"
    # The servers sum (EDDIS_SYNC_REDUCE=server), so that their side of the timeline has reductions
    # too; on one node the ranks would sum by default.
    env = {"EDDIS_RUN_DIR": str(run_dir), "EDDIS_TIMELINE": str(timeline_dir), "EDDIS_PROFILE": "1",
           "EDDIS_MODE": "sync", "EDDIS_BUCKET_BYTES": "16K", "EDDIS_COMPRESSION": compression,
           "EDDIS_SYNC_REDUCE": "server"}
    smb = Servers(run_dir, servers, python_env(env))
    try:
        proc = run_mpi(ranks, [PYTHON, __file__, str(steps), str(slow_rank)], env=env, timeout=400)
    finally:
        server_output = smb.stop()
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{server_output}"
    assert proc.stdout.count(f"trained {steps} steps") == ranks
    return run_dir, timeline_dir


@pytest.mark.timeout(600)
def test_sync_training_timeline_and_profile(run_mpi, tmp_path):
    from eddis.timeline.merge import SERVER_PID_BASE, merge_timeline

    from test_timeline_mpi import check_push_after_ready

    run_dir, timeline_dir = train(run_mpi, tmp_path, "sync", compression="fp16")
    out, summary = merge_timeline(timeline_dir)
    data = json.loads(out.read_text())
    assert summary["ranks"] == [0, 1, 2, 3] and summary["servers"] == [0, 1]
    events = data["traceEvents"]
    names = {}
    for e in events:
        names.setdefault(e["pid"], set()).add(e["name"])
    for rank in range(4):
        assert {"bucket_ready", "compress", "push", "pull", "decompress", "wait", "optimizer_step",
                "clock_sync"} <= names[rank], names[rank]
        assert check_push_after_ready(events, rank) >= 30 * 2  # several buckets per step
    for index in range(2):
        assert {"reduce", "smb_request"} <= names[SERVER_PID_BASE + index], names[SERVER_PID_BASE + index]
    # Servers run on this host: on rank 0's clock exactly.
    clocks = data["otherData"]["eddis_clock"]
    assert clocks[str(SERVER_PID_BASE + 1)]["uncertainty_us"] == 0.0

    from eddis.timeline.profile import load_profile

    run_attrs, ranks = load_profile(run_dir / "profile.h5")
    assert sorted(ranks) == [0, 1, 2, 3]
    assert json.loads(run_attrs["modes"]) == ["sync"]
    for data in ranks.values():
        assert list(data["step"]) == list(range(1, 31))
        assert (data["samples"] == BATCH).all()  # set_sample_count
        assert (data["bytes_sent"] > 0).all() and (data["bytes_recv"] > 0).all()


@pytest.mark.timeout(600)
def test_simulated_slow_rank_is_the_straggler(run_mpi, tmp_path):
    from eddis.timeline.report import report

    run_dir, _ = train(run_mpi, tmp_path, "slow", servers=1, slow_rank=2)
    text, summary, paths = report(run_dir / "profile.h5", out_dir=tmp_path / "plots")
    assert summary["straggler"] == 2, text
    assert len(paths) == 3 and all(p.stat().st_size > 1000 for p in paths)


@pytest.mark.timeout(300)
def test_unwritable_timeline_dir_warns_and_training_goes_on(run_mpi, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the timeline directory should be")
    env = {"EDDIS_MODE": "allreduce", "EDDIS_TIMELINE": str(blocker / "timeline"),
           "EDDIS_PROGRESS": "log", "EDDIS_PROGRESS_INTERVAL": "0"}
    proc = run_mpi(2, [PYTHON, __file__, "12", "-1"], env=env, timeout=250)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.count("trained 12 steps") == 2
    assert proc.stderr.count("TimelineWarning") == 2, proc.stderr  # once per rank
    assert "Training goes on" in proc.stderr
    # rank 0's progress lines (stdout is a pipe here, so log lines, not a bar)
    assert "[eddis] train step 12" in proc.stdout


@pytest.mark.timeout(300)
def test_start_and_stop_timeline_for_a_window_of_steps(run_mpi, tmp_path):
    from eddis.timeline.merge import merge_timeline

    directory = tmp_path / "window"
    proc = run_mpi(2, [PYTHON, __file__, "10", "-1", f"3,7,{directory}"], env={"EDDIS_MODE": "allreduce"},
                   timeout=250)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    out, summary = merge_timeline(directory)
    events = json.loads(out.read_text())["traceEvents"]
    assert summary["ranks"] == [0, 1]
    for rank in range(2):
        steps = {e["args"]["step"] for e in events if e["pid"] == rank and e["name"] == "allreduce"}
        assert steps == {3, 4, 5, 6}, steps  # the reducer counts steps from 0
        assert any(e["name"] == "clock_sync" for e in events if e["pid"] == rank)


@pytest.mark.timeout(300)
def test_easgd_with_the_embedded_server(run_mpi, tmp_path):
    """Plain mpirun: rank 0 runs the SMB server in-process; it still gets its own trace.
    The mode is given to DistributedOptimizer(mode="easgd") while EDDIS_MODE says sync."""
    from eddis.timeline.merge import SERVER_PID_BASE, merge_timeline
    from eddis.timeline.profile import load_profile

    env = {"EDDIS_MODE": "sync", "TEST_OPTIMIZER_MODE": "easgd", "EDDIS_TIMELINE": str(tmp_path / "tl"),
           "EDDIS_PROFILE": "1", "EDDIS_RUN_DIR": str(tmp_path / "run")}
    proc = run_mpi(2, [PYTHON, __file__, "12", "-1"], env=env, timeout=250)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    out, summary = merge_timeline(tmp_path / "tl")
    assert summary["ranks"] == [0, 1] and summary["servers"] == [0]
    events = json.loads(out.read_text())["traceEvents"]
    for rank in range(2):
        names = {e["name"] for e in events if e["pid"] == rank}
        assert {"easgd_exchange", "optimizer_step", "wait"} <= names, names
    assert any(e["name"] == "smb_request" for e in events if e["pid"] == SERVER_PID_BASE)
    run_attrs, ranks = load_profile(tmp_path / "run" / "profile.h5")
    assert json.loads(run_attrs["modes"]) == ["easgd"] and sorted(ranks) == [0, 1]
    assert all(len(d["step"]) == 12 for d in ranks.values())


if __name__ == "__main__":
    start, stop, where = (sys.argv[3].split(",", 2) if len(sys.argv) > 3 else (None, None, None))
    worker(int(sys.argv[1]), int(sys.argv[2]), (int(start), int(stop), where) if start else None)
