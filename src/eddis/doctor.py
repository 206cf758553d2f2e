"""``eddis doctor``: what this machine offers EDDIS, and what is missing.

Each check looks at one part of the stack and returns a :class:`Check` with a
status (``ok``, ``warn`` for a finding that limits EDDIS but does not stop it,
``fail`` for something required that is missing), a one-line summary and data:

- ``eddis``: version and which native extensions are built
- ``ucx``: UCX version and transports/devices, from UCX itself
  (``eddis.smb._core`` when built, else ``ucx_info``)
- ``infiniband``: HCAs, ports, state and rate from libibverbs (``eddis._verbs``);
  "no HCA found" is a finding
- ``smb_transport``: the SMB transport a job on nodes like this one gets
  (``SMB_TRANSPORT``; ``auto``: rdma where the nodes have an active InfiniBand/RoCE
  port that UCX can use) and why, the UCX transports its one-sided access would use,
  and whether UCX can move CUDA memory (GPUDirect); the test-only
  ``SMB_UCX_ALLOW_TCP`` is a warning: unsafe
- ``mpi``: MPI library and version, mpi4py
- ``slurm``: Slurm version, and the allocation when inside one
- ``gpus``: GPUs as torch sees them (and the GPUs Slurm assigned)
- ``frameworks``: torch and tensorflow versions (one of them is required)
- ``hugepages``: free hugetlb pages and the shared-memory THP policy, against
  what ``SMB_HUGEPAGES`` asks for an ``SMB_MEMORY`` arena

``run_checks()`` never raises: a check that crashes is reported as ``fail``
with the error. ``main()`` prints a table or ``--json`` and exits 1 when any
check failed.
"""
import importlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field

OK, WARN, FAIL = "ok", "warn", "fail"
COMMAND_TIMEOUT_S = 20

# Debian/Ubuntu and Rocky package names, for the fix hints.
PACKAGES = {
    "ucx": ("libucx-dev ucx-utils", "ucx-devel"),
    "verbs": ("libibverbs-dev rdma-core", "rdma-core-devel"),
    "mpi": ("openmpi-bin libopenmpi-dev", "openmpi-devel"),
    "slurm": ("slurm-wlm (slurm-client on login nodes)", "slurm"),
}


@dataclass
class Check:
    name: str
    status: str
    summary: str
    data: dict = field(default_factory=dict)
    fix: str = ""


def _install_hint(key):
    debian, rocky = PACKAGES[key]
    return f"Debian/Ubuntu: apt-get install {debian}; Rocky: dnf install {rocky}"


def _run(argv, env=None):
    """stdout of a command, or None when it is missing, fails or hangs."""
    if shutil.which(argv[0]) is None and not os.path.exists(argv[0]):
        return None
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _import(name):
    try:
        return importlib.import_module(name), None
    except Exception as exc:  # an extension may fail to load for many reasons (ImportError, OSError)
        return None, f"{type(exc).__name__}: {exc}"


def _dist_version(*names):
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# ------------------------------------------------------------------ checks

EXTENSIONS = {
    "eddis._verbs": "InfiniBand device query (libibverbs)",
    "eddis._mpi": "MPI helpers (mpi4py)",
    "eddis.smb._core": "SMB core (UCX)",
    "eddis.smb._vecops": "SMB vector kernels",
}


def check_eddis():
    import eddis

    built = {}
    for name, what in EXTENSIONS.items():
        module, error = _import(name)
        built[name] = error is None
    version = getattr(eddis, "__version__", None) or _dist_version("eddis") or "source tree"
    missing = [n for n, ok in built.items() if not ok]
    data = {"version": version, "python": platform.python_version(), "location": os.path.dirname(eddis.__file__),
            "extensions": built}
    if "eddis.smb._core" in missing:
        return Check("eddis", FAIL, f"eddis {version}: SMB core not built", data,
                     fix="build it: python setup.py build_ext --inplace (needs libucx-dev), or pip install .")
    status = WARN if missing else OK
    summary = f"eddis {version}, Python {data['python']}" + (f"; not built: {', '.join(missing)}" if missing else "")
    return Check("eddis", status, summary, data,
                 fix="rebuild: python setup.py build_ext --inplace" if missing else "")


