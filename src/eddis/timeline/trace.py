"""Chrome trace event writer: one file per rank or SMB server, written in the background.

Recording an event appends one tuple to a bounded in-memory deque (no lock, no
formatting, no I/O on the caller's thread); a daemon thread formats the tuples as
Chrome trace JSON and writes them every ``flush_interval`` seconds. When the
buffer is full, new events are counted as dropped (the count goes into the trace)
rather than blocking training. When the timeline is off, every call returns after
one global lookup.

A failed write (unwritable directory, disk full) gives one :class:`TimelineWarning`
and turns that timeline off; training goes on.

Files, in the timeline directory:

- ``<role>-<index>.trace.json``: Chrome trace events (JSON array format; a file cut
  short by a crash lacks only the closing bracket, which viewers and
  ``eddis prof merge`` accept). Timestamps are this host's monotonic clock
  (``time.perf_counter_ns``) in microseconds.
- ``<role>-<index>.clock.json``: the clock description the merge needs: the
  monotonic clock's domain (kernel boot id), a (monotonic, wall) anchor pair, and,
  once measured, the offset to rank 0's clock with its uncertainty.
"""
import json
import os
import socket
import threading
import time
import warnings
from collections import deque
from pathlib import Path

from .. import identity
from .clock import TimelineWarning, clock_anchor, clock_domain, perf_ns, sync_clock_mpi
from .events import DEFAULT_CATEGORY

_get_ident = threading.get_ident
# One encoder for all events: json.dumps with keyword arguments builds a new encoder per call.
_encode_args = json.JSONEncoder(separators=(",", ":"), default=str).encode
_DRAIN_CHUNK = 256  # events formatted between two GIL releases of the writer thread


