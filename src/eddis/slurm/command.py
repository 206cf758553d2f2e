"""Whether a training command can start, checked before anything is started for it.

``eddis-train`` (every launch, and ``--check``/``--job`` in a job script) and ``eddis
submit`` (before ``sbatch``) ask the same question, so a job is never queued, nor its
servers started, only to find that its script is not there.
"""
import importlib.util
import os
import shutil
import sys


def missing_script(script):
    """Why the training command cannot start (a sentence), or None. Only what can be known
    without running it: a .py file that is not there, a program that is not on PATH, a
    ``-m`` module whose top-level package is nowhere on the path."""
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
    """Why ``python -m name`` would find nothing, or None. Only the top-level package is
    looked up: finding it imports nothing, while a dotted name's parents would be imported
    (and run) here, on the launching host. The working directory comes first, as it does
    for ``python -m``."""
    top = name.split(".")[0]
    if not top.isidentifier():
        return f"-m {name}: {top!r} is not a module name"
    sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path.pop(0)
    if found:
        return None
    return (f"-m {name}: no module named {top!r} on this Python's path (working directory "
            f"{os.getcwd()}, {sys.executable}); install it, or run eddis-train from the "
            "directory that holds it")