def _ucx_from_core():
    core, error = _import("eddis.smb._core")
    if core is None or not hasattr(core, "ucx_version") or not hasattr(core, "ucx_transports"):
        return None
    version = core.ucx_version()
    transports = {}
    for entry in core.ucx_transports():
        if isinstance(entry, dict):
            tl, dev = entry.get("transport"), entry.get("device")
        elif isinstance(entry, (tuple, list)):
            tl, dev = entry[0], (entry[1] if len(entry) > 1 else None)
        else:
            tl, _, dev = str(entry).partition("/")
        transports.setdefault(tl, [])
        if dev and dev not in transports[tl]:
            transports[tl].append(dev)
    return {"version": version, "transports": transports, "source": "eddis.smb._core (libucp)",
            "library": loaded_library("libucp.so"), "fence_mode": core.ucx_fence_mode()}


def loaded_library(soname, maps="/proc/self/maps"):
    """The file this process mapped for ``soname`` (e.g. libucp.so): one copy of UCX serves
    a process, so with MPI's UCX loaded first, SMB runs on that one, whatever it was built on."""
    try:
        with open(maps) as lines:
            for line in lines:
                path = line.split(None, 5)[-1].strip()
                if "/" + soname in path:
                    return path
    except OSError:
        pass
    return None


def parse_ucx_info_version(text):
    """``ucx_info -v`` -> the library's version: "# Version 1.13.1" in UCX 1.13, "# Library
    version: 1.22.0" (beside the headers' version) in 1.22."""
    match = re.search(r"^#?\s*(?:Library )?version:?\s+([0-9][\w.\-]*)", text or "", re.I | re.M)
    return match.group(1) if match else None


def parse_ucx_info_devices(text):
    """``ucx_info -d`` output -> {transport: [devices]} in order of appearance."""
    transports, current = {}, None
    for line in (text or "").splitlines():
        match = re.match(r"#\s+Transport:\s+(\S+)", line)
        if match:
            current = match.group(1)
            transports.setdefault(current, [])
            continue
        match = re.match(r"#\s+Device:\s+(\S+)", line)
        if match and current is not None and match.group(1) not in transports[current]:
            transports[current].append(match.group(1))
    return transports


def _ucx_from_ucx_info():
    version = parse_ucx_info_version(_run(["ucx_info", "-v"]))
    if version is None:
        return None
    devices = _run(["ucx_info", "-d"])
    return {"version": version, "transports": parse_ucx_info_devices(devices), "source": "ucx_info"}


def check_ucx():
    info = None
    errors = []
    for probe in (_ucx_from_core, _ucx_from_ucx_info):
        try:
            info = probe()
        except Exception as exc:  # report and try the next source
            errors.append(f"{probe.__name__}: {exc}")
        if info:
            break
    if not info:
        return Check("ucx", FAIL, "UCX not found" + (f" ({'; '.join(errors)})" if errors else ""), {},
                     fix=_install_hint("ucx"))
    from .smb.transport import CUDA_TLS, HCA_TLS

    names = list(info["transports"])
    info["rdma"] = any(t in names for t in HCA_TLS)
    info["cuda"] = [t for t in names if t in CUDA_TLS]
    summary = f"UCX {info['version']}"
    if info.get("library"):
        summary += f" ({info['library']})"
    summary += f": transports {', '.join(names) or 'none'}"
    if info.get("fence_mode"):
        summary += f"; fence {info['fence_mode']}"
    if not names:
        return Check("ucx", FAIL, summary, info, fix="UCX lists no transport; check UCX_TLS/UCX_NET_DEVICES")
    if not info["rdma"]:
        summary += " (no RDMA transport: SMB runs over TCP/shared memory)"
    return Check("ucx", OK, summary, info)


def check_infiniband():
    verbs, error = _import("eddis._verbs")
    if verbs is None:
        return Check("infiniband", WARN, "libibverbs query not built", {"error": error},
                     fix="rebuild with libibverbs: " + _install_hint("verbs"))
    result = verbs.query()
    devices = result["devices"]
    if not devices:
        return Check("infiniband", WARN, result["finding"] or "no HCA found",
                     {"devices": [], "finding": result["finding"] or "no HCA found"},
                     fix="no InfiniBand/RoCE here: SMB uses TCP between nodes")
    parts = []
    for dev in devices:
        ports = ", ".join(
            f"port {p['port']} {p['state']}" + (f" {p['rate_gbps']:g} Gb/s" if p.get("rate_gbps") else "")
            + f" {p['link_layer']}"
            for p in dev["ports"]) or dev.get("error", "no ports")
        parts.append(f"{dev['name']} ({ports})")
    active = any(p["active"] for d in devices for p in d["ports"])
    return Check("infiniband", OK if active else WARN, "; ".join(parts),
                 {"devices": devices, "finding": result["finding"]},
                 fix="" if active else "no port is ACTIVE: check cabling and the subnet manager")


