"""eddis doctor: real UCX, libibverbs, MPI, Slurm and torch on this machine."""
import json
import os
import re
import shutil
import subprocess

import pytest

from conftest import PYTHON, python_env
from eddis import doctor


def doctor_json(prelude="", env=None, timeout=120):
    """Run `eddis doctor --json` in a fresh interpreter; prelude may hide modules first."""
    code = f"{prelude}\nimport sys\nfrom eddis.cli import main\nsys.exit(main(['doctor', '--json']))"
    proc = subprocess.run([PYTHON, "-c", code], env=env or python_env(), capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else None, proc


@pytest.mark.timeout(150)
def test_doctor_json_reports_this_machine():
    rc, report, proc = doctor_json()
    assert rc == 0, proc.stdout + proc.stderr
    checks = report["checks"]
    assert report["ok"] is True
    assert set(checks) == {"eddis", "ucx", "infiniband", "smb_transport", "mpi", "slurm", "gpus", "frameworks",
                           "hugepages"}

    ucx = checks["ucx"]["data"]
    assert re.match(r"\d+\.\d+", ucx["version"])
    assert "tcp" in ucx["transports"]
    assert {"posix", "sysv"} & set(ucx["transports"])
    # the libucp this process loaded (one per process: MPI's, if it came first), and the fence
    # SMB asks of it: only-ordering where UCX has the choice (1.22's default waits for completion)
    assert "/libucp.so" in ucx["library"] and os.path.exists(ucx["library"])
    assert ucx["fence_mode"] in (None, "ep_based")

    ib = checks["infiniband"]["data"]
    if not ib["devices"]:
        assert checks["infiniband"]["status"] == "warn"
        assert ib["finding"].startswith("no HCA found")

    mpi = checks["mpi"]["data"]
    assert "MPI" in mpi["library"] and "\0" not in mpi["library"]
    assert re.match(r"\d\.\d", mpi["standard"])

    pages = checks["hugepages"]["data"]
    meminfo = dict(re.findall(r"^(\w+):\s+(\d+)", open("/proc/meminfo").read(), re.M))
    assert pages["hugetlb_page_size"] == int(meminfo.get("Hugepagesize", 0)) * 1024
    assert pages["hugetlb_total"] == int(meminfo.get("HugePages_Total", 0))
    assert pages["smb_hugepages"] == "off" and pages["smb_arena_pages"] == "off"
    assert checks["hugepages"]["status"] == "ok"

    import torch

    assert checks["frameworks"]["data"]["torch"] == torch.__version__
    if shutil.which("sbatch"):
        assert re.match(r"\d+\.\d+\.\d+", checks["slurm"]["data"]["version"])


def test_a_fence_mode_the_user_chose_is_kept():
    code = "from eddis.smb import _core; print(_core.ucx_fence_mode())"
    proc = subprocess.run([PYTHON, "-c", code], env=python_env({"UCX_FENCE_MODE": "auto"}), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() in ("None", "auto"), proc.stdout + proc.stderr


def test_loaded_library_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f0000-7f1000 r-xp 00000000 08:01 42   /opt/ucx/lib/libucp.so.0.0.0\n"
                    "7f2000-7f3000 r--p 00000000 00:00 0    [heap]\n")
    assert doctor.loaded_library("libucp.so", maps) == "/opt/ucx/lib/libucp.so.0.0.0"
    assert doctor.loaded_library("libuct.so", maps) is None


@pytest.mark.timeout(150)
def test_doctor_names_the_smb_transport_a_job_gets_and_calls_tcp_rma_unsafe():
    rc, report, proc = doctor_json(env=python_env({"SMB_TRANSPORT": "auto"}))
    assert rc == 0, proc.stdout + proc.stderr
    check = report["checks"]["smb_transport"]
    data = check["data"]
    assert data["requested"] == "auto" and "tcp" not in data["ucx_tls"].split(",")
    if not data["node"]["ports"]:   # no HCA here: auto gives socket, and says why
        assert check["status"] == "ok" and data["transport"] == "socket"
        assert "gets socket (auto: node " in check["summary"] and "no HCA found" in check["summary"]
    assert data["gpu_direct"] == ("cuda" in data["ucx_memory_types"])
    rc, report, proc = doctor_json(env=python_env({"SMB_TRANSPORT": "rdma", "SMB_UCX_ALLOW_TCP": "1"}))
    check = report["checks"]["smb_transport"]
    assert check["status"] == "warn" and "UNSAFE" in check["summary"] and "tests only" in check["fix"]
    assert check["data"]["transport"] == "rdma" and "tcp" in check["data"]["ucx_tls"].split(",")
    rc, report, proc = doctor_json(env=python_env({"SMB_TRANSPORT": "ucx"}))
    assert rc == 1 and report["checks"]["smb_transport"]["status"] == "fail"


@pytest.mark.timeout(150)
def test_doctor_text_report_and_exit_status():
    proc = subprocess.run([PYTHON, "-m", "eddis.cli", "doctor"], env=python_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("ucx", "infiniband", "mpi", "slurm", "gpus", "frameworks"):
        assert re.search(rf"^\[\s*(OK|WARN)\] {name}\b", proc.stdout, re.M), proc.stdout
    assert "EDDIS can run here." in proc.stdout


@pytest.mark.timeout(150)
def test_missing_ucx_fails_with_package_names(tmp_path):
    # No SMB core and no ucx_info on PATH: UCX is required, so doctor exits 1.
    env = python_env({"PATH": str(tmp_path)})
    rc, report, proc = doctor_json("import sys; sys.modules['eddis.smb._core'] = None", env=env)
    assert rc == 1, proc.stdout + proc.stderr
    assert report["ok"] is False
    ucx = report["checks"]["ucx"]
    assert ucx["status"] == "fail"
    assert "libucx-dev" in ucx["fix"] and "ucx-devel" in ucx["fix"]


@pytest.mark.timeout(150)
def test_ucx_info_fallback_when_smb_core_is_absent():
    if shutil.which("ucx_info") is None:
        pytest.fail("ucx_info missing: apt-get install ucx-utils")
    rc, report, proc = doctor_json("import sys; sys.modules['eddis.smb._core'] = None")
    ucx = report["checks"]["ucx"]["data"]
    assert ucx["source"] == "ucx_info"
    assert "tcp" in ucx["transports"]
    assert report["checks"]["eddis"]["status"] == "fail"  # the SMB core is required
    assert rc == 1


@pytest.mark.timeout(150)
def test_unbuilt_verbs_extension_is_a_warning_not_a_crash():
    rc, report, proc = doctor_json("import sys; sys.modules['eddis._verbs'] = None")
    assert rc == 0, proc.stdout + proc.stderr
    assert report["checks"]["infiniband"]["status"] == "warn"
    assert "not built" in report["checks"]["infiniband"]["summary"]
    assert report["checks"]["eddis"]["data"]["extensions"]["eddis._verbs"] is False


def test_ucx_info_parsers_on_real_output():
    if shutil.which("ucx_info") is None:
        pytest.fail("ucx_info missing: apt-get install ucx-utils")
    version = subprocess.run(["ucx_info", "-v"], capture_output=True, text=True, timeout=30).stdout
    devices = subprocess.run(["ucx_info", "-d"], capture_output=True, text=True, timeout=60).stdout
    assert re.match(r"\d+\.\d+\.\d+", doctor.parse_ucx_info_version(version))
    transports = doctor.parse_ucx_info_devices(devices)
    assert "lo" in transports["tcp"]
    assert doctor.parse_ucx_info_version("garbage") is None
    # UCX 1.22 names the library's version and the headers' apart: the library's is the one loaded
    assert doctor.parse_ucx_info_version("# Library version: 1.22.0\n# Library path: /x/libucs.so.0\n"
                                         "# API headers version: 1.21.0\n") == "1.22.0"
    assert doctor.parse_ucx_info_devices("") == {}


def test_a_crashing_check_is_reported_not_raised():
    def check_broken():
        raise OSError("device on fire")

    results = doctor.run_checks([check_broken])
    assert results[0].name == "broken" and results[0].status == doctor.FAIL
    assert "device on fire" in results[0].summary
    assert doctor.report_json(results)["ok"] is False
    assert "required parts missing: broken" in doctor.report_text(results)


@pytest.mark.timeout(180)
def test_doctor_inside_an_allocation(slurm_cluster):
    proc = slurm_cluster.run(["srun", "-p", "v100", "-n", "1", "--gres=gpu:v100:1", PYTHON, "-m", "eddis.cli",
                              "doctor", "--json"], timeout=150)
    report = json.loads(proc.stdout)
    slurm = report["checks"]["slurm"]
    assert slurm["status"] == "ok"
    assert slurm["data"]["inside_allocation"] is True
    assert slurm["data"]["allocation"]["node"] == "n2"
    assert report["checks"]["gpus"]["data"]["cuda_visible_devices"] == "0"


@pytest.mark.timeout(150)
def test_doctor_warns_when_the_asked_huge_pages_are_missing():
    # more hugetlb pages than any test machine holds: a warning naming the sysctl, not a failure
    rc, report, proc = doctor_json(env=python_env({"SMB_HUGEPAGES": "hugetlb", "SMB_MEMORY": "64T"}))
    assert rc == 0, proc.stdout + proc.stderr
    pages = report["checks"]["hugepages"]
    assert pages["status"] == "warn"
    assert "vm.nr_hugepages=" in pages["fix"]
