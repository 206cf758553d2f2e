"""Whether a training command can start, checked before anything is started for it.

``eddis-train`` (every launch, and ``--check``/``--job`` in a job script) and ``eddis
submit`` (before ``sbatch``) ask the same question, so a job is never queued, nor its
servers started, only to find that its script is not there.
"""
import importlib.machinery
import importlib.util
import os
import shutil
import sys


def missing_script(script):
    """Why the training command cannot start (a sentence), or None. Only what can be known
    without running it: a .py file that is not there, a program that is not on PATH, a
    ``-m`` module that is nowhere on the path."""
    if not script:
        return None
    first = script[0]
    if first == "-m":
        if len(script) < 2:
            return "-m needs a module name"
        return missing_module(script[1])
    if first.endswith(".py") or os.sep in first:
        if not os.path.isfile(first):
            return f"the training script {first} does not exist (working directory {os.getcwd()})"
        return None
    if shutil.which(first) is None:
        return f"the training command {first} is not a file and not on PATH"
    return None


def missing_module(name):
    """Why ``python -m name`` would find nothing, or None. Nothing is imported: a dotted
    name's parents would run here, on the launching host, so each submodule is looked for
    with the path finder in its parent package's folders (those the parent's spec names,
    and the same folder under every path entry, as a namespace package or ``pkgutil``'s
    ``extend_path`` would add). The working directory comes first, as it does for
    ``python -m``. A parent whose submodules no folder can show (a finder of its own) is
    given the benefit of the doubt."""
    parts = name.split(".")
    bad = next((part for part in parts if not part.isidentifier()), None)
    if bad is not None:
        return f"-m {name}: {bad!r} is not a module name"
    sys.path.insert(0, os.getcwd())
    try:
        return _missing_part(name, parts)
    finally:
        sys.path.pop(0)


def _missing_part(name, parts):
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return (f"-m {name}: no module named {parts[0]!r} on this Python's path (working directory "
                f"{os.getcwd()}, {sys.executable}); install it, or run eddis-train from the "
                "directory that holds it")
    for depth in range(1, len(parts)):
        parent, child = ".".join(parts[:depth]), ".".join(parts[:depth + 1])
        if spec.submodule_search_locations is None:
            if spec.origin in (None, "built-in", "frozen") or not os.path.isfile(spec.origin):
                return None   # not a module on disk: nothing to look through
            return f"-m {name}: {parent} is a module ({spec.origin}), not a package that holds {child}"
        folders = list(dict.fromkeys([*spec.submodule_search_locations,
                                      *(os.path.join(entry or os.curdir, *parts[:depth]) for entry in sys.path
                                        if isinstance(entry, str))]))
        folders = [folder for folder in folders if os.path.isdir(folder)]
        if not folders:
            return None       # a finder of its own: only importing the parent would tell
        try:
            spec = importlib.machinery.PathFinder.find_spec(child, folders)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return (f"-m {name}: package {parent} has no module {parts[depth]!r} (looked in "
                    f"{', '.join(folders)}); check the name")
    return None
