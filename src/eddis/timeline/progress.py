"""Rank 0's training progress: a tqdm bar on a terminal, plain log lines otherwise.

Slurm output files are not terminals; there a bar would write thousands of
carriage-return updates, so we print one line every ``EDDIS_PROGRESS_INTERVAL``
seconds instead::

    [eddis] step 120/1000 (12.0%)  345.6 samples/s  41472 samples  loss 0.1234  elapsed 0:01:02  eta 0:07:37

When no update says how many samples its step had (``samples=None``), the line
counts steps instead, and says so (``steps/s``): a rate in samples that is really
one in steps would be off by the batch size.

``EDDIS_PROGRESS``: auto (bar if stdout is a TTY, else log), bar, log, off.
Ranks other than 0 show nothing.

The runtime drives one automatically on rank 0 (one update per optimizer step: a
step whose closure evaluates several times, LBFGS's, is one; samples = the sum of every
rank's sample count where the step's reduction adds them up, else this rank's count x
ranks, when it is known); a training script adds the loss with ``report_loss(loss)`` and may set the total number
of steps with ``set_total(n)``. A run shorter than one log interval prints
nothing. A script can also make its own: ``with Progress(total=n) as p:
p.update(samples=b, loss=l)``.
"""
import sys
import time


def _hms(seconds):
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """``update(steps=1, samples=n, loss=x)`` once per step; ``close()`` at the end.
    ``samples=None`` (unknown): the display counts steps, unless other updates gave samples."""

    def __init__(self, total=None, rank=0, desc="train", mode=None, interval=None, stream=None,
                 final_line=True):
        from .. import settings

        self.stream = stream if stream is not None else sys.stdout
        mode = mode or settings.get("EDDIS_PROGRESS")
        if rank != 0 or mode == "off":
            mode = "off"
        elif mode == "auto":
            isatty = getattr(self.stream, "isatty", None)
            mode = "bar" if isatty is not None and isatty() else "log"
        self.mode = mode
        self.total = total
        self.desc = desc
        self.interval = settings.get("EDDIS_PROGRESS_INTERVAL") if interval is None else float(interval)
        self.final_line = final_line
        self.lines = 0
        self.steps = 0
        self.samples = 0
        self.loss = None
        self._start = self._last_log = time.monotonic()
        self._window_start, self._window_samples, self._window_steps = self._start, 0, 0
        self.counts_samples = False   # some update said how many samples its step had
        self._rate = 0.0
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="step", file=self.stream, dynamic_ncols=True)

    @property
    def unit(self):
        return "samples" if self.counts_samples else "steps"

    def _count(self):
        return self.samples if self.counts_samples else self.steps

    def update(self, steps=1, samples=None, loss=None):
        if self.mode == "off":
            return
        self.steps += steps
        self._window_steps += steps
        if samples is not None:
            self.counts_samples = True
            self.samples += samples
            self._window_samples += samples
        if loss is not None:
            self.loss = float(loss)
        now = time.monotonic()
        window = self._window_samples if self.counts_samples else self._window_steps
        if now - self._window_start >= 1.0:
            self._rate = window / (now - self._window_start)
            self._window_start, self._window_samples, self._window_steps = now, 0, 0
        elif self._rate == 0.0 and now > self._start:
            self._rate = self._count() / (now - self._start)
        if self._bar is not None:
            post = {f"{self.unit}/s": f"{self._rate:.1f}"}
            if self.loss is not None:
                post["loss"] = f"{self.loss:.4g}"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(steps)
        elif now - self._last_log >= self.interval:
            self._last_log = now
            self._log(now)

    def line(self, now=None):
        now = time.monotonic() if now is None else now
        elapsed = now - self._start
        if self.total:
            text = f"[eddis] {self.desc} step {self.steps}/{self.total} ({100.0 * self.steps / self.total:.1f}%)"
        else:
            text = f"[eddis] {self.desc} step {self.steps}"
        text += f"  {self._rate:.1f} {self.unit}/s"
        if self.counts_samples:
            text += f"  {self.samples} samples"
        if self.loss is not None:
            text += f"  loss {self.loss:.4g}"
        text += f"  elapsed {_hms(elapsed)}"
        if self.total and self.steps:
            text += f"  eta {_hms(elapsed / self.steps * (self.total - self.steps))}"
        return text

    def _log(self, now=None):
        self.lines += 1
        try:
            print(self.line(now), file=self.stream, flush=True)
        except (OSError, ValueError):  # a closed or broken stdout must not stop training
            self.mode = "off"

    def close(self):
        if self.mode == "off":
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.final_line or self.lines:
            elapsed = time.monotonic() - self._start
            if elapsed > 0:
                self._rate = self._count() / elapsed
            self._log()
        self.mode = "off"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


_active = None  # the runtime's automatic progress display (rank 0), or None


def report_loss(loss):
    """Show ``loss`` (a number or a one-element tensor) in the runtime's progress display."""
    if _active is not None:
        _active.loss = float(loss)


def set_total(steps):
    """Total steps of the run, for the percentage and the ETA of the runtime's display."""
    if _active is not None:
        _active.total = int(steps)
        if _active._bar is not None:
            _active._bar.total = int(steps)
            _active._bar.refresh()
