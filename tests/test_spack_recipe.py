"""spack/packages/py-eddis/package.py against a minimal stand-in of Spack's package DSL.

Spack itself cannot be installed here. The stand-in gives the directives Spack's
signatures (a misspelt keyword is a TypeError), records what the recipe declares,
and runs its build-environment mapping and its install-time `eddis doctor` check
for real against this checkout's .venv.
"""
import configparser
import importlib.util
import itertools
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO

RECIPE = REPO / "spack" / "packages" / "py-eddis" / "package.py"

STAND_IN = textwrap.dedent('''
    """Stand-in for spack.package: directives with Spack's signatures, recorded per class."""
    import os
    import subprocess

    _pending = []
    __all__ = ["PythonPackage", "version", "variant", "conflicts", "depends_on", "maintainers",
               "license", "run_after", "Executable", "join_path", "mkdirp", "ProcessError"]


    def _directive(kind):
        def record(*args, **kwargs):
            _pending.append((kind, args, kwargs))
        return record


    def version(ver, checksum=None, *, preferred=None, deprecated=None, no_cache=None, url=None,
                extension=None, expand=None, fetch_options=None, git=None, branch=None, tag=None,
                commit=None, submodules=None, get_full_repo=None, sha256=None):
        _pending.append(("version", (ver,), dict(branch=branch, tag=tag, commit=commit, sha256=sha256)))


    def variant(name, default=None, description="", values=None, multi=None, validator=None,
                when=None, sticky=False):
        _pending.append(("variant", (name,), dict(default=default, description=description, when=when)))


    def conflicts(conflict_spec, when=None, msg=None):
        _pending.append(("conflicts", (conflict_spec,), dict(when=when, msg=msg)))


    def depends_on(spec, when=None, type=("build", "link"), patches=None):
        _pending.append(("depends_on", (spec,), dict(when=when, type=type)))


    def maintainers(*names):
        _pending.append(("maintainers", names, {}))


    def license(license_identifier, checked_by=None, when=None):
        _pending.append(("license", (license_identifier,), {}))


    def run_after(*phases, when=None):
        def mark(method):
            method.run_after = phases
            return method
        return mark


    class ProcessError(RuntimeError):
        pass


    class Executable:
        def __init__(self, name):
            self.path = name

        def __call__(self, *args, output=None, error=None, fail_on_error=True, env=None):
            proc = subprocess.run([self.path, *args], capture_output=True, text=True, timeout=300)
            if fail_on_error and proc.returncode != 0:
                raise ProcessError(f"{self.path} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
            return proc.stdout if output is str else None


    def join_path(*parts):
        return os.path.join(*map(str, parts))


    def mkdirp(*paths):
        for p in paths:
            os.makedirs(p, exist_ok=True)


    class PythonPackage:
        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__(**kwargs)
            cls.directives = list(_pending)
            _pending.clear()

        def __init__(self, spec, prefix=None):
            self.spec = spec
            self.prefix = prefix
''')

SPEC_TOKEN = re.compile(r"^(?P<name>[a-z0-9][a-z0-9-]*)?(?P<version>@[\w.:-]+)?(?P<variants>([+~][a-z0-9_-]+)*)$")


class Prefix(str):
    def __getattr__(self, name):
        return Prefix(str(Path(self) / name))


class FakeSpec:
    """Enough of a concrete spec: variant flags, and dependency lookups."""

    def __init__(self, variants, tmp):
        self.variants = variants
        self.tmp = tmp

    def satisfies(self, text):
        ok = True
        for sign, name in re.findall(r"([+~])([a-z0-9_-]+)", text):
            ok &= self.variants[name] == (sign == "+")
        return ok

    def __getitem__(self, name):
        dep = type("Dep", (), {})()
        dep.prefix = Prefix(self.tmp / name)
        dep.mpicc = str(self.tmp / name / "bin" / "mpicc")
        return dep


