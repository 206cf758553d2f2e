"""The release path: the sdist ``python -m build --sdist`` makes, installed by pip
into a fresh virtual environment, and the site module loaded from that prefix.

What "fresh venv" means here, and why: the venv is new (``python -m venv
--without-pip`` under tmp_path, no eddis in it), and pip installs the sdist with
``--no-build-isolation --no-index --no-deps``, so the extensions are compiled from
the sdist's own sources against the system UCX and MPI, offline. Its dependencies
(numpy, mpi4py built for the system MPI, Cython, setuptools, pip, h5py, ...) are not
downloaded again: a ``.pth`` file makes the project venv's packages visible through
a directory of symlinks that leaves out every trace of the project venv's own
(editable) eddis, so only the copy installed from the sdist can be imported. That
is what ``pip install eddis-0.1.0.tar.gz`` does on a Debian 12 machine whose venv
already holds the requirements (docs/install.md "A release: the sdist"), without
needing the package index or minutes of rebuilding numpy and mpi4py.

The sdist is made by calling setuptools' PEP 517 hook ``build_sdist`` in a
subprocess, which is what ``python -m build --sdist --no-isolation`` does (the
``build`` front end only adds the subprocess and the requirements check); the
project venv need not carry ``build`` for this test.
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile

import pytest

from conftest import REPO
from test_modulefile import LUA, login_shell, needs_lmod, package_version

# The first test to run pays for the module fixture: about a minute of building on 2 cores.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXTENSIONS = ("eddis._verbs", "eddis._mpi", "eddis.smb._vecops", "eddis.smb._core")


def clean_env(**extra):
    """The caller's environment without PYTHONPATH (the tests run with src/ on it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(extra)
    return env


def run(argv, cwd, timeout, **extra_env):
    proc = subprocess.run(argv, cwd=cwd, env=clean_env(**extra_env), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def dependency_farm(target, leave_out=()):
    """Symlinks to the project venv's site-packages, minus its own eddis (see the docstring) and
    the distributions named in ``leave_out``."""
    site = sysconfig.get_paths()["purelib"]
    target.mkdir()
    for name in os.listdir(site):
        if name == "eddis" or name.startswith(("eddis-", "__editable__")) or name.endswith(".pth"):
            continue
        if any(name == d or name.startswith(d + "-") for d in leave_out):
            continue
        os.symlink(os.path.join(site, name), target / name)
    return target


def fresh_venv(root, leave_out=()):
    """A new venv under root that sees the project venv's packages (less ``leave_out``); its python."""
    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root, timeout=120)
    py = venv / "bin" / "python"
    venv_site = run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=root, timeout=60).stdout.strip()
    (venv / venv_site / "project-deps.pth").write_text(str(dependency_farm(root / "deps", leave_out)) + "\n")
    return py


