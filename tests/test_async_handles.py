"""Horovod's handle API in eddis.torch (allreduce_async, allreduce_async_, allgather_async,
broadcast_async, broadcast_async_, poll, synchronize) on 1 and N real Open MPI ranks: the
results, completion in issue order, progress while the caller computes, a poll that never
waits, a synchronize bounded by EDDIS_COMM_TIMEOUT that names what it waited for.

This file is also the worker: ``mpirun -n N python tests/test_async_handles.py OUT CASE``.
"""
import sys
import time
from pathlib import Path

from rank_results import write_result

OUT = None   # the worker's results folder (its first argument)


def _init():
    import torch

    import eddis.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    return torch, hvd


def case_ordered():
    torch, hvd = _init()
    from eddis.errors import UsageError

    r, n = hvd.rank(), hvd.size()
    mine = torch.tensor([r + 1.0, 2.0 * (r + 1)])
    inplace_sum, inplace_bcast = mine.clone(), torch.full((3,), float(r))
    handles = [hvd.allreduce_async(mine, op=hvd.Sum, name="sum"),
               hvd.allgather_async(torch.arange(r + 1, dtype=torch.int64) + 10 * r, name="rows"),
               hvd.broadcast_async(torch.full((2, 2), float(r)), root_rank=n - 1, name="from last"),
               hvd.broadcast_async_(inplace_bcast, root_rank=0),
               hvd.allreduce_async(mine, name="average"),
               hvd.allreduce_async_(inplace_sum, op=hvd.Sum)]
    mine.zero_()   # the handles read the tensor when they were issued
    last = hvd.synchronize(handles[-1])
    done_before_last = [hvd.poll(h) for h in handles[:-1]]   # completed in the order issued
    results = [hvd.synchronize(h) for h in handles[:-1]]
    refusals = []
    for call in (lambda: hvd.synchronize(handles[0]), lambda: hvd.poll(handles[-1]), lambda: hvd.poll(12345)):
        try:
            call()
        except UsageError as exc:
            refusals.append(str(exc))
    write_result(OUT, {
        "rank": r, "done_before_last": done_before_last, "last_is_the_tensor": last is inplace_sum,
        "sum": results[0].tolist(), "rows": results[1].tolist(), "rows_dtype": str(results[1].dtype),
        "from_last": results[2].tolist(), "bcast_inplace": [results[3] is inplace_bcast, inplace_bcast.tolist()],
        "average": results[4].tolist(), "inplace_sum": inplace_sum.tolist(), "refusals": refusals})
    hvd.shutdown()


def case_progress():
    """Rank 0 computes, polling, and never synchronizes until its handle is done: the
    operation moved while it computed. The others reduce with it in a blocking call."""
    torch, hvd = _init()
    if hvd.rank() == 0:
        handle = hvd.allreduce_async(torch.ones(1000), op=hvd.Sum, name="in the background")
        x = torch.randn(64, 64)
        polls, deadline = 0, time.monotonic() + 120
        while not hvd.poll(handle):
            x = torch.tanh(x @ x)   # the caller's own work, no EDDIS call
            polls += 1
            assert time.monotonic() < deadline, "the async allreduce made no progress in 120 s"
        result = hvd.synchronize(handle)
        write_result(OUT, {"rank": 0, "value": float(result[0]), "polls": polls})
    else:
        hvd.allreduce(torch.ones(1000), op=hvd.Sum, name="in the background")
    hvd.shutdown()


def case_poll_does_not_wait():
    """Rank 0's poll must answer False at once: rank 1 makes its call only after rank 0 has
    polled (it waits for rank 0's file), so the allreduce cannot have completed yet."""
    torch, hvd = _init()
    flag = Path(OUT) / "polled"
    if hvd.rank() == 0:
        handle = hvd.allreduce_async(torch.tensor([1.0]), op=hvd.Sum, name="late partner")
        first_poll = hvd.poll(handle)
        flag.write_text("polled")
        value = hvd.synchronize(handle).item()
        write_result(OUT, {"rank": 0, "first_poll": first_poll, "value": value})
    else:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert time.monotonic() < deadline, "rank 0 did not poll within 120 s"
            time.sleep(0.01)
        hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="late partner")
    hvd.shutdown()


