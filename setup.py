"""Build glue for the Cython cores; metadata lives in setup.cfg.

Each optional C library has a three-state switch, read from the environment:
``EDDIS_WITH_<X>=1`` makes it required (the build stops if it is missing),
``EDDIS_WITHOUT_<X>=1`` skips it, and leaving both unset (or false) auto-detects
it. The switches take the same words as every boolean setting of EDDIS
(1/0, true/false, yes/no, on/off). The build prints a configuration summary
either way. Auto-detection stops the build, rather than leave an extension out,
where the system has the library but the build lacks the part it needs to use
it: MPI (mpicc) without an importable mpi4py.
"""
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
CYTHON_DIR = "cython"


def _load_boolenv():
    """eddis/_boolenv.py by path: the package cannot be imported before it is built, and the
    settings registry must not read a switch differently from the build."""
    path = os.path.join(HERE, "src", "eddis", "_boolenv.py")
    spec = importlib.util.spec_from_file_location("eddis_build_boolenv", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


boolenv = _load_boolenv()


def switch_on(name, environ=None):
    """The value of the yes/no switch ``name`` (unset: False); stops the build on a value
    that is no yes/no word, naming the variable, rather than guess what was meant."""
    text = (os.environ if environ is None else environ).get(name, "")
    value = boolenv.parse_bool(text)
    if value is None:
        sys.exit(f"error: {name}={text!r} is not a yes/no switch; set it to one of "
                 f"{boolenv.ACCEPTED} or unset it.")
    return value


def build_jobs(environ=None):
    """How many extensions compile at once: EDDIS_BUILD_JOBS, unset or 0 for one per CPU this
    process may use. Stops the build on a value that is no whole number."""
    text = (os.environ if environ is None else environ).get("EDDIS_BUILD_JOBS", "").strip()
    if not text.isdigit():
        if text:
            sys.exit(f"error: EDDIS_BUILD_JOBS={text!r} is not a whole number; set it to how many "
                     f"extensions may compile at once (1: one after the other, 0: one per CPU) or unset it.")
        text = "0"
    return int(text) or max(1, len(os.sched_getaffinity(0)))


class Dependency:
    """One C library: how to find it and what to tell the user when it is missing."""

    def __init__(self, key, description, headers, libraries, debian, rocky, pkg_config=None):
        self.key = key
        self.description = description
        self.headers = headers
        self.libraries = libraries
        self.debian = debian
        self.rocky = rocky
        self.pkg_config = pkg_config
        self.include_dirs = []
        self.library_dirs = []
        self.extra_compile_args = []
        self.extra_link_args = []
        self.version = None
        self.state = None  # "required" | "skipped" | "auto"
        self.found = False
        self.reason = ""
        # Set when the system has the library but the build lacks a part it needs to use it (MPI
        # without mpi4py): auto-detection stops the build with this, rather than leave the
        # extension out with nothing said until `eddis doctor`.
        self.stop = None

    def switch_state(self):
        want = switch_on("EDDIS_WITH_" + self.key)
        skip = switch_on("EDDIS_WITHOUT_" + self.key)
        if want and skip:
            sys.exit(
                f"error: EDDIS_WITH_{self.key} and EDDIS_WITHOUT_{self.key} are both set; "
                "unset one of them."
            )
        return "required" if want else "skipped" if skip else "auto"

    def missing_message(self):
        return (
            f"{self.description} was not found ({self.reason}).\n"
            f"  Debian/Ubuntu: apt-get install {self.debian}\n"
            f"  Rocky/RHEL:    dnf install {self.rocky}\n"
            f"  or set EDDIS_WITHOUT_{self.key}=1 to build without it."
        )


def user_flags(*names):
    """Compiler flags the user set in the environment (CPPFLAGS, CFLAGS, LDFLAGS).

    Detection honours them exactly as the build does, so ``CFLAGS=-I/opt/ucx/include``
    finds a library in a non-standard place and the check never disagrees with the build.
    """
    return sum((shlex.split(os.environ.get(n, "")) for n in names), [])


def c_compiler(compiler="cc"):
    return shutil.which(os.environ.get("CC", compiler)) or shutil.which("gcc")


def compiler_has_header(header, include_dirs, compiler="cc"):
    """True when ``#include <header>`` compiles with the given include path."""
    cc = c_compiler(compiler)
    if cc is None:
        return False
    args = [cc, "-E", "-x", "c", "-"] + user_flags("CPPFLAGS", "CFLAGS") + ["-I" + d for d in include_dirs]
    proc = subprocess.run(
        args, input=f"#include <{header}>\n", capture_output=True, text=True
    )
    return proc.returncode == 0


def linker_finds_library(library, library_dirs, compiler="cc"):
    """True when a program linked with ``-l<library>`` links."""
    cc = c_compiler(compiler)
    if cc is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        args = ([cc, "-x", "c", "-", "-o", os.path.join(tmp, "a.out")]
                + user_flags("CFLAGS", "LDFLAGS") + ["-L" + d for d in library_dirs] + ["-l" + library])
        proc = subprocess.run(args, input="int main(void) { return 0; }\n", capture_output=True, text=True)
    return proc.returncode == 0


def pkg_config(package, *flags):
    if not shutil.which("pkg-config"):
        return None
    proc = subprocess.run(["pkg-config", *flags, package], capture_output=True, text=True)
    return proc.stdout.split() if proc.returncode == 0 else None


def detect_c_library(dep):
    if dep.pkg_config:
        cflags = pkg_config(dep.pkg_config, "--cflags")
        libs = pkg_config(dep.pkg_config, "--libs")
        version = pkg_config(dep.pkg_config, "--modversion")
        if cflags is not None and libs is not None:
            dep.include_dirs = [f[2:] for f in cflags if f.startswith("-I")]
            dep.library_dirs = [f[2:] for f in libs if f.startswith("-L")]
            dep.version = version[0] if version else None
    return detect_c_library_at(dep)


def detect_mpi(dep):
    mpicc = os.environ.get("MPICC") or shutil.which("mpicc")
    if not mpicc:
        dep.reason = "no mpicc on PATH (set MPICC)"
        return False
    try:
        import mpi4py
    except ImportError:
        dep.reason = "mpi4py is not importable (pip install --no-binary=mpi4py mpi4py)"
        dep.stop = (
            f"mpi4py is not importable by the Python that builds EDDIS ({sys.executable}), while this "
            f"system has MPI ({mpicc}): eddis._mpi (the MPI library's version for `eddis doctor`, the "
            "allreduce baseline) would be left out.\n"
            "  Install mpi4py built for this MPI into that environment, then install EDDIS again:\n"
            f"    MPICC={mpicc} {sys.executable} -m pip install --no-binary=mpi4py mpi4py\n"
            "  (pip install --no-build-isolation builds against the environment's packages)"
        )
        return False
    show = subprocess.run([mpicc, "--showme:compile"], capture_output=True, text=True)
    link = subprocess.run([mpicc, "--showme:link"], capture_output=True, text=True)
    if show.returncode == 0 and link.returncode == 0:
        dep.extra_compile_args = show.stdout.split()
        dep.extra_link_args = link.stdout.split()
    else:  # MPICH and Intel MPI spell it -compile-info / -link-info
        info = subprocess.run([mpicc, "-show"], capture_output=True, text=True)
        if info.returncode != 0:
            dep.reason = f"{mpicc} cannot report its flags"
            return False
        words = info.stdout.split()[1:]
        dep.extra_compile_args = [w for w in words if w.startswith(("-I", "-D", "-pthread"))]
        dep.extra_link_args = [w for w in words if w.startswith(("-L", "-l", "-Wl", "-pthread"))]
    dep.include_dirs = [mpi4py.get_include()]
    dep.version = "mpi4py " + mpi4py.__version__
    return True


def ucx_library_dirs(prefix):
    """The directories under ``prefix`` that hold libucp.so: lib, lib64, or a multiarch one
    (Debian's /usr/lib/x86_64-linux-gnu, where a Spack external's prefix is /usr)."""
    candidates = [os.path.join(prefix, "lib"), os.path.join(prefix, "lib64")]
    libroot = os.path.join(prefix, "lib")
    if os.path.isdir(libroot):
        candidates += sorted(os.path.join(libroot, d) for d in os.listdir(libroot))
    return [d for d in candidates if os.path.exists(os.path.join(d, "libucp.so"))]


def ucx_version_of(prefix, libdir):
    """The version of the UCX installed under ``prefix``: its ucx.pc, else its headers' API."""
    pc = os.path.join(libdir, "pkgconfig", "ucx.pc")
    if os.path.exists(pc):
        with open(pc) as f:
            for line in f:
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    header = os.path.join(prefix, "include", "ucp", "api", "ucp_version.h")
    if os.path.exists(header):
        with open(header) as f:
            found = dict(re.findall(r"#define UCP_API_(MAJOR|MINOR)\s+(\d+)", f.read()))
        if len(found) == 2:
            return f"{found['MAJOR']}.{found['MINOR']}"
    return None


def detect_ucx(dep):
    """UCX from EDDIS_UCX_HOME (an install prefix, linked with an RPATH to it), else from
    pkg-config and the compiler's search path."""
    home = os.environ.get("EDDIS_UCX_HOME", "").strip()
    if not home:
        return detect_c_library(dep)
    libdirs = ucx_library_dirs(home)
    if not os.path.exists(os.path.join(home, "include", "ucp", "api", "ucp.h")) or not libdirs:
        dep.reason = f"EDDIS_UCX_HOME={home} has no include/ucp/api/ucp.h and lib/libucp.so"
        dep.stop = (f"EDDIS_UCX_HOME={home} is not a UCX installation (no include/ucp/api/ucp.h and "
                    "libucp.so in lib/, lib64/ or lib/<multiarch>/ under it); point it at UCX's prefix "
                    "(the directory of its bin/ucx_info), or unset it")
        return False
    dep.include_dirs = [os.path.join(home, "include")]
    dep.library_dirs = libdirs[:1]
    # one libucp serves a process: the RPATH picks this one when SMB loads UCX first
    dep.extra_link_args = ["-Wl,-rpath," + libdirs[0]]
    version = ucx_version_of(home, libdirs[0])
    dep.version = f"{version or 'unknown version'} at {home}, with RPATH"
    return detect_c_library_at(dep)


def detect_c_library_at(dep):
    """detect_c_library without pkg-config: the headers and libraries of dep's own dirs."""
    for header in dep.headers:
        if not compiler_has_header(header, dep.include_dirs):
            dep.reason = f"header <{header}> does not compile"
            return False
    for library in dep.libraries:
        if not linker_finds_library(library, dep.library_dirs):
            dep.reason = f"library -l{library} does not link"
            return False
    return True


def detect_cuda(dep):
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    include = os.path.join(home, "include")
    if not os.path.exists(os.path.join(include, "cuda_runtime_api.h")):
        dep.reason = f"no cuda_runtime_api.h under {include} (set CUDA_HOME)"
        return False
    dep.include_dirs = [include]
    candidates = [os.path.join(home, d) for d in ("lib64", "lib", "targets/x86_64-linux/lib")]
    dep.library_dirs = [d for d in candidates if os.path.isdir(d)][:1]
    if not linker_finds_library("cudart", dep.library_dirs):
        dep.reason = f"libcudart does not link from {home} (set CUDA_HOME)"
        return False
    dep.version = os.path.basename(os.path.realpath(home))
    return True


DEPENDENCIES = {
    "UCX": Dependency(
        "UCX", "UCX (UCP API)", ["ucp/api/ucp.h"], ["ucp", "ucs"],
        debian="libucx-dev", rocky="ucx-devel", pkg_config="ucx",
    ),
    "VERBS": Dependency(
        "VERBS", "libibverbs", ["infiniband/verbs.h"], ["ibverbs"],
        debian="libibverbs-dev", rocky="rdma-core-devel", pkg_config="libibverbs",
    ),
    "MPI": Dependency(
        "MPI", "MPI (mpicc and mpi4py)", [], [],
        debian="libopenmpi-dev openmpi-bin", rocky="openmpi-devel",
    ),
    "CUDA": Dependency(
        "CUDA", "CUDA runtime", [], ["cudart"],
        debian="nvidia-cuda-toolkit", rocky="cuda-toolkit",
    ),
}
DETECTORS = {"UCX": detect_ucx, "MPI": detect_mpi, "CUDA": detect_cuda}

# Extension name -> (sources, dependencies it needs). An extension whose
# dependencies are not all available is left out of the build.
EXTENSIONS = {
    "eddis._verbs": (["cython/verbs.pyx"], ["VERBS"]),
    "eddis._mpi": (["cython/mpi.pyx"], ["MPI"]),
    "eddis.smb._vecops": (["cython/vecops.pyx"], []),
    "eddis.smb._core": (["cython/smb_core.pyx"], ["UCX"]),
}


def configure():
    for dep in DEPENDENCIES.values():
        dep.state = dep.switch_state()
        if dep.state == "skipped":
            continue
        dep.found = DETECTORS.get(dep.key, detect_c_library)(dep)
        if dep.stop and not dep.found:
            if dep.state == "required":
                sys.exit(f"error: EDDIS_WITH_{dep.key}={os.environ['EDDIS_WITH_' + dep.key]} but {dep.stop}.")
            sys.exit(f"error: {dep.stop},\n  or set EDDIS_WITHOUT_{dep.key}=1 to build without it.")
        if dep.state == "required" and not dep.found:
            sys.exit("error: EDDIS_WITH_%s=%s but %s" % (dep.key, os.environ["EDDIS_WITH_" + dep.key],
                                                        dep.missing_message()))


def summary(built, left_out=()):
    lines = ["", "EDDIS build configuration", "-" * 60]
    for dep in DEPENDENCIES.values():
        if dep.state == "skipped":
            status = "skipped (EDDIS_WITHOUT_%s=%s)" % (dep.key, os.environ["EDDIS_WITHOUT_" + dep.key])
        elif dep.found:
            status = "yes" + (f" ({dep.version})" if dep.version else "")
        else:
            status = "no: " + dep.reason
        lines.append(f"  {dep.description:<26} [{dep.state:>8}] {status}")
    lines.append("  extensions: " + (", ".join(built) or "none"))
    for name, missing in left_out:
        lines.append(f"  left out:   {name} (needs {', '.join(missing)})")
    lines.append("-" * 60)
    print("\n".join(lines), file=sys.stderr)


def extensions():
    import numpy

    configure()
    built, exts, left_out = [], [], []
    for name, (sources, needs) in EXTENSIONS.items():
        deps = [DEPENDENCIES[k] for k in needs]
        if not all(d.found for d in deps):
            left_out.append((name, [d.description for d in deps if not d.found]))
            continue
        ext = Extension(
            name,
            sources=sources,
            include_dirs=[CYTHON_DIR, numpy.get_include()] + sum((d.include_dirs for d in deps), []),
            library_dirs=sum((d.library_dirs for d in deps), []),
            libraries=sum((d.libraries for d in deps), []),
            extra_compile_args=["-O3"] + sum((d.extra_compile_args for d in deps), []),
            extra_link_args=sum((d.extra_link_args for d in deps), []),
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        )
        exts.append(ext)
        built.append(name)
    summary(built, left_out)
    from Cython.Build import cythonize

    return cythonize(
        exts,
        include_path=[CYTHON_DIR],
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False},
        quiet=True,
        nthreads=build_jobs() if len(exts) > 1 else 0,
    )


# Guarded so tests can import the detection functions; setuptools runs this file
# as __main__ (setup.py build_ext, pip and build's PEP 517 backend alike).
if __name__ == "__main__":
    setup(ext_modules=extensions(), options={"build_ext": {"parallel": build_jobs()}})