class RecordingEnv:
    def __init__(self):
        self.values = {}

    def set(self, name, value):
        self.values[name] = str(value)


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    fake = tmp_path / "fake_spack" / "spack"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "package.py").write_text(STAND_IN)
    monkeypatch.syspath_prepend(str(fake.parent))
    for mod in [m for m in sys.modules if m == "spack" or m.startswith("spack.")]:
        monkeypatch.delitem(sys.modules, mod)
    spec = importlib.util.spec_from_file_location("py_eddis_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    for mod in [m for m in sys.modules if m == "spack" or m.startswith("spack.")]:
        del sys.modules[mod]


def declared(cls, kind):
    return [(args, kwargs) for k, args, kwargs in cls.directives if k == kind]


def test_class_name_follows_spack_naming(recipe):
    # Spack maps py-eddis to class PyEddis; any other name is not found.
    assert hasattr(recipe, "PyEddis")
    assert recipe.PyEddis.__mro__[1].__name__ == "PythonPackage"
    assert recipe.PyEddis.__doc__.strip()


def test_variants_mirror_the_build_switches(recipe):
    variants = {args[0]: kwargs for args, kwargs in declared(recipe.PyEddis, "variant")}
    assert set(variants) == {"verbs", "cuda", "torch", "tensorflow"}
    assert all(v["description"] for v in variants.values())
    switches = recipe.PyEddis.SWITCHES
    from test_build import load_setup_module

    assert set(switches) == set(load_setup_module().DEPENDENCIES)
    assert {v for v in switches.values() if v} <= set(variants)


def test_dependencies_are_well_formed_and_complete(recipe):
    deps = declared(recipe.PyEddis, "depends_on")
    variants = {args[0] for args, _ in declared(recipe.PyEddis, "variant")}
    for (text,), kwargs in deps:
        assert SPEC_TOKEN.match(text), f"malformed spec {text!r}"
        for _, name in re.findall(r"([+~])([a-z0-9_-]+)", kwargs["when"] or ""):
            assert name in variants, f"when= names unknown variant {name}"
        types = kwargs["type"] if isinstance(kwargs["type"], tuple) else (kwargs["type"],)
        assert set(types) <= {"build", "link", "run", "test"}
    pairs = {(text, kwargs["when"]) for (text,), kwargs in deps}
    for needed in [("ucx+verbs", "+verbs"), ("mpi", None), ("py-mpi4py@4:", None), ("py-cython@3:", None),
                   ("py-numpy", None), ("py-h5py", None), ("py-torch", "+torch"),
                   ("py-tensorflow", "+tensorflow"), ("cuda", "+cuda")]:
        assert needed in pairs, f"missing depends_on{needed}"
    # Every runtime requirement of setup.cfg has its py- package.
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    names = {re.split(r"[<>=!~ ]", line.strip())[0].lower()
             for line in cfg["options"]["install_requires"].splitlines() if line.strip()}
    spack_names = {re.split(r"[@+~]", text)[0] for (text,), _ in deps}
    assert {f"py-{n}" for n in names} <= spack_names
    conflicts = declared(recipe.PyEddis, "conflicts")
    assert any(args[0] == "~torch~tensorflow" for args, _ in conflicts)


@pytest.mark.parametrize("verbs, cuda", list(itertools.product([True, False], repeat=2)))
def test_build_environment_sets_every_switch(recipe, tmp_path, verbs, cuda):
    spec = FakeSpec({"verbs": verbs, "cuda": cuda, "torch": True, "tensorflow": False}, tmp_path)
    env = RecordingEnv()
    recipe.PyEddis(spec).setup_build_environment(env)
    v = env.values
    assert v["EDDIS_WITH_UCX"] == v["EDDIS_WITH_MPI"] == "1"
    assert ("EDDIS_WITH_VERBS" in v) == verbs and ("EDDIS_WITHOUT_VERBS" in v) == (not verbs)
    assert ("EDDIS_WITH_CUDA" in v) == cuda and ("EDDIS_WITHOUT_CUDA" in v) == (not cuda)
    assert v["MPICC"].endswith("/mpi/bin/mpicc")
    assert ("CUDA_HOME" in v) == cuda


@pytest.mark.timeout(180)
def test_install_time_check_runs_the_real_doctor(recipe, tmp_path):
    venv = REPO / ".venv"
    if not (venv / "bin" / "eddis").exists():
        pytest.fail("no .venv/bin/eddis: run `make build` (pip install -e . puts the console scripts there)")
    prefix = Prefix(tmp_path / "prefix")
    (tmp_path / "prefix").mkdir()
    (tmp_path / "prefix" / "bin").symlink_to(venv / "bin")
    package = recipe.PyEddis(FakeSpec({"verbs": True, "cuda": False, "torch": True, "tensorflow": False},
                                      tmp_path), prefix=prefix)
    assert package.eddis_doctor.run_after == ("install",)
    package.eddis_doctor()
    report = json.loads((tmp_path / "prefix" / "share" / "eddis" / "doctor-at-install.json").read_text())
    assert report["ok"] is True


def test_recipe_is_valid_python_for_old_interpreters():
    # Spack runs recipes with the Python that runs Spack; keep to plain syntax.
    source = RECIPE.read_text()
    compile(source, str(RECIPE), "exec")
    assert "from spack.package import *" in source
