"""The simulated slowdown's part of the step (EDDIS_SIMULATE_SLOWDOWN, :mod:`.simulate`).

A slowed rank sleeps before its step's first gradient bucket is marked ready, so that its
gradients really leave late, as a slower GPU's would. What it sleeps is stretched from the
last step's compute (the first step's: what it computed until then), and the step's compute
is measured without the sleep."""
import threading
import time

from .hooks import StepHook


class SlowdownHook(StepHook):
    """Sleeps ``slowdown`` into every step of this rank (registered when it is active)."""

    def __init__(self, driver, slowdown, measure_first_step):
        """``measure_first_step=False``: the first step is no measure of this rank's speed (a
        graph framework traces and compiles in it): no sleep in it, nothing learnt from it."""
        self.driver = driver
        self.slowdown = slowdown
        self.measure_first = bool(measure_first_step)
        self._lock = threading.Lock()   # the backward threads of one step race to push first
        self._pushed_step = -1
        self._estimate = None   # the last step's compute seconds, without the sleep
        self._slept = 0.0       # in this step

    def _measured(self, step):
        return step > 0 or self.measure_first

    def before_push(self):
        step = self.driver.step
        if not self._measured(step):
            return
        with self._lock:
            if self._pushed_step == step:
                return
            self._pushed_step = step
        estimate = self._estimate
        if estimate is None:  # first step: what it computed so far
            estimate = time.perf_counter() - self.driver.compute_start()
        self._slept = self.slowdown.stretch(estimate)

    def before_sync(self, elapsed, start, flat):
        step = self.driver.step
        if not self._measured(step):
            return elapsed
        if self._pushed_step != step:  # no bucket was pushed (no gradients): sleep now
            self._pushed_step = step
            self._slept = self.slowdown.stretch(elapsed)
            elapsed += self._slept
        self._estimate = max(0.0, elapsed - self._slept)
        self._slept = 0.0
        return elapsed