class Timeline:
    """One process's trace file and its background writer.

    Use the module functions (:func:`begin`, :func:`span`, ...) for the process's
    active timeline; a component with its own identity in the same process (an SMB
    server started inside a trainer) holds its own ``Timeline`` and calls its methods.
    """

    def __init__(self, directory, role="rank", index=0, label=None, capacity=1 << 20,
                 flush_interval=0.25, metadata=None):
        self.directory = Path(directory)
        self.role = role
        self.index = int(index)
        self.label = label or f"{role} {index}"
        self.capacity = int(capacity)
        self.flush_interval = float(flush_interval)
        self.dropped = 0
        self.failed = False
        self.closed = False
        self._buffer = deque()
        self._pid = os.getpid()
        self._tids = {}
        self._threads = {}
        self._names = {}
        self._reported_dropped = 0
        self._file = None
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        perf_anchor, wall_anchor = clock_anchor()
        self.clock = {
            "role": role, "index": self.index, "label": self.label, "pid": self._pid,
            "host": socket.gethostname(), "node": identity.node_name(),
            "clock_domain": clock_domain(), "perf_anchor_ns": perf_anchor, "wall_anchor_ns": wall_anchor,
            "offset_to_rank0_ns": 0 if (role == "rank" and self.index == 0) else None,
            "uncertainty_ns": 0 if (role == "rank" and self.index == 0) else None,
            "offset_method": "reference" if (role == "rank" and self.index == 0) else None,
            "metadata": dict(metadata or {}),
        }
        self.path, self.clock_path = self._choose_paths()
        self._open()  # raises OSError: the caller decides whether that is fatal
        self._thread = threading.Thread(target=self._run, name=f"eddis-timeline-{role}{index}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ recording (any thread)
    def record(self, ph, name, cat, ts_ns, dur_ns, args):
        buf = self._buffer
        if len(buf) < self.capacity:
            ident = _get_ident()
            if ident not in self._threads:  # once per thread: it may be gone when the writer runs
                thread = threading.current_thread()
                self._threads[ident] = (thread.name, thread.native_id, thread is threading.main_thread())
            buf.append((ph, name, cat, ts_ns, dur_ns, ident, args))
        else:
            self.dropped += 1

    def begin(self, name, cat=None, args=None):
        self.record("B", name, cat, perf_ns(), 0, args)

    def end(self, name, cat=None, args=None):
        self.record("E", name, cat, perf_ns(), 0, args)

    def complete(self, name, start_ns, end_ns=None, cat=None, args=None):
        """An event that ran from ``start_ns`` to ``end_ns`` (``perf_counter_ns`` values)."""
        if end_ns is None:
            end_ns = perf_ns()
        self.record("X", name, cat, start_ns, end_ns - start_ns, args)

    def instant(self, name, cat=None, args=None):
        self.record("i", name, cat, perf_ns(), 0, args)

    def counter(self, name, values, cat=None):
        """A counter track (``values``: dict of series name -> number)."""
        self.record("C", name, cat, perf_ns(), 0, values)

    def span(self, name, cat=None, args=None):
        return _Span(self, name, cat, args)

    def set_clock_offset(self, offset_ns, uncertainty_ns, method, samples=None):
        """Record that rank 0's monotonic clock reads ``local + offset_ns`` (+- uncertainty)."""
        self.clock.update(offset_to_rank0_ns=int(offset_ns), uncertainty_ns=int(uncertainty_ns),
                          offset_method=method)
        if samples is not None:
            self.clock["offset_samples"] = int(samples)
        self._write_clock()

    # ------------------------------------------------------------ lifecycle
    def close(self):
        """Write what is buffered, close the file (valid JSON), stop the writer thread."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        with self._write_lock:
            self._drain()
            if not self.failed and self._file is not None:
                self._write("\n]\n")
            self._close_file()

    def flush(self):
        """Write what is buffered now (the writer thread does this on its own)."""
        with self._write_lock:
            self._drain()

    # ------------------------------------------------------------ writer side
    def _choose_paths(self):
        stem = f"{self.role}-{self.index}"
        key = (os.path.abspath(self.directory), stem)
        # A second window (start_timeline after stop_timeline) must not erase the first.
        window = _WINDOWS.get(key, 0)
        _WINDOWS[key] = window + 1
        name = stem if window == 0 else f"{stem}.w{window}"
        return self.directory / f"{name}.trace.json", self.directory / f"{name}.clock.json"

    def _open(self):
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")
            meta = [
                {"name": "process_name", "ph": "M", "pid": self._pid, "tid": 0, "args": {"name": self.label}},
                {"name": "process_sort_index", "ph": "M", "pid": self._pid, "tid": 0,
                 "args": {"sort_index": self.index + (0 if self.role == "rank" else 1_000_000)}},
            ]
            self._file.write("[\n" + ",\n".join(json.dumps(m, separators=(",", ":")) for m in meta))
            self._file.flush()
            self._dump_clock()
        except OSError:
            self._close_file()
            raise

    def _dump_clock(self):
        tmp = self.clock_path.with_name(self.clock_path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(dict(self.clock, trace=self.path.name), f, indent=1)
        os.replace(tmp, self.clock_path)

    def _write_clock(self):
        if self.failed:
            return
        try:
            self._dump_clock()
        except OSError as exc:
            self._fail(exc)

    def _run(self):
        while not self._stop.wait(self.flush_interval):
            with self._write_lock:
                self._drain()

    def _drain(self):
        buf = self._buffer
        n = len(buf)
        if self.failed:
            buf.clear()
            return
        if n == 0 and self.dropped == self._reported_dropped:
            return
        fmt = self._format
        pop = buf.popleft
        while n > 0 and not self.failed:
            take = min(n, _DRAIN_CHUNK)
            n -= take
            text = ",\n".join([fmt(pop()) for _ in range(take)])
            self._write(",\n" + text)
            if n:
                time.sleep(0)  # let the training thread have the GIL between chunks
        if self.dropped != self._reported_dropped and not self.failed:
            self._write(",\n" + fmt(("i", "events_dropped", "eddis", perf_ns(), 0, _get_ident(),
                                     {"dropped_total": self.dropped, "capacity": self.capacity})))
            self._reported_dropped = self.dropped
        if not self.failed:
            try:
                self._file.flush()
            except OSError as exc:
                self._fail(exc)

    def _format(self, ev):
        ph, name, cat, ts, dur, ident, args = ev
        tid = self._tids.get(ident)
        prefix = ""
        if tid is None:
            tid, prefix = self._new_thread(ident)
        if cat is None:
            cat = DEFAULT_CATEGORY.get(name, "eddis")
        quoted = self._names.get(name)
        if quoted is None:
            quoted = self._names[name] = json.dumps(name)
        text = '{"name":%s,"cat":"%s","ph":"%s","ts":%.3f,"pid":%d,"tid":%d' % (
            quoted, cat, ph, ts / 1000.0, self._pid, tid)
        if ph == "X":
            text += ',"dur":%.3f' % (dur / 1000.0)
        elif ph == "i":
            text += ',"s":"t"'
        if args:
            text += ',"args":' + _encode_args(args)
        return prefix + text + "}"

    def _new_thread(self, ident):
        name, native_id, is_main = self._threads.get(ident, (None, None, False))
        tid = native_id or (len(self._tids) + 1)
        name = "main" if is_main else (name or f"thread {tid}")
        self._tids[ident] = tid
        meta = [{"name": "thread_name", "ph": "M", "pid": self._pid, "tid": tid, "args": {"name": name}},
                {"name": "thread_sort_index", "ph": "M", "pid": self._pid, "tid": tid,
                 "args": {"sort_index": 0 if name == "main" else len(self._tids)}}]
        return tid, "".join(json.dumps(m, separators=(",", ":")) + ",\n" for m in meta)

    def _write(self, text):
        if self.failed or self._file is None:
            return
        try:
            self._file.write(text)
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc):
        if self.failed:
            return
        self.failed = True
        self._buffer.clear()
        warnings.warn(
            f"EDDIS timeline turned off: cannot write {self.path} ({exc}). Training goes on "
            f"without a timeline for {self.label}; point EDDIS_TIMELINE at a writable directory "
            f"with free space to get one.", TimelineWarning, stacklevel=2)
        global _timeline
        if _timeline is self:
            _timeline = None
        self._close_file()

    def _close_file(self):
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass  # already reported by _fail; a second error says nothing new


_WINDOWS = {}  # (directory, stem) -> windows opened by this process


class _Span:
    __slots__ = ("timeline", "name", "cat", "args", "start")

    def __init__(self, timeline, name, cat, args):
        self.timeline = timeline
        self.name = name
        self.cat = cat
        self.args = args

    def __enter__(self):
        self.start = perf_ns()
        return self

    def __exit__(self, *exc):
        start = self.start
        self.timeline.record("X", self.name, self.cat, start, perf_ns() - start, self.args)
        return False

    def set(self, key, value):
        """Add an argument known only inside the span (bytes moved, ...)."""
        if self.args is None:
            self.args = {}
        self.args[key] = value


class _NullSpan:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def set(self, key, value):
        pass


NULL_SPAN = _NullSpan()


class NullTimeline:
    """Stands in for a timeline that is off: every method does nothing."""

    failed = False
    closed = True

    def record(self, *a):
        pass

    def begin(self, name, cat=None, args=None):
        pass

    def end(self, name, cat=None, args=None):
        pass

    def complete(self, name, start_ns, end_ns=None, cat=None, args=None):
        pass

    def instant(self, name, cat=None, args=None):
        pass

    def counter(self, name, values, cat=None):
        pass

    def span(self, name, cat=None, args=None):
        return NULL_SPAN

    def set_clock_offset(self, *a, **k):
        pass

    def flush(self):
        pass

    def close(self):
        pass

    def __bool__(self):
        return False


NULL_TIMELINE = NullTimeline()

# ---------------------------------------------------------------- the process's active timeline
_timeline = None
_default_comm = None  # the EDDIS runtime's communicator, while it runs (set_default_comm)


def set_default_comm(provider):
    """``provider()`` gives the communicator start_timeline() uses when given none (None: stop).

    The runtime sets it at eddis.init(), so a user's ``eddis.start_timeline()`` is
    collective over the job and aligns the clocks, while this module stays a leaf."""
    global _default_comm
    _default_comm = provider


def enabled():
    return _timeline is not None


def active():
    """The active :class:`Timeline` of this process, or None."""
    return _timeline


def begin(name, cat=None, args=None):
    tl = _timeline
    if tl is not None:
        tl.record("B", name, cat, perf_ns(), 0, args)


def end(name, cat=None, args=None):
    tl = _timeline
    if tl is not None:
        tl.record("E", name, cat, perf_ns(), 0, args)


def complete(name, start_ns, end_ns=None, cat=None, args=None):
    """Record a finished interval measured with ``perf_counter_ns`` (cheapest for hot paths)."""
    tl = _timeline
    if tl is not None:
        if end_ns is None:
            end_ns = perf_ns()
        tl.record("X", name, cat, start_ns, end_ns - start_ns, args)


def instant(name, cat=None, args=None):
    tl = _timeline
    if tl is not None:
        tl.record("i", name, cat, perf_ns(), 0, args)


def counter(name, values, cat=None):
    tl = _timeline
    if tl is not None:
        tl.record("C", name, cat, perf_ns(), 0, values)


def span(name, cat=None, args=None):
    """``with span(PUSH, args={"bucket": 3}) as s: ...`` -> one complete ("X") event."""
    tl = _timeline
    if tl is None:
        return NULL_SPAN
    return _Span(tl, name, cat, args)


def _identity(rank, role, index):
    if index is None:
        index = rank if rank is not None else (identity.launcher_rank() or 0)
    return role, int(index)


def open_timeline(directory, role="rank", index=None, rank=None, label=None, metadata=None,
                  capacity=None, flush_interval=0.25):
    """A :class:`Timeline` writing into ``directory``, or None (after one warning) if it cannot."""
    from .. import settings

    role, index = _identity(rank, role, index)
    if label is None:
        if role == "rank":
            gpu = identity.gpu_type()
            label = f"rank {index} ({identity.node_name()}{', ' + gpu if gpu else ''})"
        else:
            label = f"SMB {role} {index} ({identity.node_name()})"
    if capacity is None:
        capacity = settings.get("EDDIS_TIMELINE_BUFFER")
    try:
        return Timeline(directory, role=role, index=index, label=label, capacity=capacity,
                        flush_interval=flush_interval, metadata=metadata)
    except OSError as exc:
        warnings.warn(
            f"EDDIS timeline turned off: cannot write to {directory} ({exc}). Training goes on "
            f"without a timeline; point EDDIS_TIMELINE at a writable directory to get one.",
            TimelineWarning, stacklevel=2)
        return None


def start_timeline(directory=None, rank=None, role="rank", index=None, label=None, comm=None,
                   metadata=None):
    """Start this process's timeline in ``directory`` (default: ``EDDIS_TIMELINE``).

    With ``comm`` (an mpi4py communicator; collective over it) the clock offset to
    its rank 0 is measured right away; after ``eddis.init()`` the runtime's
    communicator is the default, so every rank must call it. Returns the :class:`Timeline`, or None when
    no directory is set or it cannot be written (one warning; training goes on).
    """
    global _timeline
    from .. import settings

    if directory is None:
        directory = settings.get("EDDIS_TIMELINE")
    if comm is None and role == "rank" and _default_comm is not None:
        comm = _default_comm()  # inside an EDDIS job: collective, so the clocks get aligned
    if comm is not None and rank is None and index is None:
        rank = comm.Get_rank()
    if not directory:
        tl = None
    else:
        if _timeline is not None:
            stop_timeline()
        tl = open_timeline(directory, role=role, index=index, rank=rank, label=label, metadata=metadata)
        _timeline = tl
    if comm is not None:
        sync_clock_mpi(comm, tl)  # collective: every rank takes part even if its file failed
    return tl


def stop_timeline():
    """Write out and close this process's timeline (a no-op when none is active)."""
    global _timeline
    tl, _timeline = _timeline, None
    if tl is not None:
        tl.close()
    return tl


def for_server(index, directory=None, metadata=None):
    """The timeline of SMB server ``index`` (``EDDIS_TIMELINE``), or :data:`NULL_TIMELINE`."""
    from .. import settings

    if directory is None:
        directory = settings.get("EDDIS_TIMELINE")
    if not directory:
        return NULL_TIMELINE
    tl = open_timeline(directory, role="server", index=index, metadata=metadata)
    return tl if tl is not None else NULL_TIMELINE
