"""spack/packages/py-eddis/package.py against a minimal stand-in of Spack's package DSL.

CI has no Spack (docs/install.md says how the recipe was checked with real Spack). The
stand-in gives the directives Spack's signatures (a misspelt keyword is a TypeError),
records what the recipe declares (CudaPackage's own directives included), and runs its
build-environment mapping and its stand-alone `eddis doctor` test for real against this
checkout's .venv.
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
    __all__ = ["PythonPackage", "CudaPackage", "version", "variant", "conflicts", "depends_on",
               "maintainers", "license", "run_after", "Executable", "join_path", "mkdirp",
               "ProcessError", "which"]


    def _directive(kind):
        def record(*args, **kwargs):
            _pending.append((kind, args, kwargs))
        return record


    def version(ver, checksum=None, *, preferred=None, deprecated=None, no_cache=None, url=None,
                extension=None, expand=None, fetch_options=None, git=None, branch=None, tag=None,
                commit=None, submodules=None, get_full_repo=None, sha256=None):
        _pending.append(("version", (ver,), dict(branch=branch, tag=tag, commit=commit, sha256=sha256,
                                                 preferred=preferred, url=url, git=git)))


    def variant(name, default=None, description="", values=None, multi=None, validator=None,
                when=None, sticky=False):
        _pending.append(("variant", (name,), dict(default=default, description=description, when=when,
                                                   values=values, multi=multi)))


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


    def which(*names, required=False):
        for name in names:
            if os.path.isfile(name) and os.access(name, os.X_OK):
                return Executable(name)
        if required:
            raise ProcessError(f"none of {names} found")
        return None


    def join_path(*parts):
        return os.path.join(*map(str, parts))


    def mkdirp(*paths):
        for p in paths:
            os.makedirs(p, exist_ok=True)


    class _Recorded:
        """Each class records its own directives and inherits its bases' (as in Spack)."""

        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__(**kwargs)
            cls.own_directives = list(_pending)
            _pending.clear()
            inherited = [d for base in reversed(cls.__mro__[1:])
                         for d in base.__dict__.get("own_directives", [])]
            cls.directives = inherited + cls.own_directives

        def __init__(self, spec, prefix=None):
            self.spec = spec
            self.prefix = prefix


    class PythonPackage(_Recorded):
        pass


    class CudaPackage(_Recorded):
        """What Spack's CudaPackage declares, in short."""
        cuda_arch_values = ("50", "60", "70", "75", "80", "86", "89", "90", "100", "120")
        variant("cuda", default=False, description="Build with CUDA")
        variant("cuda_arch", description="CUDA architecture", values=("none",) + cuda_arch_values,
                multi=True, when="+cuda")
        depends_on("cuda", when="+cuda")
