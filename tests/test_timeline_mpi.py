"""Timeline of a 4-rank MPI run: clock offsets measured over MPI, merged into one trace.

The worker trains a small torch model on real Open MPI ranks; backward hooks
mark each parameter's gradient ready (BUCKET_READY), a communication thread
pushes the buckets (MPI allreduce, PUSH) as they arrive, and the training thread
waits (WAIT) before the optimizer step.
"""
import json
import queue
import sys
import threading

import pytest

from conftest import PYTHON


def worker(directory, steps):
    import torch
    from mpi4py import MPI

    from eddis import timeline as tl

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    trace = tl.start_timeline(directory, comm=comm)
    assert trace is not None and trace.clock["offset_to_rank0_ns"] is not None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())
    ready = queue.Queue()
    done = queue.Queue()
    step_box = [0]

    def hook_for(bucket):
        def hook(grad):
            tl.instant(tl.BUCKET_READY, args={"step": step_box[0], "bucket": bucket, "bytes": grad.numel() * 4})
            ready.put((step_box[0], bucket, grad))
            return grad
        return hook

    for bucket, p in enumerate(params):
        p.register_hook(hook_for(bucket))

    def communicate():
        while True:
            item = ready.get()
            if item is None:
                return
            step, bucket, grad = item
            flat = grad.detach().reshape(-1).numpy().copy()
            with tl.span(tl.PUSH, args={"step": step, "bucket": bucket, "bytes": flat.nbytes}):
                comm.Allreduce(MPI.IN_PLACE, flat)
            done.put((bucket, flat / comm.Get_size()))

    thread = threading.Thread(target=communicate, name="eddis-comm", daemon=True)
    thread.start()
    for step in range(steps):
        step_box[0] = step
        start = tl.now_ns()
        x, y = torch.randn(16, 32), torch.randn(16, 4)
        with tl.span(tl.FORWARD, args={"step": step}):
            loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        with tl.span(tl.BACKWARD, args={"step": step}):
            loss.backward()
        reduced = {}
        with tl.span(tl.WAIT, args={"step": step}):
            while len(reduced) < len(params):
                bucket, value = done.get(timeout=60)
                reduced[bucket] = value
        for bucket, p in enumerate(params):
            p.grad.copy_(torch.from_numpy(reduced[bucket]).view_as(p))
        with tl.span(tl.OPTIMIZER_STEP, args={"step": step}):
            opt.step()
        tl.complete(tl.STEP, start, args={"step": step})
        tl.counter("loss", {"loss": float(loss.detach())})
    ready.put(None)
    thread.join(timeout=30)
    comm.Barrier()
    tl.stop_timeline()
    print(f"rank {rank} done, offset {trace.clock['offset_to_rank0_ns']} ns "
          f"+- {trace.clock['uncertainty_ns']} ns", flush=True)


def check_push_after_ready(events, pid):
    ready = {}
    pushes = []
    for e in events:
        if e.get("pid") != pid or "args" not in e:
            continue
        key = (e["args"].get("step"), e["args"].get("bucket"))
        if e["name"] == "bucket_ready":
            ready[key] = e["ts"]
        elif e["name"] == "push":
            pushes.append((key, e["ts"]))
    assert pushes, f"no push events on pid {pid}"
    for key, ts in pushes:
        assert key in ready, f"rank {pid}: push of step/bucket {key} without bucket_ready"
        assert ts >= ready[key], f"rank {pid}: push of {key} at {ts} before ready at {ready[key]}"
    # Every step's pushes follow that step's last ready only where the bucket order says so;
    # what must hold for the step: its first push comes after its first ready.
    steps = {k[0] for k, _ in pushes}
    for s in steps:
        first_push = min(ts for k, ts in pushes if k[0] == s)
        first_ready = min(ts for k, ts in ready.items() if k[0] == s)
        assert first_push >= first_ready
    return len(pushes)


@pytest.mark.timeout(240)
def test_four_rank_timeline_merges_onto_one_clock(run_mpi, tmp_path):
    directory = tmp_path / "timeline"
    proc = run_mpi(4, [PYTHON, __file__, str(directory), "8"], timeout=200, check=True)
    assert proc.stdout.count(" done, offset ") == 4

    from eddis.timeline.merge import merge_timeline

    out, summary = merge_timeline(directory)
    data = json.loads(out.read_text())  # the merged trace is strict JSON
    events = data["traceEvents"]
    assert summary["ranks"] == [0, 1, 2, 3]
    names_by_pid = {}
    for e in events:
        names_by_pid.setdefault(e["pid"], set()).add(e["name"])
    for rank in range(4):
        assert {"bucket_ready", "push", "wait", "optimizer_step", "step", "forward", "backward"} <= names_by_pid[rank]
        assert check_push_after_ready(events, rank) == 8 * 4
    clocks = data["otherData"]["eddis_clock"]
    for rank in range(4):
        # All ranks share this host's monotonic clock: aligned exactly, and said so.
        assert clocks[str(rank)]["uncertainty_us"] == 0.0
        assert clocks[str(rank)]["alignment"] == "same host clock as the reference"
    for rank in range(1, 4):
        clock = json.loads((directory / f"rank-{rank}.clock.json").read_text())
        assert clock["offset_method"].startswith("mpi ping-pong")
        assert clock["uncertainty_ns"] > 0
        # Same kernel: the measured offset is 0 within the measurement's own uncertainty.
        assert abs(clock["offset_to_rank0_ns"]) <= clock["uncertainty_ns"] + 1
    timed = [e["ts"] for e in events if e.get("ph") != "M"]
    assert min(timed) == 0.0 and timed == sorted(timed)
    labels = [e for e in events if e["name"] == "process_labels"]
    assert len(labels) == 4 and all("uncertainty" in e["args"]["labels"] for e in labels)


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))