def pip_install(py, sdist, cwd, check=True, **env):
    # -v: pip shows the build's stderr, where setup.py prints its configuration summary.
    argv = [str(py), "-m", "pip", "install", "-v", "--no-build-isolation", "--no-index", "--no-deps", str(sdist)]
    if check:
        return run(argv, cwd=cwd, timeout=900, PIP_DISABLE_PIP_VERSION_CHECK="1", **env)
    return subprocess.run(argv, cwd=cwd, env=clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1", **env),
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """The sdist, built through setuptools' PEP 517 hook."""
    dist = tmp_path_factory.mktemp("dist")
    proc = run([sys.executable, "-c", "import sys; from setuptools import build_meta as b;"
                " print(b.build_sdist(sys.argv[1]))", str(dist)], cwd=REPO, timeout=300)
    return dist / proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def installed(sdist, tmp_path_factory):
    """sdist installed into a fresh venv; returns (venv, sdist, pip output)."""
    root = tmp_path_factory.mktemp("sdist")
    py = fresh_venv(root)
    pip = pip_install(py, sdist, root, EDDIS_WITH_UCX="1", EDDIS_WITH_MPI="1")
    return root / "venv", sdist, pip.stdout + pip.stderr


def test_sdist_carries_the_sources_modulefiles_and_job_script(installed):
    _, sdist, _ = installed
    version = package_version()
    assert sdist.name == f"eddis-{version}.tar.gz"
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    tracked = subprocess.run(["git", "ls-files", "cython", "modulefiles"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    missing = sorted(set(tracked) - names)
    assert not missing, f"the sdist lacks {missing}: add them to MANIFEST.in"
    for path in ("README.md", "scripts/eddis_job.sh", "docs/install.md", "setup.py", "pyproject.toml"):
        assert path in names, f"the sdist lacks {path}: add it to MANIFEST.in"
    generated = sorted(n for n in names if n.startswith("cython/") and n.endswith(".c"))
    assert not generated, f"the sdist carries Cython output {generated}: MANIFEST.in should exclude cython/*.c"


def test_sdist_installs_into_a_fresh_venv_and_doctor_passes(installed, tmp_path):
    venv, _, pip_output = installed
    # The build summary, with the required UCX and MPI found.
    assert "EDDIS build configuration" in pip_output, pip_output[-4000:]
    assert "UCX (UCP API)              [required] yes" in pip_output
    assert "MPI (mpicc and mpi4py)     [required] yes" in pip_output
    assert "eddis.smb._core" in pip_output and "eddis._mpi" in pip_output
    # From outside the checkout, the installed copy is the one imported.
    proc = run([str(venv / "bin" / "python"), "-c",
                "import eddis, eddis.smb._core, eddis._mpi; print(eddis.__file__)"], cwd=tmp_path, timeout=120)
    location = proc.stdout.strip()
    assert location.startswith(str(venv) + os.sep), f"eddis imported from {location}, not from {venv}"
    proc = run([str(venv / "bin" / "eddis"), "doctor", "--json"], cwd=tmp_path, timeout=300)
    report = json.loads(proc.stdout)
    data = report["checks"]["eddis"]["data"]
    assert data["location"].startswith(str(venv) + os.sep)
    assert data["extensions"] == {name: True for name in EXTENSIONS}
    assert report["checks"]["ucx"]["status"] == "ok" and report["checks"]["mpi"]["status"] == "ok"
    assert report["ok"], proc.stdout


@needs_lmod
def test_module_loads_from_the_installed_prefix(installed, tmp_path):
    """docs/install.md "Site installation of the module", with the sdist's venv as the prefix."""
    prefix, sdist, _ = installed
    with tarfile.open(sdist) as tar:  # the modulefile the release carries, not the checkout's
        lua = tar.extractfile(f"{sdist.name[:-len('.tar.gz')]}/modulefiles/eddis/{LUA.name}").read().decode()
    site = tmp_path / "modules" / "eddis"
    site.mkdir(parents=True)
    (site / LUA.name).write_text(lua.replace("@EDDIS_PREFIX@", str(prefix)))
    proc = login_shell(f"""
        cd {tmp_path}
        module use {tmp_path}/modules
        module load eddis || exit 9
        echo "EDDIS_HOME=$EDDIS_HOME"
        echo "EDDIS_BIN=$(command -v eddis)"
        eddis doctor --json > doctor.json; echo "DOCTOR_RC=$?"
    """, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"EDDIS_HOME={prefix}\n" in proc.stdout
    assert f"EDDIS_BIN={prefix}/bin/eddis\n" in proc.stdout
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert "DOCTOR_RC=0" in proc.stdout, json.dumps(report, indent=1)[-4000:]
    assert report["checks"]["eddis"]["data"]["location"].startswith(str(prefix) + os.sep)


def test_a_venv_without_mpi4py_stops_the_build_naming_it(sdist, tmp_path):
    """Where the system has MPI, an install that cannot build eddis._mpi stops and says why, instead
    of a package without it that only `eddis doctor` notices (issue 44)."""
    mpicc = shutil.which("mpicc")
    assert mpicc, "mpicc is not on PATH: apt-get install libopenmpi-dev openmpi-bin (make test does it)"
    py = fresh_venv(tmp_path, leave_out=("mpi4py",))
    assert subprocess.run([str(py), "-c", "import mpi4py"], env=clean_env(), capture_output=True,
                          timeout=60).returncode != 0, "the venv should not see mpi4py"
    proc = pip_install(py, sdist, tmp_path, check=False)  # auto-detection: no EDDIS_WITH_/WITHOUT_MPI
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert (f"mpi4py is not importable by the Python that builds EDDIS ({py}), while this system has MPI "
            f"({mpicc})") in output, output[-4000:]
    assert f"MPICC={mpicc} {py} -m pip install --no-binary=mpi4py mpi4py" in output
    assert "or set EDDIS_WITHOUT_MPI=1 to build without it." in output
    assert subprocess.run([str(py), "-c", "import eddis"], env=clean_env(), cwd=tmp_path, capture_output=True,
                          timeout=60).returncode != 0, "a failed build installed eddis"
    # the way out the message names: the sdist's setup.py configures without MPI
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "src")
    (unpacked,) = (tmp_path / "src").iterdir()
    proc = run([str(py), "-c", "import setup; setup.configure(); setup.summary([])"], cwd=unpacked, timeout=120,
               EDDIS_WITHOUT_MPI="1")
    assert "MPI (mpicc and mpi4py)     [ skipped] skipped (EDDIS_WITHOUT_MPI=1)" in proc.stderr, proc.stderr
