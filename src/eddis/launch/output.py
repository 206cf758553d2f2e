"""Copy a child's stdout/stderr line by line with a ``[rank@host] `` prefix.

Each stream gets a thread that reads whole lines from the pipe and writes them,
prefixed, to our own stream with a flush per line, so the lines of many ranks
interleave whole and none is held in a buffer when the job is killed. A last line
without a newline is still written (with one). The stderr pump also keeps the
first Python traceback it sees, or the stack :mod:`faulthandler` wrote on a fatal
signal, for the root-cause report.
"""
import collections
import threading

TRACEBACK_START = b"Traceback (most recent call last):"
FATAL_START = "Fatal Python error:"        # faulthandler, on SIGSEGV, SIGABRT, ...
FATAL_END = "Extension modules:"           # the line after its stacks
MAX_TRACEBACK_LINES = 80


def fatal_stack(lines):
    """faulthandler's report cut to what names the crash: its first line and the stack of
    the thread that took the signal ("Current thread"), or every stack when no Python
    thread took it (a native one did)."""
    for i, text in enumerate(lines):
        if text.startswith("Current thread"):
            end = next((j for j in range(i, len(lines)) if not lines[j].strip()), len(lines))
            return "\n".join([lines[0]] + lines[i:end][:MAX_TRACEBACK_LINES])
    return "\n".join(lines[:MAX_TRACEBACK_LINES]).rstrip()


class TracebackCatcher:
    """Keeps the first traceback (start line to exception line), or faulthandler's stack on a
    fatal signal, and a short tail."""

    def __init__(self, tail_lines=20):
        self.first = None
        self.tail = collections.deque(maxlen=tail_lines)
        self._current = None
        self._fatal = False

    def feed(self, line):
        text = line.rstrip(b"\r\n").decode("utf-8", "replace")
        self.tail.append(text)
        if self.first is not None:
            return
        if self._current is None:
            self._fatal = text.startswith(FATAL_START)
            if self._fatal or line.startswith(TRACEBACK_START):
                self._current = [text]
            return
        if self._fatal:
            if text.startswith(FATAL_END) or len(self._current) >= 4 * MAX_TRACEBACK_LINES:
                self.first = fatal_stack(self._current)
                self._current = None
            else:
                self._current.append(text)
            return
        self._current.append(text)
        # Frames are indented; the first unindented line is "ExcType: message".
        if text and not text[0].isspace():
            self.first = "\n".join(self._current[:MAX_TRACEBACK_LINES])
            self._current = None
        elif len(self._current) > MAX_TRACEBACK_LINES:
            self.first = "\n".join(self._current[:MAX_TRACEBACK_LINES] + ["    ..."])
            self._current = None

    def result(self):
        if self.first is not None:
            return self.first
        if self._current:  # the process died in the middle of printing it
            return fatal_stack(self._current) if self._fatal else "\n".join(self._current)
        return None


class LinePump(threading.Thread):
    """Reads ``source`` (a binary pipe) until EOF, writing prefixed lines to ``sink``."""

    def __init__(self, source, sink, prefix, lock, catcher=None):
        super().__init__(daemon=True)
        self.source = source
        self.sink = sink  # a binary stream, e.g. sys.stdout.buffer
        self.prefix = prefix.encode()
        self.lock = lock
        self.catcher = catcher

    def run(self):
        try:
            for line in iter(self.source.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                if self.catcher is not None:
                    self.catcher.feed(line)
                with self.lock:
                    try:
                        self.sink.write(self.prefix + line)
                        self.sink.flush()
                    except (OSError, ValueError):
                        pass  # our own output is gone (srun or mpirun died); keep draining the child
        finally:
            self.source.close()
