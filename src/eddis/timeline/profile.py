"""Per-step, per-rank training profile in HDF5 (h5py).

Each rank records one row per step into ``<run dir>/profile/rank-<r>.h5``
(appended once ``flush_every`` rows and ``flush_seconds`` have passed, so a crash
loses at most the last 10 seconds or 50 steps, whichever is more);
at the end rank 0 merges them into ``<run dir>/profile.h5``:

    /                       attrs: size, modes, nodes, gpu_types, settings (JSON),
                                   versions (JSON), created
    /ranks/<r>/<dataset>    step, time, t_step, t_compute, t_comm, t_wait,
                            samples, bytes_sent, bytes_recv
    /ranks/<r>              attrs: rank, size, gpu_type, mode, host, node, pid, group

Meaning of a row (seconds): ``t_step`` is the wall time of the step on the
training thread (from the end of the previous step); ``t_wait`` the part of it
the training thread was blocked on communication; ``t_compute = t_step - t_wait``
(forward, backward, optimizer, data loading); ``t_comm`` the busy time of the
communication thread (pushes, pulls, reductions; it overlaps compute). ``time`` is
the wall-clock second the step ended, relative to the profiler's start.

Typical use inside the runtime::

    prof = StepProfiler(run_dir, rank, gpu_type=..., mode=...)
    ...  # communication thread: prof.add_comm(seconds, bytes_sent, bytes_recv)
    ...  # training thread, blocked on a bucket: prof.add_wait(seconds)
    prof.step_end(samples)          # once per optimizer step
    prof.finalize(comm)             # collective; rank 0 writes profile.h5
"""
import json
import os
import platform
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np

from .. import identity
from ..errors import EddisWarning, TimelineFormatError, TimelineNotFoundError

FIELDS = (
    ("step", np.int64), ("time", np.float64), ("t_step", np.float64), ("t_compute", np.float64),
    ("t_comm", np.float64), ("t_wait", np.float64), ("samples", np.int64),
    ("bytes_sent", np.int64), ("bytes_recv", np.int64),
)
FIELD_NAMES = tuple(name for name, _ in FIELDS)


class ProfileWarning(EddisWarning):
    """The profile could not be written; training went on without it."""


