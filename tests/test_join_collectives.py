"""Every collective of the API beside a rank inside join(), on real Open MPI ranks.

Each rank in turn joins first while the others call every collective: allreduce (with
every op, in place and async) and barrier run, the joined rank contributing the op's
identity (zeros: Sum over the ranks with data, Average that sum over all ranks, as in
Horovod); allgather, broadcast, the object collectives and the parameter broadcasts are
refused with a UsageError on every rank that called them, naming the joined rank, and
never crash or hang. Then the others join, and join() names the same last rank
everywhere. The training cases do the same between the steps of a DistributedOptimizer
whose joined rank takes idle steps.

This file is also the worker: ``mpirun -n N python tests/test_join_collectives.py OUT CASE``.
"""
import sys
from pathlib import Path

import numpy as np

from rank_results import write_result

OUT = None   # the worker's results folder (its first argument)

REFUSED = "called eddis.join()"


def _refused(call):
    """The UsageError's message, or a note that the call was not refused as it must be."""
    from eddis.errors import UsageError

    try:
        call()
    except UsageError as exc:
        return str(exc)
    return "NOT REFUSED"


def _each_rank_joins_first(hvd, calls):
    """For each rank in turn: it joins at once while the others make ``calls(others)`` (a
    dict of what they got) and then join. Prints what every round gave on this rank."""
    r, n = hvd.rank(), hvd.size()
    rounds = []
    for first in range(n):
        got = None if r == first else calls([q for q in range(n) if q != first])
        rounds.append({"first": first, "last": hvd.join(), "got": got})
    # every rank is past join(): everything runs again
    lasts = hvd.allgather_object([round_["last"] for round_ in rounds])
    write_result(OUT, {"rank": r, "size": n, "rounds": rounds, "lasts": lasts})
    hvd.shutdown()


def case_torch_collectives():
    import torch

    import eddis.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    r = hvd.rank()

    def calls(others):
        mine = torch.tensor([r + 1.0, -(r + 1.0)])
        got = {
            "sum": hvd.allreduce(mine, op=hvd.Sum, name="sum").tolist(),
            "average": hvd.allreduce(mine, name="average").tolist(),
            "min": hvd.allreduce(torch.tensor([r + 1, -(r + 1)]), op=hvd.Min).tolist(),
            "max": hvd.allreduce(torch.tensor([r + 1.0, -(r + 1.0)]), op=hvd.Max).tolist(),
            "scaled": hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).tolist(),
        }
        inplace = mine.clone()
        hvd.allreduce_(inplace, op=hvd.Sum)
        got["inplace"] = inplace.tolist()
        a = hvd.allreduce_async(mine, op=hvd.Sum, name="a")
        b_tensor = mine.clone()
        b = hvd.allreduce_async_(b_tensor, name="b")
        got["async"] = hvd.synchronize(a).tolist()
        got["async_inplace"] = [hvd.synchronize(b) is b_tensor, b_tensor.tolist()]
        hvd.barrier()
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        handle = hvd.allgather_async(mine)
        got["refused"] = {
            "allgather": _refused(lambda: hvd.allgather(mine)),
            "allgather_async": _refused(lambda: hvd.synchronize(handle)),
            "broadcast": _refused(lambda: hvd.broadcast(mine, root_rank=others[0], name="w")),
            "broadcast_": _refused(lambda: hvd.broadcast_(mine, root_rank=others[0])),
            "broadcast_async": _refused(lambda: hvd.synchronize(hvd.broadcast_async(mine, others[0]))),
            "broadcast_object": _refused(lambda: hvd.broadcast_object({"r": r}, root_rank=others[0])),
            "allgather_object": _refused(lambda: hvd.allgather_object(r)),
            "broadcast_parameters": _refused(lambda: hvd.broadcast_parameters(model.state_dict(), 0)),
            "broadcast_optimizer_state": _refused(lambda: hvd.broadcast_optimizer_state(optimizer, 0)),
        }
        got["after_refusals"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).tolist()
        return got

    _each_rank_joins_first(hvd, calls)


def case_tensorflow_collectives():
    import tensorflow as tf

    import eddis.tensorflow as hvd

    hvd.init()
    r = hvd.rank()

    @tf.function
    def summed_in_graph(x):
        return hvd.allreduce(x, op=hvd.Sum, name="graph")

    def calls(others):
        mine = tf.constant([r + 1.0, -(r + 1.0)])
        got = {
            "sum": hvd.allreduce(mine, op=hvd.Sum, name="sum").numpy().tolist(),
            "average": hvd.allreduce(mine, name="average").numpy().tolist(),
            "min": hvd.allreduce(tf.constant([r + 1, -(r + 1)]), op=hvd.Min).numpy().tolist(),
            "max": hvd.allreduce(mine, op=hvd.Max).numpy().tolist(),
            "scaled": hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).numpy().tolist(),
            "graph": summed_in_graph(mine).numpy().tolist(),
        }
        hvd.barrier()
        variables = [tf.Variable([1.0, 2.0])]
        got["refused"] = {
            "allgather": _refused(lambda: hvd.allgather(mine)),
            "broadcast": _refused(lambda: hvd.broadcast(mine, root_rank=others[0], name="w")),
            "broadcast_object": _refused(lambda: hvd.broadcast_object({"r": r}, root_rank=others[0])),
            "allgather_object": _refused(lambda: hvd.allgather_object(r)),
            "broadcast_variables": _refused(lambda: hvd.broadcast_variables(variables, root_rank=0)),
        }
        got["after_refusals"] = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum).numpy().tolist()
        return got

    _each_rank_joins_first(hvd, calls)


