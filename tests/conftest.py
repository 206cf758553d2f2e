"""Shared fixtures of the EDDIS test suite.

- ``run_mpi(n, argv, env=None, timeout=120, check=False)``: run ``argv`` as ``n``
  real Open MPI ranks (``mpirun --oversubscribe``, root allowed, OMP_NUM_THREADS=1,
  ``src/`` on PYTHONPATH, a private shared-memory directory removed afterwards).
  Returns a ``subprocess.CompletedProcess`` (text stdout/stderr). On timeout it
  kills the whole process group and fails the test with the output so far.
- ``slurm_cluster`` (session): the local two-node Slurm cluster
  (``scripts/eddis-dev-cluster up``; idempotent, left running for the next
  session). Skips only when slurm-wlm is not installed. ``.env`` is an
  environment for Slurm commands (SLURM_CONF set), ``.run(argv, ...)`` runs one.
- ``REPO``, ``SRC``, ``PYTHON`` and ``python_env()`` for subprocesses.
- Marker ``netns``: the test needs the dev cluster's netns mode (each node its own
  network host); skipped, with the reason, where the machine cannot run it, and a
  failure in CI (CI=true).

Example::

    @pytest.mark.timeout(120)
    def test_allreduce(run_mpi):
        proc = run_mpi(2, [PYTHON, "-c", CODE], check=True)
        assert "ok" in proc.stdout
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
PYTHON = sys.executable
DEV_CLUSTER = REPO / "scripts" / "eddis-dev-cluster"

if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

# Launch variables of an enclosing job would make mpirun or srun join it.
_INHERITED_LAUNCH_PREFIXES = ("SLURM_", "PMIX_", "PMI_", "OMPI_COMM_WORLD_", "EDDIS_RANK",
                              "EDDIS_SIZE", "EDDIS_LOCAL_", "EDDIS_LAUNCHED")


def python_env(extra=None, strip_launch=True):
    """os.environ with src/ first on PYTHONPATH, minus an enclosing job's launch variables."""
    env = {k: v for k, v in os.environ.items()
           if not (strip_launch and k.startswith(_INHERITED_LAUNCH_PREFIXES))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def run_process_group(argv, env, timeout, what=None, cwd=None):
    """Run argv in its own process group; on timeout kill the group and fail with the output."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd or str(REPO), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        pytest.fail(f"{what or ' '.join(map(str, argv))} timed out after {timeout}s and was killed.\n"
                    f"--- stdout ---\n{out}\n--- stderr ---\n{err}", pytrace=False)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _kill_group(proc):
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _fail_unless_ok(proc, what):
    if proc.returncode != 0:
        pytest.fail(f"{what} exited with {proc.returncode}.\n--- stdout ---\n{proc.stdout}\n"
                    f"--- stderr ---\n{proc.stderr}", pytrace=False)


@pytest.fixture
def run_mpi():
    """``run_mpi(n, argv, env=None, timeout=120, check=False) -> CompletedProcess``."""
    if shutil.which("mpirun") is None:
        pytest.fail("mpirun is not on PATH: apt-get install openmpi-bin libopenmpi-dev (make test does it)")
    shm_dirs = []

    def run(n, argv, env=None, timeout=120, check=False, mpirun_args=()):
        shm = tempfile.mkdtemp(prefix="eddis-test-ompi-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        shm_dirs.append(shm)
        full_env = python_env({
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMP_NUM_THREADS": "1",
            # Keeps this run's shared-memory segments in a directory we remove.
            "OMPI_MCA_btl_vader_backing_directory": shm,
            "OMPI_MCA_rmaps_base_oversubscribe": "1",
        })
        # Unbuffered, print() writes a line and its newline apart, and mpirun can put another rank's
        # line between them ('RESULT 1 {...}RESULT 0 {...}'); buffered, a flushed line is one write.
        full_env.pop("PYTHONUNBUFFERED", None)
        full_env.update(env or {})
        cmd = ["mpirun", "--oversubscribe", "-n", str(n), *mpirun_args, *map(str, argv)]
        try:
            proc = run_process_group(cmd, full_env, timeout, what=f"mpirun -n {n} {' '.join(map(str, argv))}")
        finally:
            # Right away, not at teardown: a pytest killed later leaves nothing here.
            shutil.rmtree(shm, ignore_errors=True)
        if check:
            _fail_unless_ok(proc, f"mpirun -n {n}")
        return proc

    yield run
    for d in shm_dirs:
        shutil.rmtree(d, ignore_errors=True)


class DevCluster:
    """The local Slurm cluster brought up by scripts/eddis-dev-cluster."""

    def __init__(self, state_dir):
        self.state_dir = Path(state_dir)
        self.conf = self.state_dir / "slurm.conf"
        self.env = python_env({"SLURM_CONF": str(self.conf)})

    def run(self, argv, timeout=120, check=True, env=None, cwd=None):
        full_env = dict(self.env, **(env or {}))
        proc = run_process_group([str(a) for a in argv], full_env, timeout, cwd=cwd)
        if check:
            _fail_unless_ok(proc, " ".join(map(str, argv)))
        return proc


_NETNS_SUPPORT = []


def netns_support():
    """(True, what it said) where the dev cluster's netns mode can run here, else (False, why)."""
    if not _NETNS_SUPPORT:
        try:
            proc = subprocess.run([str(DEV_CLUSTER), "netns-support"], capture_output=True, text=True,
                                  timeout=60)
            _NETNS_SUPPORT.append((proc.returncode == 0, (proc.stdout + proc.stderr).strip()))
        except (OSError, subprocess.TimeoutExpired) as exc:
            _NETNS_SUPPORT.append((False, f"scripts/eddis-dev-cluster netns-support failed: {exc}"))
    return _NETNS_SUPPORT[0]


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Mark tests by the fixtures they use, so a `-m` tier cannot miss one (make test-unit),
    and give every test an xdist group (`make test` runs pytest-xdist with --dist loadgroup):
    the tests that share one machine-wide resource run one after another on one worker (the
    dev cluster's two nodes, slurmctld ports and network namespaces: a job of one test would
    queue behind another's, and the link counters would count both; the few hugetlb pages
    `make test` reserves), and every other test runs on the worker of its file's other tests,
    because files share expensive launches through module-level caches (test_tf_equivalence
    runs its 2-rank and 4-rank workers once each), which a second worker would run again."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "run_mpi" in names:
            item.add_marker(pytest.mark.mpi)
        if any(f in names for f in CLUSTER_FIXTURES):
            item.add_marker(pytest.mark.slurm)
        item.add_marker(pytest.mark.xdist_group(shared_resource_group(item) or item.path.name))


CLUSTER_FIXTURES = ("slurm_cluster", "private_cluster")


def shared_resource_group(item):
    names = getattr(item, "fixturenames", ())
    if (any(f in names for f in CLUSTER_FIXTURES) or item.get_closest_marker("slurm") is not None
            or item.get_closest_marker("netns") is not None):
        return "dev-cluster"
    if item.get_closest_marker("hugepages") is not None:
        return "hugepages"
    return None   # the file's group


def pytest_runtest_setup(item):
    """Tests marked netns need the dev cluster's netns mode: a listed skip where the machine
    cannot run it, a failure in CI (CI=true), whose machines must."""
    if item.get_closest_marker("netns") is None:
        return
    ok, why = netns_support()
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the dev cluster in netns mode, and this machine cannot: {why}", pytrace=False)
    pytest.skip(f"dev cluster netns mode not possible here ({why})")


def dev_cluster_dir():
    return os.environ.get("EDDIS_DEV_CLUSTER_DIR") or "/tmp/eddis-dev-cluster"


@pytest.fixture(scope="session")
def slurm_cluster():
    """The running local cluster (n1: a100, n2: v100); brought up if it is not."""
    missing = [p for p in ("slurmctld", "slurmd", "munged", "sbatch") if shutil.which(p) is None
               and not os.path.exists(f"/usr/sbin/{p}")]
    if missing:
        why = (f"slurm-wlm/munge not installed (missing {', '.join(missing)}): "
               "apt-get install slurm-wlm munge libpmix2, or run `make test`")
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI installs Slurm, and this machine lacks it: {why}", pytrace=False)
        pytest.skip(why)
    cluster = DevCluster(dev_cluster_dir())
    if _nodes_idle(cluster):  # already up (make test starts it): nothing to do
        return cluster
    proc = subprocess.run([str(DEV_CLUSTER), "up"], capture_output=True, text=True, timeout=180,
                          env=python_env())
    if proc.returncode != 0:
        pytest.fail(f"scripts/eddis-dev-cluster up failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}",
                    pytrace=False)
    return cluster



@pytest.fixture(autouse=True)
def _cancel_jobs_left_on_the_dev_cluster(request):
    """A job a failed test leaves running would hold n1/n2 and stall every later Slurm test."""
    yield
    if "slurm_cluster" not in request.fixturenames:
        return
    cluster = request.getfixturevalue("slurm_cluster")
    left = subprocess.run(["squeue", "-h", "-o", "%A"], env=cluster.env, capture_output=True, text=True,
                          timeout=30)
    jobs = sorted(set(left.stdout.split()))
    if jobs:
        subprocess.run(["scancel", *jobs], env=cluster.env, capture_output=True, timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and subprocess.run(
                ["squeue", "-h", "-o", "%A"], env=cluster.env, capture_output=True, text=True,
                timeout=30).stdout.strip():
            time.sleep(0.5)

def _nodes_idle(cluster):
    if not cluster.conf.exists():
        return False
    try:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=cluster.env, capture_output=True,
                              text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return False
    states = dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)
    # "idle*" (trailing star) is a node that stopped responding.
    return proc.returncode == 0 and all(
        states.get(n, "").startswith(("idle", "mix", "alloc")) and not states[n].endswith("*") for n in ("n1", "n2"))
