"""bench/job_cpu.py: a benchmark job's CPU seconds by role, read from /proc of real processes."""
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import job_cpu  # noqa: E402

BUSY = """
import sys, time
end = time.process_time() + float(sys.argv[1])
while time.process_time() < end:
    pass
print("done", flush=True)
time.sleep(30)
"""


@pytest.mark.parametrize("comm, cmdline, role", [
    ("smb-server", ["/venv/bin/python", "/venv/bin/smb-server", "--port", "0"], "servers"),
    ("python", ["/venv/bin/python", "/venv/bin/smb-server"], "servers"),
    ("python", ["/venv/bin/python", "-c", "import sys; from eddis.smb.server import main; sys.exit(main())",
                "--run-dir", "/tmp/run", "--index", "0"], "servers"),
    ("eddis-train", ["/venv/bin/python", "/venv/bin/eddis-train", "--smb-server", "0"], "launch"),
    ("python", ["/venv/bin/python", "bench/cluster.py", "--worker", "--model", "comm"], "ranks"),
    ("srun", ["srun", "eddis-train", "--job"], "launch"),
])
def test_roles(comm, cmdline, role):
    assert job_cpu.role_of(comm, cmdline) == role


def test_cpu_seconds_reads_past_a_name_with_spaces_and_parentheses():
    fields = ["S"] + ["0"] * 10 + ["250", "150"] + ["0"] * 30
    stat = "42 (a (b) c) " + " ".join(fields)
    assert job_cpu.cpu_seconds(stat) == pytest.approx(400 / job_cpu.CLOCK_TICKS)


def test_a_job_s_processes_are_counted_by_role_and_no_other(tmp_path):
    run_dir = tmp_path / "run"
    env = {"EDDIS_RUN_DIR": str(run_dir), "PATH": "/usr/bin:/bin"}
    ours = subprocess.Popen([sys.executable, "-c", BUSY, "0.4", "--worker"], env=env,
                            stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen([sys.executable, "-c", BUSY, "0.4", "--worker"],
                             env=dict(env, EDDIS_RUN_DIR=str(tmp_path / "another")),
                             stdout=subprocess.PIPE, text=True)
    try:
        before = job_cpu.sample(str(run_dir))
        assert ours.stdout.readline().strip() == "done"
        assert other.stdout.readline().strip() == "done"
        after = job_cpu.sample(str(run_dir))
        used = job_cpu.difference(before, after)
        # one process of the job spun 0.4 s; the other job's 0.4 s is not ours
        assert 0.3 <= used["ranks"] < 0.75, used
        assert used["servers"] == 0 and used["launch"] < 0.05, used
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait(timeout=10)
