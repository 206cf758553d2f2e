"""modulefiles/: the Lmod modulefile and its Tcl twin, loaded by the real Lmod in a login shell."""
import configparser
import json
import os
import re
import shutil
import subprocess

import pytest

from conftest import REPO

LUA = REPO / "modulefiles" / "eddis" / "0.1.0.lua"
TCL = REPO / "modulefiles" / "tcl" / "eddis" / "0.1.0"
HAVE_LMOD = os.path.exists("/etc/profile.d/lmod.sh") or os.path.isdir("/usr/share/lmod")
needs_lmod = pytest.mark.skipif(not HAVE_LMOD, reason="Lmod not installed (apt-get install lmod)")


def login_shell(script, timeout=120):
    """bash -lc in a clean environment, as a user's fresh login would be."""
    env = {"HOME": os.environ.get("HOME", "/root"), "TERM": "dumb", "USER": os.environ.get("USER", "root"),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", "-lc", script], env=env, capture_output=True, text=True, timeout=timeout)


def package_version():
    """The version setup.cfg gives the distribution: it reads eddis.__version__ (attr:)."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert cfg["metadata"]["version"] == "attr: eddis.__version__"
    import eddis

    return eddis.__version__


def test_modulefiles_carry_the_package_version():
    version = package_version()
    assert LUA.name == f"{version}.lua" and TCL.name == version
    assert f'local version = "{version}"' in LUA.read_text()
    assert f"set version {version}" in TCL.read_text()


@needs_lmod
@pytest.mark.timeout(180)
@pytest.mark.parametrize("moduledir", [REPO / "modulefiles", REPO / "modulefiles" / "tcl"], ids=["lua", "tcl"])
def test_module_load_then_doctor_json(moduledir):
    proc = login_shell(f"""
        module use {moduledir}
        module load eddis || exit 9
        echo "EDDIS_HOME=$EDDIS_HOME"
        echo "EDDIS_BIN=$(command -v eddis)"
        eddis doctor --json > doctor.json.$$ ; rc=$?
        echo "DOCTOR_RC=$rc"; cat doctor.json.$$ >&2; rm -f doctor.json.$$
    """)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert f"EDDIS_HOME={REPO}\n" in out
    assert f"EDDIS_BIN={REPO}/.venv/bin/eddis" in out
    assert "DOCTOR_RC=0" in out, proc.stderr
    report = json.loads(proc.stderr[proc.stderr.index("{"):])
    transports = report["checks"]["ucx"]["data"]["transports"]
    assert "tcp" in transports and {"posix", "sysv"} & set(transports)
    ib = report["checks"]["infiniband"]["data"]
    if not ib["devices"]:
        assert "no HCA" in ib["finding"]


@needs_lmod
@pytest.mark.timeout(120)
def test_whatis_help_and_unload():
    proc = login_shell(f"""
        module use {REPO}/modulefiles
        module whatis eddis
        module help eddis
        module load eddis && module unload eddis
        # Lmod also drops duplicate PATH entries on unload, so compare what we added.
        case ":$PATH:" in *"{REPO}/.venv/bin"*|*"{REPO}/scripts"*) ;; *) echo PATH_RESTORED ;; esac
        [ -z "${{EDDIS_HOME:-}}" ] && echo HOME_UNSET
        module -t avail 2>&1
    """)
    text = proc.stdout + proc.stderr
    for field in ("Name: eddis", "Version: 0.1.0", "Category:", "Description:"):
        assert field in text
    assert "eddis-train" in text and "srun --mpi=pmix" in text  # the help text
    assert "PATH_RESTORED" in proc.stdout and "HOME_UNSET" in proc.stdout
    assert "tcl/eddis" not in text  # the Tcl twin stays hidden from Lmod users


@needs_lmod
@pytest.mark.timeout(120)
def test_site_install_prefix_substitution(tmp_path):
    # A site admin copies the modulefile into its tree with the prefix filled in.
    site = tmp_path / "modules" / "eddis"
    site.mkdir(parents=True)
    prefix = REPO / ".venv"
    (site / LUA.name).write_text(LUA.read_text().replace("@EDDIS_PREFIX@", str(prefix)))
    proc = login_shell(f"""
        module use {tmp_path}/modules
        module load eddis || exit 9
        echo "EDDIS_HOME=$EDDIS_HOME"; echo "BIN=$(command -v eddis)"; echo "PYTHONPATH=${{PYTHONPATH:-}}"
        eddis --version
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"EDDIS_HOME={prefix}\n" in proc.stdout
    assert f"BIN={prefix}/bin/eddis" in proc.stdout
    assert re.search(r"^eddis \d", proc.stdout, re.M)


@pytest.mark.skipif(shutil.which("tclsh") is None, reason="tclsh not installed")
def test_tcl_twin_parses():
    # tclsh checks the syntax of the twin with the module commands defined as no-ops.
    script = "proc module-whatis args {}; proc conflict args {}; proc setenv args {};" \
             "proc prepend-path args {}; set ModulesCurrentModulefile {%s}; source {%s}; puts ok" % (TCL, TCL)
    proc = subprocess.run(["tclsh"], input=script, capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() == "ok", proc.stderr