''')

# One spec token as the recipe writes them: name@versions+variant~variant, then any
# key=value variants after spaces ("py-torch+cuda cuda_arch=90", "openmpi fabrics=ucx").
SPEC_TOKEN = re.compile(
    r"^(?P<name>[a-z0-9][a-z0-9-]*)?(?P<version>@[\w.:-]+)?(?P<variants>([+~][a-z0-9_-]+)*)"
    r"( [a-z0-9_]+=[\w,.-]+)*$"
)
WHEN_DEP = re.compile(r"\^(\[virtuals=[a-z,-]+\] )?[a-z0-9-]+")


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


def deps_of(cls):
    """{(spec, when): types} of every depends_on, types as a set."""
    out = {}
    for (text,), kwargs in declared(cls, "depends_on"):
        types = kwargs["type"] if isinstance(kwargs["type"], tuple) else (kwargs["type"],)
        out[(text, kwargs["when"])] = set(types)
    return out


def setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg


def requirement_names(lines):
    return [re.split(r"[<>=!~ ]", line.strip())[0].lower()
            for line in re.split(r"[\n;]", lines) if line.strip()]


def test_class_name_follows_spack_naming(recipe):
    # Spack maps py-eddis to class PyEddis; any other name is not found.
    assert hasattr(recipe, "PyEddis")
    assert [base.__name__ for base in recipe.PyEddis.__bases__] == ["PythonPackage", "CudaPackage"]
    assert recipe.PyEddis.__doc__.strip()


def test_variants_mirror_the_build_switches(recipe):
    variants = {args[0]: kwargs for args, kwargs in declared(recipe.PyEddis, "variant")}
    # cuda and cuda_arch come from CudaPackage, not from an own variant.
    assert set(variants) == {"verbs", "mlx5", "cuda", "cuda_arch", "torch", "tensorflow"}
    own = {args[0] for args, _ in declared(type("Own", (), {"directives": recipe.PyEddis.own_directives}),
                                           "variant")}
    assert own == {"verbs", "mlx5", "torch", "tensorflow"}
    assert variants["mlx5"]["when"] == "+verbs" and variants["mlx5"]["default"] is False
    assert all(v["description"] for v in variants.values())
    switches = recipe.PyEddis.SWITCHES
    from test_build import load_setup_module

    assert set(switches) == set(load_setup_module().DEPENDENCIES)
    assert {v for v in switches.values() if v} <= set(variants)


def test_dependencies_are_well_formed(recipe):
    variants = {args[0] for args, _ in declared(recipe.PyEddis, "variant")}
    for (text, when), types in deps_of(recipe.PyEddis).items():
        assert SPEC_TOKEN.match(text), f"malformed spec {text!r}"
        for _, name in re.findall(r"([+~])([a-z0-9_-]+)", WHEN_DEP.sub("", when or "")):
            assert name in variants, f"when= names unknown variant {name}"
        assert types <= {"build", "link", "run", "test"}


def test_dependencies_are_the_ones_a_real_install_needs(recipe):
    deps = deps_of(recipe.PyEddis)
    needed = {
        # the Cython extensions are C: Spack's compiler wrapper links them, with RPATHs
        ("c", None): {"build"},
        ("pkgconfig", None): {"build"},
        ("mpi", None): {"build", "link"},
        # the SMB client's worker is UCS_THREAD_MODE_MULTI
        ("ucx+thread_multiple", None): {"build", "link"},
        # ucx+verbs alone has no InfiniBand transport (~rc ~ud)
        ("ucx+verbs+rc+ud", "+verbs"): {"build", "link"},
        ("ucx+dc+mlx5_dv+rdmacm", "+mlx5"): {"build", "link"},
        ("rdma-core", "+verbs"): {"build", "link"},
        ("ucx+cuda", "+cuda"): {"build", "link"},
        ("cuda", "+cuda"): {"build", "link"},  # CudaPackage's
        # Open MPI defaults to fabrics=none
        ("openmpi fabrics=ucx", "^[virtuals=mpi] openmpi"): {"build", "link"},
        ("py-mpi4py@4:", None): {"build", "run"},
        ("py-cython@3:", None): {"build"},
        ("py-numpy", None): {"build", "run"},
        ("py-h5py", None): {"run"},
        ("py-torch@2:", "+torch"): {"run"},
        ("py-tensorflow@2.15:", "+tensorflow"): {"run"},
    }
    for key, types in needed.items():
        assert key in deps, f"missing depends_on{key}"
        assert deps[key] == types, f"depends_on{key}: type {deps[key]}, want {types}"
    # The CUDA toolkit comes from CudaPackage alone (no own "cuda" variant).
    assert sum(text == "cuda" for text, _ in deps) == 1
    # py-torch+cuda is built for the same GPUs as EDDIS.
    for arch in recipe.CudaPackage.cuda_arch_values:
        key = (f"py-torch+cuda cuda_arch={arch}", f"+torch+cuda cuda_arch={arch}")
        assert deps.get(key) == {"run"}, f"missing depends_on{key}"
    conflicts = {args[0]: kwargs for args, kwargs in declared(recipe.PyEddis, "conflicts")}
    assert "~torch~tensorflow" in conflicts
    assert conflicts["cuda_arch=none"]["when"] == "+cuda"


def test_dependencies_follow_setup_cfg(recipe):
    deps = deps_of(recipe.PyEddis)
    spack_names = {re.split(r"[@+~ ]", text)[0]: (text, types) for (text, _), types in deps.items()}
    cfg = setup_cfg()
    # Every runtime requirement of setup.cfg has its py- package, needed at run time.
    for name in requirement_names(cfg["options"]["install_requires"]):
        assert f"py-{name}" in spack_names
        assert "run" in spack_names[f"py-{name}"][1]
    # The extras' lower bounds: torch>=2.0 -> py-torch@2:, tensorflow-cpu>=2.15 -> @2.15:.
    extras = cfg["options.extras_require"]
    assert re.search(r"torch>=2(\.0)?\b", extras["torch"])
    assert re.search(r"tensorflow(-cpu)?>=2\.15\b", extras["tensorflow"])
    assert ("py-torch@2:", "+torch") in deps and ("py-tensorflow@2.15:", "+tensorflow") in deps
    # The test extra is what `spack test run` / `spack install --test` needs.
    for name in requirement_names(extras["test"]):
        assert deps.get((f"py-{name}", None)) == {"test"}, f"py-{name} is no test dependency"


def test_versions_are_the_release_tag_and_main(recipe):
    import eddis

    versions = {args[0]: kwargs for args, kwargs in declared(recipe.PyEddis, "version")}
    assert versions["main"]["branch"] == "main"
    release = versions[eddis.__version__]
    assert release["tag"] == f"v{eddis.__version__}"
    assert release["preferred"] is True
    assert set(versions) == {"main", eddis.__version__}
    # No made-up maintainer handle (Spack pings maintainers by their GitHub names).
    assert not declared(recipe.PyEddis, "maintainers")


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
    assert str(v["EDDIS_UCX_HOME"]) == str(tmp_path / "ucx")
    assert ("CUDA_HOME" in v) == cuda


@pytest.mark.parametrize("torch, tensorflow", [(True, False), (False, True), (True, True)])
def test_spack_test_run_skips_disabled_adapters(recipe, tmp_path, torch, tensorflow):
    spec = FakeSpec({"verbs": True, "cuda": False, "torch": torch, "tensorflow": tensorflow}, tmp_path)
    skipped = set(recipe.PyEddis(spec).skip_modules)
    assert skipped == {name for name, on in [("eddis.torch", torch), ("eddis.tensorflow", tensorflow)]
                       if not on}


def test_import_modules_are_the_packages_and_extensions(recipe):
    import setuptools
    from test_build import load_setup_module

    assert sorted(recipe.PyEddis.PACKAGES) == sorted(setuptools.find_packages(str(REPO / "src")))
    setup = load_setup_module()
    assert set(recipe.PyEddis.EXTENSIONS) == set(setup.EXTENSIONS)
    variant_of = recipe.PyEddis.SWITCHES
    for name, (_, switches) in setup.EXTENSIONS.items():
        wanted = {variant_of[switch] for switch in switches} - {None}
        assert wanted == ({recipe.PyEddis.EXTENSIONS[name]} - {None}), name


@pytest.mark.parametrize("verbs, torch, tensorflow", [(True, True, False), (False, False, True)])
def test_spack_test_run_imports_what_is_built(recipe, tmp_path, verbs, torch, tensorflow):
    spec = FakeSpec({"verbs": verbs, "cuda": False, "torch": torch, "tensorflow": tensorflow}, tmp_path)
    modules = recipe.PyEddis(spec).import_modules
    assert "eddis" in modules and "eddis.smb._core" in modules and "eddis._mpi" in modules
    assert ("eddis._verbs" in modules) == verbs
    assert ("eddis.torch" in modules) == torch
    assert ("eddis.tensorflow" in modules) == tensorflow


def test_no_install_time_hook(recipe):
    # An after-install check ran without the package on PYTHONPATH and failed every install
    # on a build host without an HCA or framework; the doctor is a stand-alone test now.
    hooks = [name for name, value in vars(recipe.PyEddis).items() if hasattr(value, "run_after")]
    assert hooks == []
    tests = [name for name in vars(recipe.PyEddis) if name.startswith("test_")]
    assert tests == ["test_doctor"]


@pytest.mark.timeout(180)
def test_stand_alone_test_runs_the_real_doctor(recipe, tmp_path, capsys):
    venv = REPO / ".venv"
    if not (venv / "bin" / "eddis").exists():
        pytest.fail("no .venv/bin/eddis: run `make build` (pip install -e . puts the console scripts there)")
    prefix = Prefix(tmp_path / "prefix")
    (tmp_path / "prefix").mkdir()
    (tmp_path / "prefix" / "bin").symlink_to(venv / "bin")
    package = recipe.PyEddis(FakeSpec({"verbs": True, "cuda": False, "torch": True, "tensorflow": False},
                                      tmp_path), prefix=prefix)
    package.test_doctor()
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True


def test_recipe_follows_spack_style():
    # Spack runs recipes with the Python that runs Spack; keep to plain syntax, and to the
    # line length spack-packages' flake8 and black use (99).
    source = RECIPE.read_text()
    compile(source, str(RECIPE), "exec")
    assert "from spack.package import *" in source
    long_lines = [n for n, line in enumerate(source.splitlines(), 1) if len(line) > 99]
    assert not long_lines, f"lines longer than 99: {long_lines}"
    assert "run_after" not in source


# ---------------------------------------------------------------- the guide's Spack steps
GUIDE = REPO / "docs" / "install.md"
CHECK_SCRIPT = REPO / "scripts" / "check-spack-guide.sh"
EXTERNALS = REPO / "spack" / "externals-debian12.yaml"
PINS = REPO / "spack" / "pydeps-constraints.txt"


def spack_section():
    text = GUIDE.read_text()
    start = text.index("## With Spack\n")
    return text[start:text.index("\n## ", start + 1)]


def guide_blocks():
    """(marker kind, marker name, language, body) of every fenced block of the Spack section;
    the kind and name are None for a block without a marker comment right above it."""
    lines = spack_section().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.fullmatch(r"```(\w+)", lines[i])
        if not fence:
            i += 1
            continue
        above = next((line for line in reversed(lines[:i]) if line.strip()), "")
        marker = re.fullmatch(r"<!-- (spack-guide|spack-guide-excerpt): (\S+) -->", above)
        end = lines.index("```", i + 1)
        found.append((*(marker.groups() if marker else (None, None)), fence.group(1), "\n".join(lines[i + 1:end])))
        i = end + 1
    return found


def script_steps():
    (steps,) = re.findall(r'^STEPS="([^"]*)"$', CHECK_SCRIPT.read_text(), re.M)
    return steps.split()


def test_every_block_of_the_spack_guide_is_a_step_of_the_check_script():
    blocks = guide_blocks()
    unmarked = [body.splitlines()[0] for kind, _, _, body in blocks if kind is None]
    assert not unmarked, ("blocks of docs/install.md 'With Spack' that scripts/check-spack-guide.sh does not "
                          f"run: {unmarked}; mark each <!-- spack-guide: NAME --> and add NAME to its STEPS")
    steps = [name for kind, name, _, _ in blocks if kind == "spack-guide"]
    assert sorted(steps) == sorted(script_steps()) and len(set(steps)) == len(steps)
    for kind, name, language, _ in blocks:
        assert language in ("bash", "yaml"), (name, language)


def test_excerpts_in_the_spack_guide_are_the_files_text():
    excerpts = [(name, body) for kind, name, _, body in guide_blocks() if kind == "spack-guide-excerpt"]
    assert excerpts
    for name, body in excerpts:
        assert body in (REPO / name).read_text(), f"docs/install.md shows a part of {name} that it does not hold"


@pytest.mark.timeout(60)
def test_the_check_script_runs_the_guides_commands_in_a_scratch_directory(tmp_path):
    import subprocess

    proc = subprocess.run([str(CHECK_SCRIPT), "--print", str(tmp_path)], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    program = proc.stdout
    syntax = subprocess.run(["bash", "-n"], input=program, capture_output=True, text=True, timeout=30)
    assert syntax.returncode == 0, syntax.stderr
    for _, name, language, body in guide_blocks():
        if language != "bash":
            continue
        for line in body.replace("<checkout>", str(REPO)).splitlines():
            command = re.sub(r"\s+# refused: .*$", "", line)
            if re.match(r"(PYDEPS|SITE_GIT|SCRATCH|SPACK_ROOT|SPACK_PACKAGES)=", line) or "<commit>" in line:
                continue  # the values the script gives (below)
            assert command in program, f"step {name}: {line!r} is not run as written"
    # every path the guide names for a site is the scratch directory's
    for documented in ("PYDEPS=/opt/eddis-pydeps", "SCRATCH=/tmp/spack-check", "/srv/git/eddis.git"):
        assert documented not in program
    assert f'PYDEPS="{tmp_path}/eddis-pydeps"' in program and f"git: file://{tmp_path}/eddis-src.git" in program
    # a spec the guide says is refused must be refused, with the guide's words
    assert "refused 'needs the GPUs'\\'' compute capabilities' spack spec py-eddis@0.1.0 +cuda\n" in program
    assert "refused 'EDDIS trains PyTorch or TensorFlow models' spack spec py-eddis@0.1.0 ~torch ~tensorflow\n" \
        in program


def test_the_pinned_python_packages_are_the_declared_externals():
    pins = dict(line.split("==") for line in PINS.read_text().splitlines() if line and not line.startswith("#"))
    declared = dict(re.findall(r"^    - spec: py-([\w-]+)@([\w.]+)", EXTERNALS.read_text(), re.M))
    assert declared.pop("pip") == "23.0.1"  # the venv's own (Debian 12's python3-venv), not installed by pip
    assert declared == {name.lower(): version for name, version in pins.items()}
    # torch 2.13 needs setuptools 77 or later, which +tensorflow's py-flatbuffers cannot build with:
    # Spack must be free to build an older one (docs/install.md, "Externals")
    setuptools = EXTERNALS.read_text().split("  py-setuptools:\n")[1].split("\n  py-")[0]
    assert "buildable: false" not in setuptools
    assert "prefix: /opt/eddis-pydeps" in setuptools
