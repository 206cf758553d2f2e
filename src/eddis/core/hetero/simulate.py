"""Simulated heterogeneity: a TESTING AID that makes some ranks compute slower.

EDDIS exists for clusters that mix GPU generations (say A100 and V100), where
a synchronous step waits for the slowest GPU. To test and benchmark the
heterogeneity modes (easgd, hybrid, balanced sync) on identical hardware, or
on CPU-only machines such as CI, set::

    EDDIS_SIMULATE_SLOWDOWN="0:1.0,1:2.0"     # rank 1 computes at half speed
    EDDIS_SIMULATE_SLOWDOWN="g1:2.0"          # every rank of group 1 (EDDIS_GROUP)
    EDDIS_SIMULATE_SLOWDOWN="*:1.5,0:1"       # all ranks 1.5x slower except rank 0

A rank with factor ``f`` sleeps ``(f - 1) x`` its measured compute time after
each step's local work (forward, backward, data loading: everything between
two ``optimizer.step()`` calls, without the time spent waiting in
``eddis.should_stop()``), so its throughput drops to ``1/f`` of what it was.
A rank entry wins over a group entry, which wins over ``*``; ranks not named
run at factor 1. Factors below 1 are refused (a rank cannot be made faster).

This is *not* a tuning knob: it wastes time on purpose. Every slowed rank
warns once at start; unset the variable for real training.

    spec = parse_slowdown("0:1.0,g1:2.0")
    factor = slowdown_factor(spec, rank=3, group=1)      # 2.0
    slowdown = Slowdown(factor)
    slowdown.stretch(elapsed_compute_s)                    # sleeps (factor-1) x elapsed
"""
import time
import warnings

from ... import settings
from ...errors import ConfigError, EddisWarning

_FORMAT_HELP = ("Write EDDIS_SIMULATE_SLOWDOWN as comma-separated KEY:FACTOR entries, KEY a rank "
                "number (e.g. 1), a group gN (e.g. g1) or * for every rank, FACTOR >= 1, "
                "e.g. '0:1.0,1:2.0' or 'g1:2.0'.")


class SimulatedSlowdownWarning(EddisWarning):
    """EDDIS_SIMULATE_SLOWDOWN is set: this run is slowed down on purpose."""


def parse_slowdown(text):
    """``{"ranks": {r: f}, "groups": {g: f}, "default": f}`` from the setting's text."""
    spec = {"ranks": {}, "groups": {}, "default": 1.0}
    if text is None or not str(text).strip():
        return spec
    for entry in str(text).split(","):
        entry = entry.strip()
        if not entry:
            continue
        key, sep, value = entry.partition(":")
        key = key.strip().lower()
        if not sep or not key:
            raise ConfigError(f"EDDIS_SIMULATE_SLOWDOWN entry {entry!r} has no KEY:FACTOR form. {_FORMAT_HELP}")
        try:
            factor = float(value)
        except ValueError:
            raise ConfigError(f"EDDIS_SIMULATE_SLOWDOWN entry {entry!r}: {value!r} is not a number. "
                              f"{_FORMAT_HELP}") from None
        if not factor >= 1.0 or factor != factor or factor == float("inf"):
            raise ConfigError(f"EDDIS_SIMULATE_SLOWDOWN entry {entry!r}: the factor must be a finite "
                              f"number >= 1 (a slowdown; ranks cannot be made faster). {_FORMAT_HELP}")
        if key == "*":
            spec["default"] = factor
        elif key.startswith("g") and key[1:].isdigit():
            spec["groups"][int(key[1:])] = factor
        elif key.isdigit():
            spec["ranks"][int(key)] = factor
        else:
            raise ConfigError(f"EDDIS_SIMULATE_SLOWDOWN entry {entry!r}: {key!r} is neither a rank "
                              f"number, a group gN nor *. {_FORMAT_HELP}")
    return spec


def slowdown_factor(spec, rank, group):
    if rank in spec["ranks"]:
        return spec["ranks"][rank]
    if group in spec["groups"]:
        return spec["groups"][group]
    return spec["default"]


def check_ranks(spec, size, num_groups):
    """Refuse entries that name ranks or groups the job does not have (a typo)."""
    bad = [r for r in spec["ranks"] if r >= size]
    if bad:
        raise ConfigError(f"EDDIS_SIMULATE_SLOWDOWN names rank(s) {bad}, but the job has ranks "
                          f"0..{size - 1}. {_FORMAT_HELP}")
    bad = [g for g in spec["groups"] if g >= num_groups]
    if bad:
        raise ConfigError(f"EDDIS_SIMULATE_SLOWDOWN names group(s) {['g%d' % g for g in bad]}, but "
                          f"the job has groups g0..g{num_groups - 1}. {_FORMAT_HELP}")


class Slowdown:
    """Stretches measured compute time by ``factor`` (sleeps the difference)."""

    def __init__(self, factor=1.0):
        self.factor = float(factor)
        self.slept = 0.0   # seconds slept in total, for reports

    @property
    def active(self):
        return self.factor > 1.0

    def stretch(self, elapsed):
        """Sleep ``(factor - 1) x elapsed`` seconds; returns the seconds slept."""
        if self.factor <= 1.0 or elapsed <= 0:
            return 0.0
        extra = (self.factor - 1.0) * elapsed
        time.sleep(extra)
        self.slept += extra
        return extra


def from_settings(rank, group, size=None, num_groups=None):
    """This rank's :class:`Slowdown` from EDDIS_SIMULATE_SLOWDOWN (warns when active)."""
    spec = parse_slowdown(settings.get("EDDIS_SIMULATE_SLOWDOWN"))
    if size is not None and num_groups is not None:
        check_ranks(spec, size, num_groups)
    slowdown = Slowdown(slowdown_factor(spec, rank, group))
    if slowdown.active:
        message = (f"EDDIS_SIMULATE_SLOWDOWN is set: rank {rank} (group {group}) sleeps "
                   f"{slowdown.factor - 1:g}x its compute time every step to simulate a "
                   f"{slowdown.factor:g}x slower GPU. This is a testing aid; unset it for real training.")
        warnings.warn(message, SimulatedSlowdownWarning, stacklevel=2)
    return slowdown
