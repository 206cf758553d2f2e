"""HDF5 profile, report and progress display.

The MPI test trains a small torch model on 4 real Open MPI ranks (gradients
averaged with MPI allreduce), with rank 2 slowed 2x: after its forward/backward
it sleeps as long again. The report must name rank 2 the straggler.
"""
import io
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import PYTHON, python_env

SLOW_RANK = 2


def worker(run_dir, steps, slow_rank):
    """One rank of the test run (started through mpirun by the test)."""
    import torch
    from mpi4py import MPI

    from eddis.timeline.profile import StepProfiler

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    prof = StepProfiler(run_dir, rank, size=comm.Get_size(), gpu_type="a100" if rank < 2 else "v100",
                        mode="allreduce")
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    batch = 32
    for step in range(steps):
        x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if rank == slow_rank:
            time.sleep(time.perf_counter() - t0)  # the 2x slowdown
        torch.cat([p.grad.reshape(-1) for p in model.parameters()], out=flat)
        t1 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, flat.numpy())
        t2 = time.perf_counter()
        prof.add_comm(t2 - t1, bytes_sent=flat.numel() * 4, bytes_recv=flat.numel() * 4)
        prof.add_wait(t2 - t1)
        offset = 0
        for p in model.parameters():
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p) / comm.Get_size())
            offset += p.numel()
        opt.step()
        prof.step_end(batch)
    merged = prof.finalize(comm)
    if rank == 0:
        print("merged", merged)


