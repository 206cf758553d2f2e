"""The package's layers import downwards only (docs/architecture.md, "Layers").

Two checks of the same table: every import statement of the source, function-level
ones included, names only a module its layer may use; and each layer imports, in a
fresh interpreter, with every layer above it made unimportable. Inside core, its own
layers (``CORE_LAYERS``) are held to the same rule, and the modules of the whole package,
every import statement counted (function-level ones too), form no import cycle.
"""
import ast
import subprocess

import pytest

from conftest import PYTHON, SRC, python_env

BASE = ("eddis", "eddis.errors", "eddis.settings", "eddis.identity", "eddis._boolenv", "eddis._mpi",
        "eddis._sync_route", "eddis._verbs")

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
    # eddis plan's subcommand and its probes inside a job are tools: they time EDDIS's own
    # reducers (core) and feed the planner's pure model (plan) what they measured
    "tools": (("eddis.cli", "eddis.doctor", "eddis.plan.command", "eddis.plan.probe"),
              ("base", "timeline", "smb", "core", "slurm", "launch", "plan")),
}
# The command-line tools reach the adapters only to report on them (doctor) and never at import.
LAZY_EXTRA = {"tools": ("torch", "tensorflow")}

# core's own layers, bottom-up (docs/architecture.md, "Core"): (their modules, the layers of
# core below them that they may import). The face (eddis.core's __init__) names the public API.
CORE_BELOW_CHECKPOINT = ("comm", "layout", "reduce", "progress", "hetero")
CORE_LAYERS = {
    "comm": (("eddis.core.comm",), ()),
    "layout": (("eddis.core.layout",), ()),
    "old addresses": (("eddis.core.collectives", "eddis.core.reducer"), ()),
    "heap": (("eddis.core.heap",), ()),
    "reduce": (("eddis.core.reduce",), ("comm", "layout")),
    "progress": (("eddis.core.progress",), ("comm", "layout", "reduce")),
    "hetero": (("eddis.core.hetero",), ("comm", "layout", "reduce", "progress")),
    "checkpoint": (("eddis.core.checkpoint",), CORE_BELOW_CHECKPOINT),
    "lifecycle": (("eddis.core.lifecycle", "eddis.core.basics"), CORE_BELOW_CHECKPOINT + ("checkpoint", "heap")),
    "face": (("eddis.core",), CORE_BELOW_CHECKPOINT + ("checkpoint", "lifecycle")),
}


def layer_of(module, layers=LAYERS):
    best = None
    for name, (prefixes, _) in layers.items():
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


def import_edges(path, modules):
    """(line, module) of every eddis module that an import statement of the file (at any depth)
    loads: each name that is a submodule, else the module the names come from; and the packages
    on the way that are not the importer's own (their __init__ runs)."""
    importer = module_name(path)
    package = (importer if path.name == "__init__.py" else importer.rsplit(".", 1)[0]).split(".")
    own = {".".join(package[:i]) for i in range(1, len(package) + 1)}   # imported before the importer
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            above = package[:len(package) - node.level + 1] if node.level else []
            base = ".".join(above + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
            targets = [n if n in modules else base for n in names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in dict.fromkeys(targets):
            while target not in modules and "." in target:   # an extension module: its package
                target = target.rsplit(".", 1)[0]
            if not target.startswith("eddis") or target not in modules:
                continue
            parts = target.split(".")
            for i in range(1, len(parts)):
                outer = ".".join(parts[:i])
                if outer not in own and outer in modules:
                    yield node.lineno, outer
            yield node.lineno, target


def module_graph():
    modules = {module_name(p): p for p in package_modules()}
    graph = {}
    for module, path in modules.items():
        graph[module] = {}
        for line, target in import_edges(path, modules):
            if target != module:
                graph[module].setdefault(target, line)
    return modules, graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


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


def test_no_import_cycle_function_level_imports_included():
    modules, graph = module_graph()
    described = []
    for component in cycles(graph):
        ties = [f"{m.removeprefix('eddis.')} -> {t.removeprefix('eddis.')} "
                f"({modules[m].relative_to(SRC)}:{line})"
                for m in component for t, line in graph[m].items() if t in component]
        described.append(f"{len(component)} modules: " + "; ".join(ties))
    assert described == []


def test_every_core_module_belongs_to_a_core_layer():
    core = [module_name(p) for p in package_modules() if layer_of(module_name(p)) == "core"]
    assert len(core) > 30
    assert [m for m in core if layer_of(m, CORE_LAYERS) is None] == []


def test_core_imports_go_down_its_own_layers():
    modules, graph = module_graph()
    wrong = []
    for module, targets in graph.items():
        layer = layer_of(module, CORE_LAYERS)
        if layer is None:
            continue
        allowed = {layer, *CORE_LAYERS[layer][1]}
        for target, line in targets.items():
            target_layer = layer_of(target, CORE_LAYERS)
            if target_layer is not None and target_layer not in allowed:
                wrong.append(f"{modules[module].relative_to(SRC)}:{line} ({layer}) imports {target} "
                             f"({target_layer})")
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
        # (a module of a layer above that lives in this package, as eddis plan's command, is not ours)
        names += [m.name for m in pkgutil.walk_packages(mod.__path__, prefix + ".")
                  if not any(m.name == b or m.name.startswith(b + ".") for b in blocked)]
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
