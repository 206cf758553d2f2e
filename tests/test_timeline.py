"""Timeline writer, merge and failure handling in one process (real files, real threads)."""
import json
import subprocess
import textwrap
import threading
import time

import pytest

from conftest import PYTHON, python_env

from eddis import timeline
from eddis.timeline import merge as tlmerge
from eddis.timeline.trace import Timeline, TimelineWarning


@pytest.fixture(autouse=True)
def no_active_timeline():
    yield
    timeline.stop_timeline()


def read_events(path):
    return json.loads(path.read_text())


@pytest.mark.timeout(60)
def test_events_round_trip_as_valid_chrome_json(tmp_path):
    tl = timeline.start_timeline(tmp_path, rank=0)
    assert timeline.enabled() and tl is timeline.active()
    with timeline.span(timeline.PUSH, args={"bucket": 2, "bytes": 4096, "step": 1}) as s:
        s.set("server", 0)
    t0 = timeline.now_ns()
    timeline.complete(timeline.PULL, t0, t0 + 5000, args={"bucket": 2})
    timeline.instant(timeline.BUCKET_READY, args={"bucket": 2, "step": 1})
    timeline.begin(timeline.WAIT)
    timeline.end(timeline.WAIT)
    timeline.counter("inflight", {"buckets": 3})
    worker = threading.Thread(target=lambda: timeline.instant(timeline.COMPRESS), name="comm-thread")
    worker.start()
    worker.join()
    timeline.stop_timeline()
    assert not timeline.enabled()

    events = read_events(tmp_path / "rank-0.trace.json")  # closed file: strict JSON
    by_name = {e["name"]: e for e in events}
    push = by_name["push"]
    assert push["ph"] == "X" and push["cat"] == "comm" and push["dur"] >= 0
    assert push["args"] == {"bucket": 2, "bytes": 4096, "step": 1, "server": 0}
    assert by_name["pull"]["dur"] == pytest.approx(5.0)
    assert by_name["bucket_ready"]["ph"] == "i"
    assert [e["ph"] for e in events if e["name"] == "wait"] == ["B", "E"]
    assert by_name["inflight"]["ph"] == "C" and by_name["inflight"]["args"] == {"buckets": 3}
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"main", "comm-thread"} <= threads
    assert by_name["process_name"]["args"]["name"].startswith("rank 0")
    clock = json.loads((tmp_path / "rank-0.clock.json").read_text())
    assert clock["offset_to_rank0_ns"] == 0 and clock["trace"] == "rank-0.trace.json"


@pytest.mark.timeout(60)
def test_off_is_a_no_op(tmp_path, monkeypatch):
    monkeypatch.delenv("EDDIS_TIMELINE", raising=False)
    assert timeline.start_timeline() is None
    assert not timeline.enabled()
    assert timeline.span(timeline.PUSH) is timeline.NULL_SPAN
    with timeline.span(timeline.PUSH) as s:
        s.set("bytes", 1)
    timeline.instant(timeline.BUCKET_READY)
    timeline.complete(timeline.PULL, timeline.now_ns())
    assert timeline.for_server(0) is timeline.NULL_TIMELINE
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_environment_variable_turns_it_on(tmp_path, monkeypatch):
    monkeypatch.setenv("EDDIS_TIMELINE", str(tmp_path / "tl"))
    monkeypatch.setenv("EDDIS_RANK", "3")
    tl = timeline.start_timeline()
    assert tl is not None and tl.path == tmp_path / "tl" / "rank-3.trace.json"


@pytest.mark.timeout(60)
def test_a_second_window_keeps_the_first(tmp_path):
    timeline.start_timeline(tmp_path, rank=1)
    timeline.instant("first")
    timeline.stop_timeline()
    timeline.start_timeline(tmp_path, rank=1)
    timeline.instant("second")
    timeline.stop_timeline()
    first = [e["name"] for e in read_events(tmp_path / "rank-1.trace.json")]
    second = [e["name"] for e in read_events(tmp_path / "rank-1.w1.trace.json")]
    assert "first" in first and "second" in second
    _, summary = tlmerge.merge_timeline(tmp_path)
    assert summary["ranks"] == [1] and summary["events"] == 2