def check_smb_transport():
    from . import identity, settings
    from .smb import transport

    requested = transport.requested(settings.get("SMB_TRANSPORT"))
    allow_tcp = settings.get("SMB_UCX_ALLOW_TCP")
    facts = transport.node_facts(identity.node_name())
    chosen, why = transport.choose(requested, [facts])
    data = {"requested": requested, "transport": chosen, "reason": why, "node": facts,
            "allow_tcp": allow_tcp, "ucx_tls": transport.ucx_tls(facts["ucx"], allow_tcp=allow_tcp)}
    core, _ = _import("eddis.smb._core")
    if core is not None:
        data["ucx_memory_types"] = core.ucx_memory_types()
    data["gpu_direct"] = "cuda" in data.get("ucx_memory_types", ())
    summary = f"a job on nodes like this one gets {chosen} ({why})"
    if chosen == "rdma":
        summary += f"; one-sided over UCX {data['ucx_tls'] or 'nothing'}"
    summary += "; GPUDirect possible" if data["gpu_direct"] else ""
    if allow_tcp:
        return Check("smb_transport", WARN, summary + "; UNSAFE: SMB_UCX_ALLOW_TCP=1", data,
                     fix="SMB_UCX_ALLOW_TCP=1 lets UCX's tcp transport serve unchecked one-sided writes to "
                         "any peer that reaches its port: a setting for tests only; unset it")
    if chosen == "rdma" and not data["ucx_tls"]:
        return Check("smb_transport", FAIL, summary, data,
                     fix="SMB_TRANSPORT=rdma, but UCX has none of the transports SMB may use here; "
                         "set SMB_TRANSPORT=auto or socket")
    return Check("smb_transport", OK, summary, data)


def check_mpi():
    try:
        import mpi4py
    except ImportError:
        return Check("mpi", FAIL, "mpi4py is not installed", {},
                     fix="MPICC=mpicc pip install --no-binary=mpi4py mpi4py (after " + _install_hint("mpi") + ")")
    try:
        from mpi4py import MPI
    except Exception as exc:
        return Check("mpi", FAIL, f"mpi4py {mpi4py.__version__} cannot load its MPI library: {exc}",
                     {"mpi4py": mpi4py.__version__}, fix=_install_hint("mpi"))
    mpi_ext, _ = _import("eddis._mpi")
    library = mpi_ext.library_version() if mpi_ext else MPI.Get_library_version().strip()
    standard = "%d.%d" % MPI.Get_version()
    first_line = library.splitlines()[0] if library else "unknown"
    name = first_line.split(",")[0]
    data = {"library": first_line, "standard": standard, "mpi4py": mpi4py.__version__,
            "mpicc": shutil.which("mpicc"), "mpirun": shutil.which("mpirun")}
    return Check("mpi", OK, f"{name} (MPI {standard}), mpi4py {mpi4py.__version__}", data)


def slurm_version():
    for argv in (["sinfo", "--version"], ["srun", "--version"], ["slurmd", "-V"], ["/usr/sbin/slurmd", "-V"]):
        out = _run(argv)
        if out:
            match = re.search(r"(\d+\.\d+\.\d+)", out)
            if match:
                return match.group(1)
    return None


def check_slurm():
    env = os.environ
    job = env.get("SLURM_JOB_ID")
    allocation = None
    if job:
        allocation = {k: env.get(v) for k, v in (
            ("job_id", "SLURM_JOB_ID"), ("nodelist", "SLURM_JOB_NODELIST"), ("partition", "SLURM_JOB_PARTITION"),
            ("ntasks", "SLURM_NTASKS"), ("het_size", "SLURM_HET_SIZE"), ("node", "SLURMD_NODENAME"),
            ("step_id", "SLURM_STEP_ID"), ("job_gpus", "SLURM_JOB_GPUS"))}
    have_client = shutil.which("sbatch") is not None
    version = slurm_version()
    data = {"version": version, "client": have_client, "inside_allocation": bool(job), "allocation": allocation,
            "slurm_conf": env.get("SLURM_CONF")}
    if not have_client:
        return Check("slurm", WARN, "Slurm not installed (eddis-train --local still works under mpirun)", data,
                     fix=_install_hint("slurm"))
    where = f"inside job {job} on {allocation['nodelist']}" if job else "not inside an allocation"
    if version is None:
        return Check("slurm", WARN, f"Slurm client installed but not configured, {where}", data,
                     fix="no slurm.conf reachable: set SLURM_CONF (local cluster: scripts/eddis-dev-cluster status)")
    return Check("slurm", OK, f"Slurm {version}, {where}", data)


