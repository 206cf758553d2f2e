"""The job script's bound on the trainers' srun (eddis-train --guard-trainers).

srun sometimes misses the end of a hetjob step whose ranks have all exited; the
guard then ends srun after EDDIS_STEP_END_GRACE and leaves the status the
ranks' exit records stand for. A real process plays the srun that never
returns; the records are written by the launcher's own LaunchRecords.
"""
import subprocess
import sys
import time

import pytest
pytestmark = pytest.mark.slow  # the guards' grace periods are seconds of real time

from eddis.launch import jobsteps
from eddis.launch.report import LaunchRecords


def _launch(run_dir, exits):
    records = LaunchRecords(run_dir, "77.2")
    for rank in range(len(exits)):
        records.start(rank, {"rank": rank, "host": "n1", "size": len(exits), "time": time.time()})
    for rank, (code, sig) in enumerate(exits):
        records.finish(rank, {"rank": rank, "host": "n1", "code": code, "signal": sig, "why": "exited",
                              "time": time.time() + rank})
    return records


def _stuck_srun():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exits, status", [([(0, None), (0, None)], 0),
                                           ([(0, None), (3, None)], 3),
                                           ([(None, 9), (0, None)], 137)])
def test_stuck_srun_is_ended_with_the_ranks_status(tmp_path, capsys, exits, status):
    _launch(tmp_path, exits)
    srun = _stuck_srun()
    try:
        started = time.monotonic()
        assert jobsteps.guard_trainer_step(tmp_path, srun.pid, grace=1.0, poll=0.05) == 0
        assert srun.wait(timeout=10) == -9
        assert time.monotonic() - started >= 1.0
    finally:
        srun.kill()
    assert (tmp_path / "launch" / "trainers.status").read_text().strip() == str(status)
    assert "had not returned" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_stuck_srun_gets_the_root_causes_status_not_a_stopped_peers(tmp_path, capsys):
    """A rank that failed before its exit record and a peer its launcher stopped with SIGTERM:
    the guard says the status the job ends with, the root cause's, not the peer's 143."""
    records = _launch(tmp_path, [(None, 15), (1, None)])
    records.fail(1, {"rank": 1, "host": "n1", "code": 1, "signal": None, "why": "failed",
                     "time": time.time() - 5})
    srun = _stuck_srun()
    try:
        assert jobsteps.guard_trainer_step(tmp_path, srun.pid, grace=0.2, poll=0.05) == 0
    finally:
        srun.kill()
    assert (tmp_path / "launch" / "trainers.status").read_text().strip() == "1"
    assert "Job status 1," in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_srun_that_returns_is_left_alone(tmp_path):
    _launch(tmp_path, [(0, None)])
    srun = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    assert jobsteps.guard_trainer_step(tmp_path, srun.pid, grace=30.0, poll=0.05) == 0
    assert srun.wait(timeout=10) == 0
    assert not (tmp_path / "launch" / "trainers.status").exists()


@pytest.mark.timeout(60)
def test_ranks_still_running_keep_srun_alive(tmp_path):
    records = LaunchRecords(tmp_path, "77.2")
    for rank in range(2):
        records.start(rank, {"rank": rank, "size": 2, "time": time.time()})
    records.finish(0, {"rank": 0, "code": 0, "signal": None, "why": "exited", "time": time.time()})
    srun = _stuck_srun()
    try:
        guard = subprocess.Popen([sys.executable, "-c", (
            "import sys; from eddis.launch import jobsteps; "
            f"sys.exit(jobsteps.guard_trainer_step({str(tmp_path)!r}, {srun.pid}, grace=0.2, poll=0.05))")],
            env={"PYTHONPATH": str(__import__("conftest").SRC), "PATH": "/usr/bin:/bin"})
        time.sleep(2.0)
        assert srun.poll() is None and guard.poll() is None, "the guard ended srun while a rank still ran"
    finally:
        srun.kill()
    assert guard.wait(timeout=10) == 0
    assert not (tmp_path / "launch" / "trainers.status").exists()


def _squeue_stub(directory, listing):
    """An squeue on PATH that prints ``listing`` (the job's steps as '%i %j') and logs its arguments."""
    directory.mkdir()
    stub = directory / "squeue"
    stub.write_text(f"#!/bin/sh\necho \"$@\" >> {directory}/calls\nprintf '{listing}'\n")
    stub.chmod(0o755)
    return {"PATH": f"{directory}:/usr/bin:/bin", "SLURM_HET_SIZE": "2", "SLURM_JOB_ID": "41",
            "SLURM_JOB_ID_HET_GROUP_0": "41", "SLURM_JOB_ID_HET_GROUP_1": "42"}


@pytest.mark.timeout(60)
def test_srun_is_ended_soon_once_slurm_lists_the_step_no_more(tmp_path, capsys):
    env = _squeue_stub(tmp_path / "bin", "41.0 smb-server\\n42.0 smb-server\\n")
    _launch(tmp_path, [(0, None), (None, 9)])
    srun = _stuck_srun()
    try:
        started = time.monotonic()
        assert jobsteps.guard_trainer_step(tmp_path, srun.pid, grace=50.0, poll=0.05, env=env) == 0
        took = time.monotonic() - started
        assert srun.wait(timeout=10) == -9
    finally:
        srun.kill()
    assert jobsteps.STEP_GONE_GRACE <= took < 50.0
    assert (tmp_path / "launch" / "trainers.status").read_text().strip() == "137"
    assert "Slurm had ended the step" in capsys.readouterr().err
    assert "-s -j 41,42 -o %i %j" in (tmp_path / "bin" / "calls").read_text()


