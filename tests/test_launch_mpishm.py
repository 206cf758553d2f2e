"""The per-launch Open MPI segment folders: found by job and node, removed by the job's smb-server."""

import os

from eddis.launch import mpishm
from eddis.smb.testing import LocalServers


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


def test_smb_server_removes_the_jobs_folders_on_its_node_when_it_stops(tmp_path):
    base = tmp_path / "shm"
    base.mkdir()
    # what a supervisor killed before its cleanup leaves: the folder and a rank's segment in it
    left = make_folder(base, "eddis-41.3-nodeA", ["vader_segment.nodeA.5e.1"])
    others = [make_folder(base, "eddis-41.3-nodeB", ["vader_segment.nodeB.5e.0"]),
              make_folder(base, "eddis-410.3-nodeA", ["vader_segment.nodeA.77.0"])]
    env = {"SLURM_JOB_ID": "41", "SLURMD_NODENAME": "nodeA", mpishm.VARIABLE: str(base)}
    servers = LocalServers(1, memory="4M", env=env).start()
    assert left.exists()  # nothing is touched while the job runs
    errors = servers.stop()
    assert servers.hung == [], errors
    assert not left.exists(), errors
    assert all(p.exists() for p in others)
