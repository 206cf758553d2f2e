"""bench/sync_stages.py: the stages of a synchronous step, read from timeline events."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import sync_stages  # noqa: E402


def step_events(step, t0, rank=0):
    """One step of two buckets as the reducers and the optimizer record it, from t0 (us)."""
    ev = []

    def span(name, start, dur, **args):
        ev.append({"ph": "X", "pid": rank, "name": name, "ts": t0 + start, "dur": dur, "args": args})

    for k, ready in ((0, 100), (1, 200)):
        ev.append({"ph": "i", "pid": rank, "name": "bucket_ready", "ts": t0 + ready,
                   "args": {"step": step, "bucket": k}})
        span("reduce", ready + 10, 20, step=step, bucket=k, count=5, by="node")
        span("push", ready + 30, 40, step=step, bucket=k, requests=1)
        span("push", ready, 80, step=step, bucket=k, bytes=64)            # the submit thread's
        span("pull", ready + 300, 50, step=step, bucket=k, count=5)
        span("pull", ready + 80, 280, step=step, bucket=k)                 # the finish thread's
        span("wait", ready + 250, 110, step=step, bucket=k)
        span("optimizer_step", ready + 360, 40, bucket=k)
    return ev


def test_stages_are_placed_from_the_step_start_and_the_totals_add_up():
    events = []
    for step in range(6):
        events += step_events(step, step * 1000)
    stages, starts, updates_of = sync_stages.steps_of(events, 0)
    # step s starts where step s-1's last update ended: 200 + 360 + 40 = 600 us into it
    assert starts[3] == 2000 + 600
    count, med, totals = sync_stages.summarize(stages, starts, updates_of, skip=1)
    # step 0 has no start (no update before it), skip=1 drops step 1, step 5 has no next step
    assert count == 3
    # bucket 0 ready 100 us into its step, i.e. 1000 - 600 + 100 = 500 us after the step start
    assert med["ready"][0] == pytest.approx((0.5, 0.5))
    assert med["sum"][1] == pytest.approx((0.61, 0.63))
    assert med["done"][1] == pytest.approx((0.96, 0.96))
    assert med["update"][1] == pytest.approx((0.96, 1.0))
    assert totals["step ms"] == pytest.approx(1.0)
    assert totals["wait ms"] == pytest.approx(0.22)
    assert totals["update ms"] == pytest.approx(0.08)
    assert totals["last ready -> last done ms"] == pytest.approx(0.36)


def test_other_ranks_and_servers_are_kept_apart():
    events = step_events(0, 0, rank=0) + step_events(0, 0, rank=1) + step_events(1, 1000, rank=1)
    events.append({"ph": "X", "pid": 100000, "name": "reduce", "ts": 5, "dur": 5, "args": {"step": 0}})
    stages, _, _ = sync_stages.steps_of(events, 0)
    assert set(stages) == {0}
    assert sorted(stages[0]["ready"]) == [0, 1]