@pytest.mark.timeout(60)
def test_full_buffer_drops_and_counts(tmp_path):
    tl = Timeline(tmp_path, capacity=10, flush_interval=3600)
    for i in range(25):
        tl.instant("e", args={"i": i})
    assert tl.dropped == 15
    tl.close()
    events = read_events(tl.path)
    assert sum(1 for e in events if e["name"] == "e") == 10
    dropped = [e for e in events if e["name"] == "events_dropped"]
    assert dropped and dropped[-1]["args"]["dropped_total"] == 15


@pytest.mark.timeout(60)
def test_background_thread_writes_while_running(tmp_path):
    tl = Timeline(tmp_path, flush_interval=0.05)
    tl.instant("early")
    deadline = time.monotonic() + 10
    while "early" not in tl.path.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "early" in tl.path.read_text()
    # Not closed yet: merge must accept the missing closing bracket.
    assert [e["name"] for e in tlmerge.load_events(tl.path) if e["ph"] != "M"] == ["early"]
    tl.close()


@pytest.mark.timeout(60)
def test_unwritable_directory_warns_once_and_returns_none(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.warns(TimelineWarning, match="Training goes on") as record:
        tl = timeline.start_timeline(blocker / "timeline", rank=0)
    assert tl is None and not timeline.enabled()
    assert len(record) == 1
    timeline.instant(timeline.PUSH)  # still fine


@pytest.mark.timeout(60)
def test_disk_full_at_open_warns(tmp_path):
    (tmp_path / "rank-0.trace.json").symlink_to("/dev/full")
    with pytest.warns(TimelineWarning, match="No space left"):
        assert timeline.start_timeline(tmp_path, rank=0) is None


TRAIN_WITH_SMALL_FILE_LIMIT = textwrap.dedent("""
    import resource, signal, sys, warnings
    import torch
    from eddis import timeline
    # A file-size limit makes writes fail mid-run (EFBIG) like a disk filling up.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
    tl = timeline.start_timeline(sys.argv[1], rank=0)
    tl.flush_interval = 0.01
    model = torch.nn.Linear(32, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    for step in range(400):
        with timeline.span(timeline.STEP, args={"step": step, "padding": "x" * 100}):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
    timeline.stop_timeline()
    print("trained", step + 1, "steps, failed:", tl.failed, "loss", float(loss))
""")


@pytest.mark.timeout(120)
def test_disk_full_during_training_warns_once_and_training_goes_on(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_WITH_SMALL_FILE_LIMIT)
    proc = subprocess.run([PYTHON, str(script), str(tmp_path / "tl")], env=python_env(),
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert "trained 400 steps, failed: True" in proc.stdout
    assert proc.stderr.count("TimelineWarning") == 1, proc.stderr
    assert "Training goes on" in proc.stderr
    # What was written before the failure is still readable.
    assert any(e["name"] == "step" for e in tlmerge.load_events(tmp_path / "tl" / "rank-0.trace.json"))


def _clock(role, index, domain, perf, wall, offset=None, unc=None, trace=None):
    return {"role": role, "index": index, "label": f"{role} {index}", "pid": 1000 + index,
            "clock_domain": domain, "perf_anchor_ns": perf, "wall_anchor_ns": wall,
            "offset_to_rank0_ns": offset, "uncertainty_ns": unc,
            "offset_method": None if offset is None else "mpi ping-pong",
            "trace": trace or f"{role}-{index}.trace.json"}


def _write_process(directory, clock, events):
    (directory / clock["trace"]).write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + "\n")
    (directory / f"{clock['role']}-{clock['index']}.clock.json").write_text(json.dumps(clock))


@pytest.mark.timeout(60)
def test_merge_aligns_clock_domains(tmp_path):
    # rank 0 and server 0 on host A (one monotonic clock); rank 1 and server 1 on host B,
    # whose monotonic clock is 5 s behind A's (offset +5e9 ns, measured with 40 us uncertainty);
    # server 2 on host C with no measurement: placed by wall clock.
    _write_process(tmp_path, _clock("rank", 0, "A", 0, 10**18),
                   [{"name": "push", "ph": "X", "ts": 1000.0, "dur": 1.0, "pid": 1000, "tid": 1}])
    _write_process(tmp_path, _clock("server", 0, "A", 0, 10**18),
                   [{"name": "reduce", "ph": "X", "ts": 1010.0, "dur": 1.0, "pid": 1000, "tid": 1}])
    _write_process(tmp_path, _clock("rank", 1, "B", 0, 10**18 + 5 * 10**9, offset=5 * 10**9, unc=40_000),
                   [{"name": "push", "ph": "X", "ts": 1000.0 - 5e6 + 20.0, "dur": 1.0, "pid": 1001, "tid": 1}])
    _write_process(tmp_path, _clock("server", 1, "B", 0, 0),
                   [{"name": "reduce", "ph": "X", "ts": 1030.0 - 5e6, "dur": 1.0, "pid": 1001, "tid": 1}])
    # Host C: monotonic 0 corresponds to wall 10**18 + 2 s, so its clock is 2 s behind A's.
    _write_process(tmp_path, _clock("server", 2, "C", 0, 10**18 + 2 * 10**9),
                   [{"name": "reduce", "ph": "X", "ts": 1040.0 - 2e6, "dur": 1.0, "pid": 1002, "tid": 1}])
    out, summary = tlmerge.merge_timeline(tmp_path)
    data = json.loads(out.read_text())
    ts = {(e["pid"], e["name"]): e["ts"] for e in data["traceEvents"] if e.get("ph") == "X"}
    assert ts[(0, "push")] == 0.0
    assert ts[(tlmerge.SERVER_PID_BASE + 0, "reduce")] == pytest.approx(10.0)
    assert ts[(1, "push")] == pytest.approx(20.0)
    assert ts[(tlmerge.SERVER_PID_BASE + 1, "reduce")] == pytest.approx(30.0)  # via rank 1's measurement
    assert ts[(tlmerge.SERVER_PID_BASE + 2, "reduce")] == pytest.approx(40.0)
    clocks = data["otherData"]["eddis_clock"]
    assert clocks["1"]["uncertainty_us"] == 40.0
    assert clocks[str(tlmerge.SERVER_PID_BASE + 1)]["uncertainty_us"] == 40.0
    assert clocks[str(tlmerge.SERVER_PID_BASE + 2)]["uncertainty_us"] is None
    assert summary["ranks"] == [0, 1] and summary["servers"] == [0, 1, 2]
    assert summary["max_uncertainty_us"] is None  # one process only by wall clock
    labels = [e["args"]["labels"] for e in data["traceEvents"] if e["name"] == "process_labels"]
    assert any("uncertainty 40.0 us" in label for label in labels)


@pytest.mark.timeout(60)
def test_merge_without_timeline_says_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="EDDIS_TIMELINE"):
        tlmerge.merge_timeline(tmp_path)
    proc = subprocess.run([PYTHON, "-m", "eddis.timeline.cli", "merge", str(tmp_path)], env=python_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "no timeline" in proc.stderr


@pytest.mark.timeout(60)
def test_module_hooks_record_forward_backward_and_batch(tmp_path):
    import torch

    from eddis.core.comm import observe as instrument
    from eddis.torch import timeline_hooks as torch_hooks

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    timeline.start_timeline(tmp_path, rank=0)
    handles = torch_hooks.trace_module(model)
    try:
        model(torch.randn(5, 8)).sum().backward()
        assert instrument._batch[0] == 5
        for h in handles:
            h.remove()
        # The global hooks (EDDIS_TIMELINE_MODULE_HOOKS): outermost call only; backward ends
        # when the reducer reports the last bucket ready (called directly here).
        torch_hooks.install_global_hooks()
        model(torch.randn(7, 8)).sum().backward()
        torch_hooks.backward_finished()
        assert instrument._batch[0] == 7
    finally:
        torch_hooks.uninstall_global_hooks()
        instrument.note_samples(0)
    timeline.stop_timeline()
    events = read_events(tmp_path / "rank-0.trace.json")
    spans = [(e["name"], e["args"]["step"]) for e in events if e.get("ph") == "X"]
    assert spans.count(("forward", 0)) == 2  # one per mechanism, the outermost module only
    assert spans.count(("backward", 0)) == 2
