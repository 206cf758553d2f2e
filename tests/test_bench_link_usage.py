"""bench/link_usage.py: the share of the time a link of the emulated cluster idles."""
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import link_usage  # noqa: E402

RATE = 100e6   # bytes/s


def samples_of(per_interval, dt=0.01):
    """Counters of two nodes after each interval of ``dt`` s that moved ``per_interval``
    [(n1 tx, n1 rx, n2 tx, n2 rx) bytes per second]."""
    t, c = 0.0, {"n1": {"tx": 0, "rx": 0}, "n2": {"tx": 0, "rx": 0}}
    out = [(t, {n: dict(w) for n, w in c.items()})]
    for rates in per_interval:
        t += dt
        for (node, way), r in zip((("n1", "tx"), ("n1", "rx"), ("n2", "tx"), ("n2", "rx")), rates):
            c[node][way] += int(r * dt)
        out.append((t, {n: dict(w) for n, w in c.items()}))
    return out


def test_idle_is_the_share_of_intervals_below_the_threshold_per_node_and_way():
    busy, idle, trickle = RATE, 0, 0.04 * RATE    # a trickle below 5 % of the rate counts as idle
    intervals = ([(busy, busy, busy, idle)] * 6 + [(idle, busy, trickle, idle)] * 2
                 + [(idle, idle, idle, idle)] * 2)
    shares = link_usage.idle_shares(samples_of(intervals), RATE, ["n1", "n2"])
    assert shares["n1"]["tx"] == pytest.approx(0.4)
    assert shares["n1"]["rx"] == pytest.approx(0.2)
    assert shares["n2"]["tx"] == pytest.approx(0.4)
    assert shares["n2"]["rx"] == pytest.approx(1.0)
    assert link_usage.link_mean(shares) == pytest.approx(0.5)


def test_too_few_samples_say_unknown():
    assert link_usage.idle_shares(samples_of([])[:1], RATE, ["n1"]) is None
    assert link_usage.link_mean(None) is None


def test_the_sampler_reads_until_stopped_and_ends_with_a_last_sample():
    reads = []

    def read():
        reads.append(time.monotonic())
        return {"n1": {"tx": len(reads), "rx": 0}}

    sampler = link_usage.Sampler(read, interval=0.005).start()
    time.sleep(0.1)
    samples = sampler.stop()
    count = len(samples)
    time.sleep(0.05)
    assert len(reads) == count >= 3          # nothing read after stop()
    assert [s[1]["n1"]["tx"] for s in samples] == list(range(1, count + 1))
    assert all(a[0] <= b[0] for a, b in zip(samples, samples[1:]))


def test_busy_rate_is_what_the_working_intervals_carried_per_node_and_way():
    full, half, idle, trickle = RATE, 0.5 * RATE, 0, 0.04 * RATE   # a trickle counts as idle
    intervals = ([(full, half, full, idle)] * 4 + [(half, half, trickle, idle)] * 4
                 + [(idle, idle, idle, idle)] * 2)
    rates = link_usage.busy_rates(samples_of(intervals), RATE, ["n1", "n2"])
    assert rates["n1"]["tx"] == pytest.approx(0.75, rel=1e-3)   # 4 full and 4 half intervals
    assert rates["n1"]["rx"] == pytest.approx(0.5, rel=1e-3)
    assert rates["n2"]["tx"] == pytest.approx(1.0, rel=1e-3)    # the trickle is not work
    assert rates["n2"]["rx"] is None                            # this way never worked
    assert link_usage.link_mean(rates) == pytest.approx(0.75, rel=1e-3)
    assert link_usage.busy_rates(samples_of([])[:1], RATE, ["n1"]) is None