@pytest.mark.timeout(240)
def test_profile_of_a_run_with_a_slow_rank_names_it_straggler(run_mpi, tmp_path):
    from PIL import Image

    from eddis.timeline.profile import load_profile

    run_dir = tmp_path / "run"
    proc = run_mpi(4, [PYTHON, __file__, str(run_dir), "40", str(SLOW_RANK)], timeout=200, check=True,
                   env={"OMPI_MCA_mpi_yield_when_idle": "1"})
    assert f"merged {run_dir / 'profile.h5'}" in proc.stdout

    run_attrs, ranks = load_profile(run_dir / "profile.h5")
    assert sorted(ranks) == [0, 1, 2, 3]
    assert json.loads(run_attrs["gpu_types"]) == ["a100", "v100"]
    assert json.loads(run_attrs["settings"])["EDDIS_PROFILE"] in (False, True)
    assert "torch" in json.loads(run_attrs["versions"])
    for rank, data in ranks.items():
        assert list(data["step"]) == list(range(1, 41))
        assert data["attrs"]["mode"] == "allreduce"
        assert np.all(data["samples"] == 32)
        np.testing.assert_allclose(data["t_compute"] + data["t_wait"], data["t_step"], rtol=1e-9)

    out = tmp_path / "plots"
    rep = subprocess.run([PYTHON, "-m", "eddis.timeline.cli", "report", str(run_dir / "profile.h5"),
                          "--out", str(out), "--json"],
                         env=python_env(), capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    summary = json.loads(rep.stdout)
    assert summary["straggler"] == SLOW_RANK, summary["ranking"]
    by_type = {g["gpu_type"]: g for g in summary["by_gpu_type"]}
    assert by_type["a100"]["ranks"] == 2 and by_type["v100"]["ranks"] == 2
    assert all(r["bandwidth_gb_s"] > 0 for r in summary["ranks"])
    for name in ("step_time.png", "throughput.png", "breakdown.png"):
        path = out / name
        assert str(path) in summary["plots"]
        with Image.open(path) as img:
            img.verify()
        with Image.open(path) as img:
            assert img.format == "PNG" and img.size == (800, 450)

    table = subprocess.run([PYTHON, "-m", "eddis.timeline.cli", "report", str(run_dir), "--no-plots"],
                           env=python_env(), capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    assert f"1. rank {SLOW_RANK} (v100" in table.stdout
    assert "per GPU type:" in table.stdout


@pytest.mark.timeout(60)
def test_unwritable_run_dir_warns_and_recording_goes_on(tmp_path):
    from eddis.timeline.profile import ProfileWarning, StepProfiler

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.warns(ProfileWarning, match="Training goes on"):
        prof = StepProfiler(blocker / "run", 0)
    for step in range(3):
        prof.step_end(8)
    prof.close()
    assert prof.failed


@pytest.mark.timeout(60)
def test_merge_skips_a_damaged_rank_file(tmp_path):
    from eddis.timeline.profile import ProfileWarning, StepProfiler, load_profile, merge_profiles

    for rank in range(2):
        prof = StepProfiler(tmp_path, rank, size=3)
        for _ in range(4):
            prof.step_end(8)
        prof.close()
    (tmp_path / "profile" / "rank-2.h5").write_bytes(b"cut short by a crash")
    with pytest.warns(ProfileWarning, match="rank-2.h5"):
        merged = merge_profiles(tmp_path)
    run_attrs, ranks = load_profile(merged)
    assert sorted(ranks) == [0, 1] and run_attrs["size"] == 3 and run_attrs["ranks_recorded"] == 2
    assert all(list(d["step"]) == [1, 2, 3, 4] for d in ranks.values())


@pytest.mark.timeout(60)
def test_report_on_a_directory_without_profile_says_how_to_get_one(tmp_path):
    proc = subprocess.run([PYTHON, "-m", "eddis.timeline.cli", "report", str(tmp_path)],
                          env=python_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "EDDIS_PROFILE=1" in proc.stderr


@pytest.mark.timeout(60)
def test_progress_log_lines_when_not_a_terminal():
    from eddis.timeline.progress import Progress

    stream = io.StringIO()
    progress = Progress(total=4, rank=0, interval=0.0, stream=stream)
    assert progress.mode == "log"
    for step in range(4):
        progress.update(samples=16, loss=1.0 / (step + 1))
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[eddis] train step 1/4 (25.0%)")
    assert "step 4/4 (100.0%)" in lines[-1] and "loss 0.25" in lines[-1] and "samples/s" in lines[-1]

    quiet = io.StringIO()
    other_rank = Progress(total=4, rank=1, stream=quiet)
    other_rank.update(samples=16)
    other_rank.close()
    assert quiet.getvalue() == ""


@pytest.mark.timeout(60)
def test_progress_counts_steps_and_says_so_when_no_update_gives_samples():
    from eddis.timeline.progress import Progress

    stream = io.StringIO()
    progress = Progress(total=3, rank=0, interval=0.0, stream=stream)
    for _ in range(3):
        progress.update()
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines and all(" steps/s " in line and "samples" not in line for line in lines), lines

    stream = io.StringIO()
    counted = Progress(total=2, rank=0, interval=0.0, stream=stream)
    counted.update(samples=16)
    counted.update(samples=16)
    counted.close()
    assert "  32 samples  " in stream.getvalue().splitlines()[-1]


@pytest.mark.timeout(60)
def test_runtime_progress_is_quiet_for_short_runs_and_shows_reported_loss():
    from eddis.timeline import progress as prog

    quiet = io.StringIO()
    short = prog.Progress(rank=0, interval=3600, stream=quiet, final_line=False)
    short.update(samples=8)
    short.close()
    assert quiet.getvalue() == ""

    stream = io.StringIO()
    prog._active = prog.Progress(rank=0, interval=0.0, stream=stream, final_line=False)
    try:
        prog.set_total(10)
        prog.report_loss(np.float32(0.5))
        prog._active.update(samples=8)
    finally:
        prog._active.close()
        prog._active = None
    assert "step 1/10 (10.0%)" in stream.getvalue() and "loss 0.5" in stream.getvalue()


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.timeout(60)
def test_progress_bar_on_a_terminal():
    from eddis.timeline.progress import Progress

    stream = FakeTerminal()
    with Progress(total=3, rank=0, stream=stream) as progress:
        assert progress.mode == "bar"
        for _ in range(3):
            progress.update(samples=10, loss=0.5)
    text = stream.getvalue()
    assert "3/3" in text and "loss=0.5" in text


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