def versions():
    """Versions of what the run used (only modules already imported, plus the basics)."""
    import h5py

    from .. import __version__

    out = {"eddis": __version__, "python": platform.python_version(), "numpy": np.__version__,
           "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version, "platform": platform.platform()}
    for name in ("torch", "tensorflow", "mpi4py"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = getattr(mod, "__version__", "?")
    if "mpi4py.MPI" in sys.modules:
        try:
            out["mpi"] = sys.modules["mpi4py.MPI"].Get_library_version().strip().splitlines()[0]
        except Exception:  # an MPI that cannot say its version still ran the job
            pass
    return out


def current_settings():
    """Every registered setting's value in this process (defaults included)."""
    from .. import settings

    out = {}
    for name in sorted(settings.REGISTRY):
        try:
            value = settings.get(name)
        except Exception as exc:  # a bad value is reported by the runtime; record what we saw
            value = f"<invalid: {exc}>"
        out[name] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return out


class StepProfiler:
    """Records one row per training step of one rank (see the module docstring)."""

    def __init__(self, run_dir, rank, size=1, gpu_type=None, mode=None, host=None, group=0,
                 flush_every=50, flush_seconds=10.0, metadata=None, node=None):
        self.run_dir = Path(run_dir)
        self.rank = int(rank)
        self.size = int(size)
        self.path = self.run_dir / "profile" / f"rank-{self.rank}.h5"
        self.flush_every = max(1, int(flush_every))
        self.flush_seconds = float(flush_seconds)
        self._last_flush = time.monotonic()
        self.failed = False
        self.closed = False
        self._lock = threading.Lock()
        self._rows = []
        self._written = 0
        self._step = 0
        self._comm = 0.0
        self._wait = 0.0
        self._sent = 0
        self._recv = 0
        self._t0 = time.perf_counter()
        self._last = self._t0
        self.attrs = {
            "rank": self.rank, "size": self.size,
            "gpu_type": gpu_type or identity.gpu_type() or "cpu",
            "mode": mode or "unknown",  # set_mode() once the training mode is known
            "host": host or socket.gethostname(),
            "node": node or identity.node_name(),
            "pid": os.getpid(), "group": int(group), "start_wall": time.time(),
        }
        self.metadata = dict(metadata or {})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._create()
        except OSError as exc:
            self._fail(exc)

    def set_mode(self, mode):
        """The training mode the optimizer was given (known only once it built its reducer)."""
        self.attrs["mode"] = str(mode)
        if self.failed or self.closed:
            return
        import h5py

        try:
            with h5py.File(self.path, "a") as f:
                f.attrs["mode"] = self.attrs["mode"]
        except OSError as exc:
            self._fail(exc)

    # ------------------------------------------------------------ accumulation
    def add_comm(self, seconds, bytes_sent=0, bytes_recv=0):
        """Communication-thread busy time and bytes moved, counted into the current step."""
        with self._lock:
            self._comm += seconds
            self._sent += int(bytes_sent)
            self._recv += int(bytes_recv)

    def add_wait(self, seconds):
        """Time the training thread was blocked on communication in the current step."""
        with self._lock:
            self._wait += seconds

    def mark_step_start(self):
        """Start the next step's clock now (otherwise it runs from the previous step's end)."""
        self._last = time.perf_counter()

    def step_end(self, samples, step=None):
        """Close the current step: ``samples`` processed by this rank in it."""
        now = time.perf_counter()
        with self._lock:
            comm, wait, sent, recv = self._comm, self._wait, self._sent, self._recv
            self._comm = self._wait = 0.0
            self._sent = self._recv = 0
        t_step = now - self._last
        self._last = now
        self._step = self._step + 1 if step is None else int(step)
        wait = min(wait, t_step)
        self.record(self._step, t_step, t_step - wait, comm, wait, samples, sent, recv, now - self._t0)

    def record(self, step, t_step, t_compute, t_comm, t_wait, samples, bytes_sent=0, bytes_recv=0, time_s=None):
        """Append one row directly (for code that measures the figures itself)."""
        if time_s is None:
            time_s = time.perf_counter() - self._t0
        self._rows.append((int(step), float(time_s), float(t_step), float(t_compute), float(t_comm),
                           float(t_wait), int(samples), int(bytes_sent), int(bytes_recv)))
        # HDF5 appends cost milliseconds: with short steps, write at most every flush_seconds.
        if len(self._rows) >= self.flush_every and time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    # ------------------------------------------------------------ storage
    def _create(self):
        import h5py

        with h5py.File(self.path, "w") as f:
            for name, dtype in FIELDS:
                f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(1024,))
            for key, value in self.attrs.items():
                f.attrs[key] = value
            f.attrs["settings"] = json.dumps(current_settings())
            f.attrs["versions"] = json.dumps(versions())
            f.attrs["metadata"] = json.dumps(self.metadata, default=str)

    def flush(self):
        """Append the buffered rows to this rank's file."""
        rows, self._rows = self._rows, []
        self._last_flush = time.monotonic()
        if self.failed or not rows:
            return
        import h5py

        try:
            table = list(zip(*rows))
            with h5py.File(self.path, "a") as f:
                n = f["step"].shape[0]
                for (name, dtype), column in zip(FIELDS, table):
                    ds = f[name]
                    ds.resize((n + len(rows),))
                    ds[n:] = np.asarray(column, dtype=dtype)
                f.attrs["steps"] = n + len(rows)
            self._written += len(rows)
        except OSError as exc:
            self._fail(exc)

    def close(self):
        if not self.closed:
            self.closed = True
            self.flush()

    def finalize(self, comm=None, output=None, timeout=60.0):
        """Close, and (collective over ``comm``) let rank 0 merge every rank's file.

        Returns the merged file's path on rank 0, None elsewhere or when it failed.
        """
        self.close()
        if comm is not None:
            if not _barrier(comm, timeout):
                warnings.warn(f"profile: not all ranks finished within {timeout}s; rank 0 merges "
                              f"what is there", ProfileWarning, stacklevel=2)
            if comm.Get_rank() != 0:
                return None
        elif self.rank != 0:
            return None
        try:
            return merge_profiles(self.run_dir, output=output)
        except (OSError, FileNotFoundError) as exc:
            warnings.warn(f"profile: could not write the merged profile in {self.run_dir}: {exc}",
                          ProfileWarning, stacklevel=2)
            return None

    def _fail(self, exc):
        if not self.failed:
            self.failed = True
            warnings.warn(f"EDDIS profile turned off: cannot write {self.path} ({exc}). Training goes on; "
                          f"point EDDIS_RUN_DIR at a writable directory to get a profile.",
                          ProfileWarning, stacklevel=3)


def _barrier(comm, timeout):
    req = comm.Ibarrier()
    deadline = time.monotonic() + timeout
    while not req.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def rank_files(run_dir):
    files = sorted(Path(run_dir, "profile").glob("rank-*.h5"),
                   key=lambda p: int(p.stem.split("-")[1]) if p.stem.split("-")[1].isdigit() else -1)
    return files


def merge_profiles(run_dir, output=None):
    """Write ``profile.h5`` (default ``EDDIS_PROFILE_FILE`` or ``<run dir>/profile.h5``) from the rank files."""
    import h5py

    from .. import settings

    files = rank_files(run_dir)
    if not files:
        raise TimelineNotFoundError(f"no per-rank profiles under {Path(run_dir) / 'profile'}: was the run "
                                    f"started with EDDIS_PROFILE=1 and EDDIS_RUN_DIR={run_dir}?")
    output = Path(output or settings.get("EDDIS_PROFILE_FILE") or Path(run_dir) / "profile.h5")
    tmp = output.with_name(output.name + ".tmp")
    nodes, gpu_types, modes = [], [], []
    with h5py.File(tmp, "w") as out:
        ranks = out.create_group("ranks")
        first_attrs = None
        for path in files:
            try:
                f = h5py.File(path, "r")
            except OSError as exc:  # a rank killed while appending: keep the others
                warnings.warn(f"profile: skipping {path}: {exc}", ProfileWarning, stacklevel=2)
                continue
            with f:
                attrs = dict(f.attrs)
                if first_attrs is None:
                    first_attrs = attrs
                g = ranks.create_group(str(int(attrs["rank"])))
                for name in FIELD_NAMES:
                    g.create_dataset(name, data=f[name][()])
                for key in ("rank", "size", "gpu_type", "mode", "host", "node", "pid", "group", "start_wall"):
                    if key in attrs:
                        g.attrs[key] = attrs[key]
                nodes.append(str(attrs.get("node")))
                gpu_types.append(str(attrs.get("gpu_type")))
                modes.append(str(attrs.get("mode")))
        if first_attrs is None:
            raise TimelineNotFoundError(f"no readable per-rank profile under {Path(run_dir) / 'profile'}: "
                                        "every rank file failed to open (see the warnings above)")
        out.attrs["size"] = int(first_attrs.get("size", len(files)))
        out.attrs["ranks_recorded"] = len(ranks)
        out.attrs["nodes"] = json.dumps(sorted(set(nodes)))
        out.attrs["gpu_types"] = json.dumps(sorted(set(gpu_types)))
        out.attrs["modes"] = json.dumps(sorted(set(modes)))
        out.attrs["settings"] = first_attrs.get("settings", "{}")
        out.attrs["versions"] = first_attrs.get("versions", "{}")
        out.attrs["metadata"] = first_attrs.get("metadata", "{}")
        # the job's SMB transport as its launcher recorded it (eddis.smb.rundir.TRANSPORT_FILE)
        transport = Path(run_dir) / "smb-transport.json"
        out.attrs["smb_transport"] = transport.read_text() if transport.exists() else "{}"
        out.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    os.replace(tmp, output)
    return output


def load_profile(path):
    """``(run_attrs, {rank: {"attrs": {...}, field: ndarray, ...}})`` from profile.h5 or a run dir."""
    import h5py

    path = Path(path)
    if path.is_dir():
        merged = path / "profile.h5"
        if not merged.exists():
            merged = merge_profiles(path, output=path / "profile.h5")
        path = merged
    ranks = {}
    with h5py.File(path, "r") as f:
        run_attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
        if "ranks" not in f:
            raise TimelineFormatError(f"{path} is not an EDDIS profile (no /ranks group); "
                                      f"give `eddis prof report` the profile.h5 of a run or its run directory")
        for key in f["ranks"]:
            g = f["ranks"][key]
            data = {name: g[name][()] for name in FIELD_NAMES if name in g}
            data["attrs"] = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in g.attrs.items()}
            ranks[int(key)] = data
    return run_attrs, dict(sorted(ranks.items()))