def case_synchronize_times_out():
    """EDDIS_COMM_TIMEOUT bounds synchronize(): rank 1 never makes the call."""
    torch, hvd = _init()
    from eddis.errors import CollectiveTimeoutError

    if hvd.rank() == 0:
        handle = hvd.allreduce_async(torch.tensor([1.0]), name="never answered")
        try:
            hvd.synchronize(handle)
        except CollectiveTimeoutError as exc:
            print(f"TIMEOUT-MESSAGE {exc}", flush=True)
    else:
        time.sleep(60)   # the job ends when rank 0 aborts it


if __name__ == "__main__":
    OUT, case = sys.argv[1:]   # where each rank writes what it found; the case
    globals()[f"case_{case}"]()
    sys.exit(0)


# ---------------------------------------------------------------------- tests
import re  # noqa: E402

import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402
from rank_results import rank_results  # noqa: E402

pytestmark = pytest.mark.mpi  # starts real Open MPI ranks


@pytest.mark.timeout(200)
@pytest.mark.parametrize("size", [1, 3])
def test_handles_give_the_results_in_the_order_issued(run_mpi, tmp_path, size):
    found = rank_results(run_mpi(size, [PYTHON, __file__, str(tmp_path), "ordered"], timeout=180), range(size),
                         tmp_path)
    total = size * (size + 1) / 2
    rows = [10 * r + i for r in range(size) for i in range(r + 1)]
    for r, got in found.items():
        assert got["done_before_last"] == [True] * 5, got
        assert got["last_is_the_tensor"], got
        assert got["sum"] == got["inplace_sum"] == [total, 2 * total], got
        assert got["average"] == [total / size, 2 * total / size], got
        assert got["rows"] == rows and got["rows_dtype"] == "torch.int64", got
        assert got["from_last"] == [[size - 1.0] * 2] * 2, got
        assert got["bcast_inplace"] == [True, [0.0] * 3], got
        assert [("synchronize(1)" in m, "poll(6)" in m, "poll(12345)" in m) for m in got["refusals"]] == \
            [(True, False, False), (False, True, False), (False, False, True)], got["refusals"]
        assert all("no such handle" in m for m in got["refusals"]), got["refusals"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("size", [1, 2])
def test_an_async_allreduce_completes_while_the_caller_computes(run_mpi, tmp_path, size):
    found = rank_results(run_mpi(size, [PYTHON, __file__, str(tmp_path), "progress"], timeout=180), [0], tmp_path)
    assert found[0]["value"] == size and found[0]["polls"] >= 0


@pytest.mark.timeout(200)
def test_poll_answers_at_once_while_a_partner_has_not_called(run_mpi, tmp_path):
    found = rank_results(run_mpi(2, [PYTHON, __file__, str(tmp_path), "poll_does_not_wait"], timeout=180), [0],
                         tmp_path)
    assert found[0] == {"rank": 0, "first_poll": False, "value": 2.0}


@pytest.mark.timeout(200)
def test_synchronize_times_out_naming_the_operation(run_mpi, tmp_path):
    proc = run_mpi(2, [PYTHON, __file__, str(tmp_path), "synchronize_times_out"], env={"EDDIS_COMM_TIMEOUT": "3"},
                   timeout=180)
    line = re.search(r"TIMEOUT-MESSAGE (.*)", proc.stdout)
    assert line, (proc.stdout + proc.stderr)[-6000:]
    assert "eddis.allreduce(never answered)" in line.group(1) and "3 s" in line.group(1), line.group(1)
    assert proc.returncode != 0   # the communicator is unusable after a timeout: the job is aborted
