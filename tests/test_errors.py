"""One exception family: every exception class of EDDIS is an EddisError defined in
eddis.errors, and no bare built-in exception is raised in src/ or cython/."""
import ast
import builtins
import importlib
import pkgutil
import re

import pytest

from conftest import REPO

import eddis
from eddis import errors

SOURCE_DIRS = (REPO / "src" / "eddis", REPO / "cython")
SOURCE_SUFFIXES = (".py", ".pyx", ".pxi", ".pxd")
COMPILED_EXTENSIONS = ("eddis._mpi", "eddis._verbs", "eddis.smb._core", "eddis.smb._vecops")

# Raises of a built-in that are Python's own protocol, not an EDDIS failure.
ALLOWED_BUILTIN_RAISES = {
    # PEP 562: a module's __getattr__ says "no such attribute" with AttributeError
    ("src/eddis/__init__.py", "AttributeError"),
    ("src/eddis/smb/__init__.py", "AttributeError"),
    # the abstract method of Reducer: NotImplementedError is how Python spells it
    ("src/eddis/core/reduce/base.py", "NotImplementedError"),
}

BUILTIN_EXCEPTIONS = sorted(name for name, obj in vars(builtins).items()
                            if isinstance(obj, type) and issubclass(obj, BaseException))
BUILTIN_RAISE = re.compile(r"\braise\s+(?:builtins\.)?(" + "|".join(BUILTIN_EXCEPTIONS)
                           + r"|socket\.timeout|socket\.error|os\.error)\b")


def source_files():
    for top in SOURCE_DIRS:
        yield from sorted(p for p in top.rglob("*") if p.suffix in SOURCE_SUFFIXES)


def eddis_exception_classes(module):
    """The exception classes a module's namespace defines or re-exports from EDDIS.

    Warning categories are left out: a warning is not raised as an error, and
    ``warnings.warn`` needs a Warning subclass, which no EddisError is."""
    for value in vars(module).values():
        if (isinstance(value, type) and issubclass(value, BaseException)
                and not issubclass(value, Warning) and value.__module__.startswith("eddis")):
            yield value


def all_modules():
    names = [m.name for m in pkgutil.walk_packages(eddis.__path__, "eddis.")]
    assert set(COMPILED_EXTENSIONS) <= set(names), "an extension is not built: make build"
    return [importlib.import_module(name) for name in names]


def test_every_exception_class_is_an_eddis_error_defined_in_errors():
    found = {}
    for module in all_modules():
        for cls in eddis_exception_classes(module):
            found.setdefault(cls, module.__name__)
    assert errors.EddisError in found
    misplaced = [f"{cls.__module__}.{cls.__qualname__} (seen in {where})" for cls, where in found.items()
                 if cls.__module__ != "eddis.errors" or getattr(errors, cls.__name__, None) is not cls]
    assert misplaced == [], "define these in src/eddis/errors.py and import them where they are raised"
    not_ours = [cls.__qualname__ for cls in found
                if not issubclass(cls, errors.EddisError) and cls not in errors.SIGNALS]
    assert not_ours == [], "derive these from EddisError (and the matching built-in)"


def test_the_compiled_extensions_define_no_exception_class_of_their_own():
    for name in COMPILED_EXTENSIONS:
        module = importlib.import_module(name)
        for cls in eddis_exception_classes(module):
            assert cls.__module__ == "eddis.errors" and getattr(errors, cls.__name__) is cls, (name, cls)


def test_no_exception_class_is_defined_outside_errors_not_even_in_a_function():
    # the module walk sees module-level names only; a class made inside a function or
    # a Cython file's text is caught here
    defined = []
    for path in source_files():
        relative = path.relative_to(REPO).as_posix()
        if relative == "src/eddis/errors.py":
            continue
        text = path.read_text()
        if path.suffix == ".py":
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef) and any(_names_an_exception(b) for b in node.bases):
                    defined.append(f"{relative}:{node.lineno} {node.name}")
        else:
            for number, line in enumerate(text.splitlines(), 1):
                match = re.match(r"\s*class\s+(\w+)\s*\(([^)]*)\)", line)
                if match and re.search(r"(Error|Exception|Exit|Interrupt)\b", match.group(2)):
                    defined.append(f"{relative}:{number} {match.group(1)}")
    assert defined == [], "exception classes belong in src/eddis/errors.py"


def _names_an_exception(base):
    name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
    if name in BUILTIN_EXCEPTIONS:
        return not issubclass(getattr(builtins, name), Warning)
    ours = getattr(errors, name, None)
    if isinstance(ours, type) and issubclass(ours, Warning):
        return False  # a warning category (EddisWarning) may be defined beside its warn()
    return name.endswith(("Error", "Exception")) or isinstance(ours, type)


def test_no_bare_builtin_exception_is_raised():
    bare = []
    for path in source_files():
        relative = path.relative_to(REPO).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for match in BUILTIN_RAISE.finditer(code):
                if (relative, match.group(1)) not in ALLOWED_BUILTIN_RAISES:
                    bare.append(f"{relative}:{number}: {line.strip()}")
    assert bare == [], "raise the matching EddisError subclass of eddis.errors instead"


@pytest.mark.parametrize("module, name", [
    ("eddis.core.collectives", "CollectiveTimeoutError"),
    ("eddis.core.progress", "ProgressTimeoutError"),
    ("eddis.core.progress", "ProgressError"),
    ("eddis.core.reducer", "ReductionError"),
    ("eddis.core.reducer", "ReductionTimeoutError"),
    ("eddis.core", "ReductionError"),
    ("eddis.core", "CollectiveTimeoutError"),
    ("eddis._mpi", "MPIError"),
])
def test_moved_classes_keep_their_old_address(module, name):
    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


@pytest.mark.parametrize("cls, builtin", [
    (errors.CollectiveTimeoutError, TimeoutError), (errors.ReductionTimeoutError, TimeoutError),
    (errors.ProgressTimeoutError, TimeoutError), (errors.ReductionError, RuntimeError),
    (errors.ProgressError, RuntimeError), (errors.MPIError, RuntimeError),
    (errors.CheckpointError, OSError), (errors.TimelineNotFoundError, FileNotFoundError),
    (errors.TimelineFormatError, ValueError), (errors.SMBServerError, RuntimeError),
    (errors.NodeFailureError, RuntimeError),
])
def test_each_class_is_also_its_builtin(cls, builtin):
    error = cls("what failed and how to fix it")
    assert isinstance(error, errors.EddisError) and isinstance(error, builtin)
    assert str(error) == "what failed and how to fix it"
