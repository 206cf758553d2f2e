"""The package's layers import downwards only (docs/architecture.md, "Layers").

Two checks of the same table: every import statement of the source, function-level
ones included, names only a module its layer may use; and each layer imports, in a
fresh interpreter, with every layer above it made unimportable.
"""
import ast
import subprocess

import pytest

from conftest import PYTHON, SRC, python_env

BASE = ("eddis", "eddis.errors", "eddis.settings", "eddis.identity", "eddis._boolenv", "eddis._mpi",
        "eddis._verbs")

# layer: (its modules, the layers below it that it may import)
LAYERS = {
    "base": (BASE, ()),
    "timeline": (("eddis.timeline",), ("base",)),
    "smb": (("eddis.smb",), ("base", "timeline")),
    "core": (("eddis.core",), ("base", "timeline", "smb")),
    "slurm": (("eddis.slurm",), ("base",)),
    "plan": (("eddis.plan",), ("base", "timeline", "smb")),
    "launch": (("eddis.launch",), ("base", "timeline", "smb", "slurm")),
    "torch": (("eddis.torch",), ("base", "timeline", "smb", "core")),
    "tensorflow": (("eddis.tensorflow",), ("base", "timeline", "smb", "core")),
    "tools": (("eddis.cli", "eddis.doctor"), ("base", "timeline", "smb", "core", "slurm", "launch")),
}
# The command-line tools reach the adapters only to report on them (doctor) and never at import.
LAZY_EXTRA = {"tools": ("torch", "tensorflow")}


def layer_of(module):
    best = None
    for name, (prefixes, _) in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                    best is None or len(prefix) > len(best[1])):
                best = (name, prefix)
    return best[0] if best else None


def module_name(path):
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path):
    """(line, imported module) of every eddis import in the file, at any depth."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None:  # from . import a, b: each name may be a module
                for alias in node.names:
                    yield node.lineno, f"{target}.{alias.name}"
            else:
                yield node.lineno, target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def package_modules():
    return sorted(p for p in (SRC / "eddis").rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_belongs_to_a_layer():
    assert [module_name(p) for p in package_modules() if layer_of(module_name(p)) is None] == []


def test_every_import_goes_down_the_layers():
    wrong = []
    for path in package_modules():
        module = module_name(path)
        layer = layer_of(module)
        allowed = {layer, *LAYERS[layer][1], *LAZY_EXTRA.get(layer, ())}
        for line, target in imports_of(path):
            if not target.startswith("eddis"):
                continue
            target_layer = layer_of(target)
            if target_layer is None:  # "from . import x" naming a function, not a module
                target_layer = layer_of(target.rsplit(".", 1)[0])
            if target_layer not in allowed:
                wrong.append(f"{path.relative_to(SRC)}:{line} ({layer}) imports {target} ({target_layer})")
    assert wrong == []


def test_no_module_reaches_upwards_through_sys_modules():
    found = [f"{p.relative_to(SRC)}: {line.strip()}" for p in package_modules()
             for line in p.read_text().splitlines()
             if "sys.modules" in line and '"eddis.' in line]
    assert found == []


BLOCKER = r"""
import importlib, importlib.abc, pkgutil, sys
blocked, mine = {blocked!r}, {mine!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in blocked):
            raise ImportError(f"{{name}} is above the layer being imported")
        return None

sys.meta_path.insert(0, Block())
import eddis
names = []
for prefix in mine:
    if prefix in ("eddis._mpi", "eddis._verbs"):
        names.append(prefix)
        continue
    mod = importlib.import_module(prefix)
    names.append(prefix)
    if hasattr(mod, "__path__") and prefix != "eddis":  # the root's subpackages are the other layers
        names += [m.name for m in pkgutil.walk_packages(mod.__path__, prefix + ".")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


@pytest.mark.parametrize("layer", [name for name in LAYERS if name != "tools"])
def test_each_layer_imports_with_the_layers_above_it_blocked(layer):
    prefixes, below = LAYERS[layer]
    allowed = {layer, *below}
    blocked = [p for name, (ps, _) in LAYERS.items() if name not in allowed for p in ps if p != "eddis"]
    code = BLOCKER.format(blocked=blocked, mine=list(prefixes))
    proc = subprocess.run([PYTHON, "-c", code], env=python_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip().splitlines()[-1]) >= 1


def test_the_package_root_imports_no_layer():
    proc = subprocess.run([PYTHON, "-c", "import sys, eddis; print(sorted(m for m in sys.modules "
                           "if m.startswith('eddis')))"], env=python_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "['eddis']", proc.stdout + proc.stderr