def check_gpus():
    data = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "slurm_step_gpus": os.environ.get("SLURM_STEP_GPUS") or os.environ.get("SLURM_JOB_GPUS")}
    torch, error = _import("torch")
    if torch is None:
        return Check("gpus", WARN, "torch not importable: GPUs not queried", dict(data, error=error))
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                         "capability": f"{props.major}.{props.minor}"})
    data.update(devices=gpus, cuda=torch.version.cuda)
    if not gpus:
        return Check("gpus", WARN, "no GPU visible to torch (CPU training)", data)
    return Check("gpus", OK, ", ".join(f"{g['index']}: {g['name']}" for g in gpus), data)


def check_frameworks():
    versions = {"torch": None, "tensorflow": _dist_version("tensorflow", "tensorflow-cpu")}
    torch, _ = _import("torch")
    if torch is not None:
        versions["torch"] = torch.__version__
    present = {k: v for k, v in versions.items() if v}
    if not present:
        return Check("frameworks", FAIL, "neither torch nor tensorflow is installed", versions,
                     fix="pip install torch (or tensorflow-cpu / tensorflow)")
    summary = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    missing = [k for k, v in versions.items() if not v]
    if missing:
        summary += f" ({' and '.join(missing)} not installed)"
    return Check("frameworks", OK, summary, versions)


def check_hugepages():
    from . import settings
    from .errors import ConfigError
    from .smb import hugepages

    facts = page, total, free, overcommit = hugepages.hugetlb_facts()
    policy = hugepages.shmem_thp_policy()
    mode, memory = settings.get("SMB_HUGEPAGES"), settings.get("SMB_MEMORY")
    data = {"hugetlb_page_size": page, "hugetlb_total": total, "hugetlb_free": free,
            "hugetlb_overcommit": overcommit, "shmem_thp_policy": policy, "smb_hugepages": mode,
            "smb_memory": memory}
    offered = (f"hugetlb: {free} of {total} pages" + (f" of {page >> 20} MiB" if page else "")
               + f" free, shared-memory THP: {policy}")
    try:
        (kind, _), warning = hugepages.plan(mode, memory, facts=facts, policy=policy)
    except ConfigError as exc:
        return Check("hugepages", WARN, f"{offered}; SMB_HUGEPAGES={mode} cannot be met", data, fix=str(exc))
    data["smb_arena_pages"] = kind
    if warning:
        return Check("hugepages", WARN, f"{offered}; SMB_HUGEPAGES={mode} gets normal pages", data,
                     fix=warning)
    got = {"off": "normal pages", "hugetlb": "hugetlb pages", "transparent": "transparent huge pages"}[kind]
    return Check("hugepages", OK, f"{offered}; SMB_HUGEPAGES={mode}: {got} for a {memory >> 20} MiB arena",
                 data)


CHECKS = [check_eddis, check_ucx, check_infiniband, check_smb_transport, check_mpi, check_slurm, check_gpus, check_frameworks,
          check_hugepages]


def run_checks(checks=None):
    results = []
    for check in checks or CHECKS:
        name = check.__name__.replace("check_", "")
        try:
            results.append(check())
        except Exception as exc:  # a broken check is a finding, never a crash of doctor
            results.append(Check(name, FAIL, f"check crashed: {type(exc).__name__}: {exc}", {}))
    return results


def report_json(results):
    return {"ok": all(r.status != FAIL for r in results), "checks": {r.name: asdict(r) for r in results}}


def report_text(results):
    width = max(len(r.name) for r in results)
    lines = []
    for r in results:
        lines.append(f"[{r.status.upper():>4}] {r.name:<{width}}  {r.summary}")
        if r.fix and r.status != OK:
            lines.append(f"       {'':<{width}}  -> {r.fix}")
    failed = [r.name for r in results if r.status == FAIL]
    lines.append("")
    lines.append("required parts missing: " + ", ".join(failed) if failed else "EDDIS can run here.")
    return "\n".join(lines)


# ------------------------------------------------------------------ CLI

def add_arguments(parser):
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args):
    if "mpi4py.MPI" not in sys.modules:
        # This process only reports: the MPI library version needs no MPI_Init,
        # and skipping it keeps doctor quick and safe on a login node.
        try:
            import mpi4py

            mpi4py.rc.initialize = False
        except ImportError:
            pass  # check_mpi reports it
    results = run_checks()
    if args.json:
        print(json.dumps(report_json(results), indent=2, default=str))
    else:
        print(report_text(results))
    return 0 if all(r.status != FAIL for r in results) else 1


DESCRIPTION = "check UCX, InfiniBand, the SMB transport, MPI, Slurm, GPUs and frameworks on this machine"


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(prog="eddis doctor", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