@pytest.mark.timeout(60)
def test_a_step_slurm_still_lists_gets_the_full_grace(tmp_path, capsys):
    env = _squeue_stub(tmp_path / "bin", "41.0 smb-server\\n41.2 eddis-train\\n42.2 eddis-train\\n")
    _launch(tmp_path, [(0, None), (0, None)])
    srun = _stuck_srun()
    try:
        started = time.monotonic()
        grace = jobsteps.STEP_GONE_GRACE + 2.0
        assert jobsteps.guard_trainer_step(tmp_path, srun.pid, grace=grace, poll=0.05, env=env) == 0
        assert time.monotonic() - started >= grace
    finally:
        srun.kill()
    assert "EDDIS_STEP_END_GRACE" in capsys.readouterr().err


def test_slurm_lists_step_cannot_ask_without_a_job_or_squeue(tmp_path):
    assert jobsteps.slurm_lists_step("eddis-train", env={"PATH": "/usr/bin:/bin"}) is None
    assert jobsteps.slurm_lists_step("eddis-train", env={"PATH": str(tmp_path), "SLURM_JOB_ID": "41"}) is None


@pytest.mark.timeout(60)
def test_a_new_run_of_a_job_id_starts_without_the_last_runs_records(tmp_path):
    # Job ids start again on a rebuilt cluster and a requeued job keeps its id: the ranks'
    # exit records and server addresses of the earlier run would end the new one at once.
    from eddis.smb import rundir

    run_dir = jobsteps.create_run_dir(tmp_path / "1")
    token = rundir.read_token(run_dir)
    _launch(run_dir, [(0, None), (0, None)])
    (run_dir / rundir.SERVERS_DIR / "0.json").write_text('{"index": 0, "host": "gone", "port": 1}')
    again = jobsteps.create_run_dir(run_dir)
    assert again == run_dir and rundir.read_token(run_dir) == token
    assert not (run_dir / "launch").exists()
    assert list((run_dir / rundir.SERVERS_DIR).iterdir()) == []
    srun = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    # no records: nothing says the ranks have exited, so the guard leaves srun to return
    assert jobsteps.guard_trainer_step(run_dir, srun.pid, grace=0.1, poll=0.05) == 0
    assert srun.wait(timeout=10) == 0


def _elastic_launch(run_dir, size, finished):
    """A launch of ``size`` ranks of which ranks ``finished`` recorded a finished training."""
    records = LaunchRecords(run_dir, "77.mpirun-5")
    for rank in range(size):
        records.start(rank, {"rank": rank, "host": f"n{1 + rank // 2}", "size": size, "time": time.time()})
    for rank in finished:
        records.finish(rank, {"rank": rank, "host": "n1", "code": 0, "signal": None, "why": "exited",
                              "time": time.time()})


@pytest.mark.timeout(60)
def test_elastic_mpirun_is_ended_once_the_survivors_finished_and_a_node_stays_silent(tmp_path, capsys,
                                                                                     monkeypatch):
    """mpirun never learns that the ranks of a lost node ended: after the first finished rank, the
    others get EDDIS_STEP_END_GRACE + EDDIS_ELASTIC_LOST_AFTER s, then mpirun ends with status 0."""
    monkeypatch.setenv("EDDIS_ELASTIC_LOST_AFTER", "0.3")
    _elastic_launch(tmp_path, 4, finished=[0, 1])
    mpirun = _stuck_srun()
    try:
        started = time.monotonic()
        assert jobsteps.guard_trainer_step(tmp_path, mpirun.pid, grace=0.2, poll=0.05, elastic=True) == 0
        assert mpirun.wait(timeout=10) == -9
        assert time.monotonic() - started >= 0.5
    finally:
        mpirun.kill()
    assert (tmp_path / "launch" / jobsteps.TRAINERS_STATUS_FILE).read_text() == "0\n"
    err = capsys.readouterr().err
    assert "2 of 4 ranks exited (exited with code 0)" in err
    assert "rank(s) 2, 3 recorded no exit" in err and "lost with their node" in err


@pytest.mark.timeout(60)
def test_a_launch_without_a_finished_rank_is_not_ended_early_nor_is_srun(tmp_path, monkeypatch):
    """No rank finished yet (elastic), or srun's launch (not elastic) with ranks unrecorded: waits."""
    monkeypatch.setenv("EDDIS_ELASTIC_LOST_AFTER", "0.1")
    for finished, elastic in (([], True), ([0, 1], False)):
        run_dir = tmp_path / f"{elastic}-{len(finished)}"
        _elastic_launch(run_dir, 4, finished)
        launcher = _stuck_srun()
        guard = subprocess.Popen(
            [sys.executable, "-c", "import sys; from eddis.launch import jobsteps; "
             f"sys.exit(jobsteps.guard_trainer_step({str(run_dir)!r}, {launcher.pid}, grace=0.1, poll=0.05, "
             f"elastic={elastic}))"])
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                guard.wait(timeout=2.0)
            assert launcher.poll() is None
        finally:
            launcher.kill()
            launcher.wait(timeout=10)
        assert guard.wait(timeout=10) == 0   # it returns once the launcher has ended
