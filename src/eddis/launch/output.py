"""Copy a child's stdout/stderr line by line with a ``[rank@host] `` prefix.

Each stream gets a thread that reads whole lines from the pipe and writes them,
prefixed, to our own stream with a flush per line, so the lines of many ranks
interleave whole and none is held in a buffer when the job is killed. A last line
without a newline is still written (with one). The stderr pump also keeps the
first Python traceback it sees, or the stack :mod:`faulthandler` wrote on a fatal
signal, for the root-cause report.

An exception's message may span lines after its ``Type: message`` line: TensorFlow's
"in user code:" and "Graph execution error:" name the user's line and the real error
there, Keras's "Exception encountered when calling ..." has a blank line and then the
error. A message line that ends with ":" or is followed by a blank line goes on until
what cannot be part of it: another traceback, EDDIS's or TensorFlow's own log lines,
Open MPI's banners, or TensorFlow's closing ``[Op:name]``.
"""
import collections
import re
import threading

TRACEBACK_START = b"Traceback (most recent call last):"
FATAL_START = "Fatal Python error:"        # faulthandler, on SIGSEGV, SIGABRT, ...
FATAL_END = "Extension modules:"           # the line after its stacks
MAX_TRACEBACK_LINES = 80
LAST_FRAME_LINES = 20       # of a longer traceback: its first lines, "...", and these last ones
MAX_MESSAGE_LINES = 40      # of a longer message: its first lines, "...", and the last ones
LAST_MESSAGE_LINES = 20
MESSAGE_SCAN_LINES = 400    # a message "going on" longer than this is the stderr of a live process
NOT_MESSAGE = re.compile(r"Traceback \(most recent call last\):|During handling of the above exception"
                         r"|The above exception was the direct cause|Fatal Python error:"
                         r"|eddis(-train)?: |[IWEF]\d{4} \d\d:\d\d:\d\d|-{20}")
MESSAGE_END = re.compile(r"\[Op:[^\]]*\]\s*$")   # TensorFlow's last line of an op's error
# the trainer's runner in TensorFlow's "Detected at node ... defined at" frames, which
# stand each on a line followed by a blank one: not the user's, left out as in tracebacks
RUNNER_FRAME = re.compile(r'\s+File "(<frozen runpy>|[^"]*[\\/]eddis[\\/]launch[\\/]child\.py)", line')


def fatal_stack(lines):
    """faulthandler's report cut to what names the crash: its first line and the stack of
    the thread that took the signal ("Current thread"), or every stack when no Python
    thread took it (a native one did)."""
    for i, text in enumerate(lines):
        if text.startswith("Current thread"):
            end = next((j for j in range(i, len(lines)) if not lines[j].strip()), len(lines))
            return "\n".join([lines[0]] + lines[i:end][:MAX_TRACEBACK_LINES])
    return "\n".join(lines[:MAX_TRACEBACK_LINES]).rstrip()


class HeadAndTail:
    """The first ``head`` and the last ``tail`` lines of a sequence, "    ..." between them
    where lines were left out."""

    def __init__(self, head, tail):
        self.head, self.tail = [], collections.deque(maxlen=tail)
        self.head_size = head
        self.left_out = 0

    def append(self, text):
        if len(self.head) < self.head_size:
            self.head.append(text)
        else:
            self.left_out += len(self.tail) == self.tail.maxlen
            self.tail.append(text)

    def lines(self):
        return self.head + (["    ..."] if self.left_out else []) + list(self.tail)


class TracebackCatcher:
    """Keeps the first traceback (start line to the end of the exception's message; of a
    long one, its first and last frames), or faulthandler's stack on a fatal signal, and a
    short tail."""

    def __init__(self, tail_lines=20):
        self.first = None
        self.tail = collections.deque(maxlen=tail_lines)
        self._current = None     # faulthandler's lines, or the traceback's frames (HeadAndTail)
        self._message = None     # the exception's lines once its first one was seen
        self._goes_on = False    # whether its message announced more lines
        self._message_lines = 0
        self._after_runner_frame = False
        self._fatal = False

    def feed(self, line):
        text = line.rstrip(b"\r\n").decode("utf-8", "replace")
        self.tail.append(text)
        if self.first is not None:
            return
        if self._message is not None:
            self._feed_message(text)
            return
        if self._current is None:
            self._fatal = text.startswith(FATAL_START)
            if self._fatal:
                self._current = [text]
            elif line.startswith(TRACEBACK_START):
                # the frames nearest the error are the ones that name it
                self._current = HeadAndTail(MAX_TRACEBACK_LINES - LAST_FRAME_LINES, LAST_FRAME_LINES)
                self._current.append(text)
            return
        if self._fatal:
            if text.startswith(FATAL_END) or len(self._current) >= 4 * MAX_TRACEBACK_LINES:
                self.first = fatal_stack(self._current)
                self._current = None
            else:
                self._current.append(text)
            return
        # Frames are indented; the first unindented line is "ExcType: message".
        if text and not text[0].isspace():
            # TensorFlow's real error is its message's last line
            self._message = HeadAndTail(MAX_MESSAGE_LINES, LAST_MESSAGE_LINES)
            self._message.append(text)
            self._goes_on = text.endswith(":")
        else:
            self._current.append(text)

    def _feed_message(self, text):
        if not self._goes_on and self._message_lines == 0:
            self._goes_on = not text.strip()   # Keras: a blank line, then the error
        if not self._goes_on or NOT_MESSAGE.match(text):
            self._finish()
            return
        self._message_lines += 1
        after_runner_frame, self._after_runner_frame = self._after_runner_frame, False
        if RUNNER_FRAME.match(text):
            self._after_runner_frame = True
        elif text.strip() or not after_runner_frame:
            self._message.append(text)
        if MESSAGE_END.search(text) or self._message_lines >= MESSAGE_SCAN_LINES:
            self._finish()

    def _finish(self):
        message = self._message.lines()
        while not message[-1].strip():
            message.pop()
        self.first = "\n".join(self._current.lines() + message)
        self._current = self._message = None

    def result(self):
        if self.first is not None:
            return self.first
        if self._message is not None:   # the process ended right after its message
            self._finish()
            return self.first
        if self._current:  # the process died in the middle of printing it
            return fatal_stack(self._current) if self._fatal else "\n".join(self._current.lines())
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
