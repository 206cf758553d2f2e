"""The build: switch handling and library detection of setup.py, and the two
foundation extensions (eddis._verbs, eddis._mpi) running for real."""
import importlib.util
import os
import re
import subprocess

import numpy as np
import pytest

from conftest import PYTHON, REPO, python_env


def load_setup_module():
    """setup.py's functions, without running setup() (it is guarded by __main__)."""
    spec = importlib.util.spec_from_file_location("eddis_setup", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def build(monkeypatch):
    for key in ("UCX", "VERBS", "MPI", "CUDA"):
        monkeypatch.delenv("EDDIS_WITH_" + key, raising=False)
        monkeypatch.delenv("EDDIS_WITHOUT_" + key, raising=False)
    return load_setup_module()


@pytest.mark.timeout(60)
def test_missing_header_is_reported_with_both_package_names(build):
    dep = build.Dependency("VERBS", "libibverbs", ["infiniband/no_such_verbs.h"], ["ibverbs"],
                           debian="libibverbs-dev", rocky="rdma-core-devel")
    assert build.detect_c_library(dep) is False
    assert "infiniband/no_such_verbs.h" in dep.reason
    message = dep.missing_message()
    assert "apt-get install libibverbs-dev" in message
    assert "dnf install rdma-core-devel" in message
    assert "EDDIS_WITHOUT_VERBS=1" in message


@pytest.mark.timeout(60)
def test_missing_library_is_reported(build):
    dep = build.Dependency("UCX", "UCX", ["stdio.h"], ["eddis_no_such_library"],
                           debian="libucx-dev", rocky="ucx-devel")
    assert build.detect_c_library(dep) is False
    assert "-leddis_no_such_library" in dep.reason


@pytest.mark.timeout(60)
def test_installed_libraries_are_detected(build):
    build.configure()
    for key in ("UCX", "VERBS", "MPI"):
        dep = build.DEPENDENCIES[key]
        assert dep.state == "auto"
        assert dep.found, f"{key} not found here: {dep.reason}"


@pytest.mark.timeout(60)
def test_ucx_home_is_built_against_with_an_rpath(build, monkeypatch, tmp_path):
    """EDDIS_UCX_HOME: a UCX prefix of its own (here the system's UCX, linked into one)."""
    system_lib = os.path.dirname(os.path.realpath(subprocess.run(
        ["gcc", "-print-file-name=libucp.so"], capture_output=True, text=True).stdout.strip()))
    (tmp_path / "include").mkdir()
    (tmp_path / "lib").mkdir()
    for part in ("ucp", "ucs", "uct", "ucm"):
        if os.path.isdir(f"/usr/include/{part}"):
            (tmp_path / "include" / part).symlink_to(f"/usr/include/{part}")
    for library in ("libucp.so", "libucs.so"):
        (tmp_path / "lib" / library).symlink_to(os.path.join(system_lib, library))
    monkeypatch.setenv("EDDIS_UCX_HOME", str(tmp_path))
    build.configure()
    ucx = build.DEPENDENCIES["UCX"]
    assert ucx.found, ucx.reason
    assert ucx.include_dirs == [str(tmp_path / "include")] and ucx.library_dirs == [str(tmp_path / "lib")]
    assert ucx.extra_link_args == [f"-Wl,-rpath,{tmp_path / 'lib'}"]
    assert re.match(rf"1\.\d+ at {tmp_path}, with RPATH", ucx.version), ucx.version


@pytest.mark.timeout(60)
def test_a_multiarch_ucx_home_is_found(build, monkeypatch):
    """A Spack external's prefix on Debian: /usr, its libraries in lib/x86_64-linux-gnu."""
    monkeypatch.setenv("EDDIS_UCX_HOME", "/usr")
    build.configure()
    ucx = build.DEPENDENCIES["UCX"]
    system_lib = os.path.dirname(os.path.realpath(subprocess.run(
        ["gcc", "-print-file-name=libucp.so"], capture_output=True, text=True).stdout.strip()))
    assert ucx.found and ucx.library_dirs == [system_lib], (ucx.reason, ucx.library_dirs)
    assert re.match(r"1\.\d+\.\d+ at /usr, with RPATH", ucx.version), ucx.version   # from its ucx.pc


@pytest.mark.timeout(60)
def test_a_ucx_home_without_ucx_stops_the_build(build, monkeypatch, tmp_path):
    monkeypatch.setenv("EDDIS_UCX_HOME", str(tmp_path))
    with pytest.raises(SystemExit, match=rf"EDDIS_UCX_HOME={tmp_path} is not a UCX installation .*unset it"):
        build.configure()


@pytest.mark.timeout(60)
def test_without_switch_skips_the_library(build, monkeypatch):
    monkeypatch.setenv("EDDIS_WITHOUT_VERBS", "1")
    build.configure()
    verbs = build.DEPENDENCIES["VERBS"]
    assert verbs.state == "skipped" and not verbs.found


@pytest.mark.timeout(60)
def test_with_and_without_together_is_refused(build, monkeypatch):
    monkeypatch.setenv("EDDIS_WITH_MPI", "1")
    monkeypatch.setenv("EDDIS_WITHOUT_MPI", "1")
    with pytest.raises(SystemExit, match="both set"):
        build.configure()


@pytest.mark.parametrize("word", ["0", "false", "False", "no", "off", "OFF", " off ", ""])
def test_a_false_with_switch_means_not_required(build, monkeypatch, word):
    monkeypatch.setenv("EDDIS_WITH_UCX", word)
    assert build.DEPENDENCIES["UCX"].switch_state() == "auto"


@pytest.mark.parametrize("word", ["1", "true", "yes", "on", "ON"])
def test_a_true_with_switch_means_required(build, monkeypatch, word):
    monkeypatch.setenv("EDDIS_WITH_UCX", word)
    assert build.DEPENDENCIES["UCX"].switch_state() == "required"


def test_a_false_without_switch_does_not_skip(build, monkeypatch):
    monkeypatch.setenv("EDDIS_WITHOUT_VERBS", "false")
    assert build.DEPENDENCIES["VERBS"].switch_state() == "auto"


def test_an_unreadable_switch_stops_the_build_naming_it(build, monkeypatch):
    monkeypatch.setenv("EDDIS_WITH_UCX", "maybe")
    with pytest.raises(SystemExit) as stop:
        build.DEPENDENCIES["UCX"].switch_state()
    message = str(stop.value)
    assert "EDDIS_WITH_UCX='maybe'" in message
    assert "1/0, true/false, yes/no, on/off" in message


def test_build_jobs_default_to_the_cpus_and_a_bad_count_stops_the_build(build):
    assert build.build_jobs({}) == build.build_jobs({"EDDIS_BUILD_JOBS": "0"}) == len(os.sched_getaffinity(0))
    assert build.build_jobs({"EDDIS_BUILD_JOBS": " 3 "}) == 3
    from eddis import settings

    assert settings.REGISTRY["EDDIS_BUILD_JOBS"].default == 0   # the registry documents the same
    for word in ("-1", "two", "1.5"):
        with pytest.raises(SystemExit) as stop:
            build.build_jobs({"EDDIS_BUILD_JOBS": word})
        assert f"EDDIS_BUILD_JOBS={word!r} is not a whole number" in str(stop.value)


@pytest.mark.parametrize("word", ["1", "0", "true", "false", "yes", "no", "on", "off", "TRUE", " no ",
                                  "", "maybe", "2"])
def test_setup_py_and_the_settings_registry_read_switches_alike(build, word):
    from eddis import settings
    from eddis.errors import ConfigError

    try:
        registry = settings.REGISTRY["EDDIS_WITH_UCX"].parse(word)
    except ConfigError:
        with pytest.raises(SystemExit):
            build.switch_on("EDDIS_WITH_UCX", {"EDDIS_WITH_UCX": word})
    else:
        assert build.switch_on("EDDIS_WITH_UCX", {"EDDIS_WITH_UCX": word}) is registry


def test_setup_py_loads_the_one_boolean_parser_of_the_package(build):
    from eddis import _boolenv

    assert build.boolenv.__file__ == _boolenv.__file__
    assert build.boolenv.ACCEPTED == _boolenv.ACCEPTED


@pytest.mark.timeout(120)
def test_required_verbs_without_headers_stops_the_real_build():
    # -nostdinc hides every system header from the compiler, as on a machine
    # without libibverbs-dev; detection honours CFLAGS exactly like the build.
    env = python_env({"EDDIS_WITH_VERBS": "1", "CFLAGS": "-nostdinc"})
    proc = subprocess.run([PYTHON, "setup.py", "build_ext", "--inplace"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode != 0
    assert "EDDIS_WITH_VERBS=1" in proc.stderr
    assert "libibverbs-dev" in proc.stderr and "rdma-core-devel" in proc.stderr


@pytest.mark.timeout(60)
def test_verbs_query_reports_no_hca_as_a_finding():
    from eddis import _verbs

    result = _verbs.query()
    if result["devices"]:
        pytest.skip("this host has an HCA; the no-HCA finding cannot be observed")
    assert result["finding"].startswith("no HCA found")


@pytest.mark.timeout(60)
def test_verbs_devices_have_ports_with_state_and_rate():
    from eddis import _verbs

    result = _verbs.query()
    if not result["devices"]:
        pytest.skip(f"no InfiniBand HCA: {result['finding']}")
    for dev in result["devices"]:
        assert dev["name"]
        for port in dev["ports"]:
            assert port["state"] and port["link_layer"]


@pytest.mark.parametrize("width, speed, gbps", [(2, 32, 100.0), (2, 64, 200.0), (1, 1, 2.5),
                                               (8, 16, 168.0), (2, 0, None), (0, 32, None)])
def test_link_rate_from_width_and_speed_codes(width, speed, gbps):
    from eddis import _verbs

    assert _verbs.link_rate_gbps(width, speed) == gbps


ALLREDUCE = """
import os
import numpy as np
from mpi4py import MPI
from eddis import _mpi
comm = MPI.COMM_WORLD
r, n = comm.Get_rank(), comm.Get_size()
for dtype in (np.float32, np.float64):
    a = np.arange(1000, dtype=dtype) * (r + 1)
    _mpi.allreduce_sum_inplace(comm, a)
    expect = np.arange(1000, dtype=dtype) * (n * (n + 1) / 2)
    assert np.array_equal(a, expect), (dtype, a[:4])
sub = comm.Split(r % 2, r)
b = np.ones(7, dtype=np.float32)
_mpi.allreduce_sum_inplace(sub, b)
assert b[0] == sub.Get_size()
try:
    _mpi.allreduce_sum_inplace(comm, np.ones(3, dtype=np.int64))
except ValueError as exc:
    assert "float32" in str(exc)
else:
    raise AssertionError("int64 accepted")
# one write of one line: print() makes a write of each piece when Python runs unbuffered
os.write(1, f"rank {r} ok {_mpi.library_version().split(',')[0]}\\n".encode())
"""


@pytest.mark.timeout(120)
def test_mpi_inplace_allreduce_across_ranks(run_mpi):
    proc = run_mpi(3, [PYTHON, "-c", ALLREDUCE], check=True)
    # the ranks share one pipe: count the reports, in whatever order they come
    assert sorted(re.findall(r"rank (\d) ok", proc.stdout)) == ["0", "1", "2"], proc.stdout
    assert "MPI" in proc.stdout


@pytest.mark.timeout(60)
def test_mpi_allreduce_rejects_read_only_buffer():
    from mpi4py import MPI
    from eddis import _mpi

    a = np.ones(4, dtype=np.float32)
    a.setflags(write=False)
    with pytest.raises(ValueError, match="writable"):
        _mpi.allreduce_sum_inplace(MPI.COMM_WORLD, a)


@pytest.mark.timeout(120)
def test_run_mpi_timeout_kills_every_rank_and_fails_with_output(run_mpi):
    token = f"eddis-hang-{os.getpid()}"
    hang = f"import sys, time; print('hanging', flush=True); time.sleep(600)  # {token}"
    with pytest.raises(pytest.fail.Exception, match="timed out after 6s"):
        run_mpi(2, [PYTHON, "-c", hang], timeout=6)

    def leftovers():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(pid)
            except OSError:
                pass
        return found

    assert leftovers() == []