def steps_of(rank):
    return 2 + rank


def case_torch_training(mode):
    """Rank r takes 2 + r steps, averaging its loss and crossing a barrier after each, with an
    async allreduce in flight over the step; the joined ranks take part in all of it."""
    import torch

    import eddis.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), mode=mode)
    losses, counts = [], []
    for step in range(steps_of(r)):
        x = torch.full((4, 3), float(r + step))
        pending = hvd.allreduce_async(torch.tensor([1.0]), op=hvd.Sum, name="ranks with data")
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(hvd.allreduce(torch.tensor([float(step)]), op=hvd.Sum, name="loss").item())
        counts.append(hvd.synchronize(pending).item())
        hvd.barrier()
    saved = None
    if r == n - 1:   # the others have joined: a save is refused before rank 0 writes anything
        import tempfile

        path = Path(tempfile.mkdtemp()) / "model.pt"
        saved = [_refused(lambda: hvd.save_checkpoint(path, model, optimizer)), path.exists()]
    last = hvd.join()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    write_result(OUT, {"rank": r, "size": n, "mode": mode, "last": last, "losses": losses, "counts": counts,
                       "params": flat, "saved": saved})
    optimizer.close()
    hvd.shutdown()


def case_tensorflow_training(mode):
    import keras
    import tensorflow as tf

    import eddis.tensorflow.keras as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="ones")])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01), mode=mode)
    losses, counts = [], []
    for step in range(steps_of(r)):
        x = np.full((4, 3), float(r + step), dtype=np.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(hvd.allreduce(tf.constant([float(step)]), op=hvd.Sum, name="loss")[0]))
        counts.append(float(hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="ranks with data")[0]))
        hvd.barrier()
    last = hvd.join()
    flat = np.concatenate([v.numpy().reshape(-1) for v in model.trainable_variables]).tolist()
    write_result(OUT, {"rank": r, "size": n, "mode": mode, "last": last, "losses": losses, "counts": counts,
                       "params": flat})
    optimizer.close()
    hvd.shutdown()


if __name__ == "__main__":
    OUT, case, *args = sys.argv[1:]   # where each rank writes what it found; the case
    globals()[f"case_{case}"](*args)
    sys.exit(0)


# ---------------------------------------------------------------------- tests
import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402
from rank_results import rank_results  # noqa: E402

import eddis.smb.server  # noqa: E402,F401  (required: missing is a failure, not a skip)

pytestmark = pytest.mark.mpi  # starts real Open MPI ranks


def results(run_mpi, size, tmp_path, *worker):
    proc = run_mpi(size, [PYTHON, __file__, str(tmp_path), *worker], timeout=280)
    found = rank_results(proc, range(size), tmp_path)
    return [found[r] for r in range(size)]


def expected(size, first):
    """What the ranks other than ``first`` get, rank r holding [r + 1, -(r + 1)]."""
    values = [q + 1.0 for q in range(size) if q != first]
    total = sum(values)
    mean = float(np.float32(total / size))   # reduced in float64, returned in the tensor's float32
    return {"sum": [total, -total], "average": [mean, -mean],
            "min": [min(values), -max(values)], "max": [max(values), -min(values)],
            "scaled": [total, -total]}


def check_collectives(found, size, framework):
    for result in found:
        r = result["rank"]
        for round_ in result["rounds"]:
            first = round_["first"]
            assert round_["last"] != first, round_   # the others joined after it, in every case
            if r == first:
                continue
            got, want = round_["got"], expected(size, first)
            for key, value in want.items():
                assert got[key] == value, (r, first, key, got[key], value)
            if framework == "torch":
                assert got["inplace"] == got["async"] == want["sum"], got
                assert got["async_inplace"] == [True, want["average"]], got
            else:
                assert got["graph"] == want["sum"], got
            for call, message in got["refused"].items():
                assert f"rank(s) [{first}] {REFUSED}" in message, (r, first, call, message)
            assert got["after_refusals"] == [size - 1.0], got
        # join() named the same rank on every rank, in every round
        assert result["lasts"] == [[round_["last"] for round_ in other["rounds"]] for other in found]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_each_collective_beside_a_joined_rank_runs_or_is_refused_on_every_caller(run_mpi, tmp_path, framework,
                                                                                 size):
    check_collectives(results(run_mpi, size, tmp_path, f"{framework}_collectives"), size, framework)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("framework,mode", [("torch", "sync"), ("torch", "allreduce"), ("tensorflow", "sync")])
def test_metrics_and_barriers_between_steps_are_served_by_joined_ranks(run_mpi, tmp_path, framework, mode, size):
    found = results(run_mpi, size, tmp_path, f"{framework}_training", mode)
    for result in found:
        r = result["rank"]
        # at step s the ranks with more than s steps have data: the others add zeros
        with_data = [sum(1 for q in range(size) if steps_of(q) > s) for s in range(steps_of(r))]
        assert result["counts"] == with_data, result
        assert result["losses"] == [s * c for s, c in enumerate(with_data)], result
        assert result["last"] == size - 1, result   # the rank with the most steps
    if framework == "torch":
        message, written = found[-1]["saved"]
        assert f"eddis.save_checkpoint(): rank(s) {list(range(size - 1))} {REFUSED}" in message, message
        assert not written
    params = {tuple(np.round(result["params"], 6)) for result in found}
    assert len(params) == 1, found                   # the joined ranks stepped with the others
