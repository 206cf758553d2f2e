"""The per-launch Open MPI segment folders: found by job and node, removed by the job's smb-server supervisor."""

import os
import signal
import subprocess
from pathlib import Path

from conftest import PYTHON, python_env
from launch_helpers import wait_until
from eddis.launch import mpishm
from eddis.smb import rundir


def make_folder(base, name, segments=()):
    path = base / name
    path.mkdir()
    for segment in segments:
        (path / segment).write_bytes(b"\0" * 64)
    return path


def test_job_folders_match_this_job_and_node_only(tmp_path):
    env = {"SLURM_JOB_ID": "12", "SLURMD_NODENAME": "n2", mpishm.VARIABLE: str(tmp_path)}
    mine = [make_folder(tmp_path, "eddis-12.0-n2"), make_folder(tmp_path, "eddis-12.4-n2")]
    make_folder(tmp_path, "eddis-123.0-n2")      # another job whose id starts the same
    make_folder(tmp_path, "eddis-12.0-n1")       # the same job on another node
    make_folder(tmp_path, "eddis-mpirun-12-n2")  # a plain mpirun launch
    assert mpishm.job_folders(env) == [str(p) for p in mine]
    assert mpishm.job_folders({mpishm.VARIABLE: str(tmp_path)}) == []  # outside a job: nothing


def test_het_component_finds_the_leaders_folders(tmp_path):
    # A trainer step over all components runs under the leader's job id; a server of component 1
    # may see its own id in SLURM_JOB_ID and the leader's in SLURM_HET_JOB_ID.
    env = {"SLURM_JOB_ID": "13", "SLURM_HET_JOB_ID": "12", "SLURMD_NODENAME": "n2",
           mpishm.VARIABLE: str(tmp_path)}
    folder = make_folder(tmp_path, "eddis-12.2-n2", ["vader_segment.n2.1f.0"])
    assert mpishm.remove_job_folders(env) == [str(folder)]
    assert not folder.exists()


def test_supervisor_cleanup_removes_its_segment_and_the_folder_when_last(tmp_path):
    env = {mpishm.VARIABLE: str(tmp_path)}
    shm = mpishm.MpiShm(env, "7.1", "n1")
    child_env = {}
    shm.prepare(child_env)
    assert child_env[mpishm.VARIABLE] == shm.path
    for local_rank in (0, 1):
        (tmp_path / "eddis-7.1-n1" / f"vader_segment.n1.ab.{local_rank}").write_bytes(b"x")
    shm.cleanup(1)
    assert os.listdir(shm.path) == ["vader_segment.n1.ab.0"]
    shm.cleanup(0)
    assert not os.path.exists(shm.path)


def test_the_server_supervisor_removes_the_jobs_folders_on_its_node_when_its_server_stops(tmp_path):
    base = tmp_path / "shm"
    base.mkdir()
    # what a supervisor killed before its cleanup leaves: the folder and a rank's segment in it
    left = make_folder(base, "eddis-41.3-nodeA", ["vader_segment.nodeA.5e.1"])
    others = [make_folder(base, "eddis-41.3-nodeB", ["vader_segment.nodeB.5e.0"]),
              make_folder(base, "eddis-410.3-nodeA", ["vader_segment.nodeA.77.0"])]
    run = Path(rundir.create_run_dir(tmp_path / "run"))
    env = python_env({"SLURM_JOB_ID": "41", "SLURMD_NODENAME": "nodeA", mpishm.VARIABLE: str(base),
                      "EDDIS_RUN_DIR": str(run), "SMB_MEMORY": "4M", "SMB_HUGEPAGES": "off"})
    proc = subprocess.Popen([PYTHON, "-m", "eddis.launch.train", "--smb-server", "0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_until(lambda: any((run / rundir.SERVERS_DIR).glob("*.json")) or proc.poll() is not None, 60,
                   what="the smb-server to publish its address")
        assert proc.poll() is None, proc.communicate()
        assert left.exists()  # nothing is touched while the job runs
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    assert not left.exists(), err
    assert f"removed {left}, which a launch of this job left" in err
    assert all(p.exists() for p in others)
