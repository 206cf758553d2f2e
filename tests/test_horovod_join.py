"""Horovod's own join tests (test/parallel/test_torch.py: test_horovod_join_allreduce,
test_horovod_join_allgather, test_horovod_join_broadcast; test/parallel/test_tensorflow.py:
test_horovod_join_allreduce), their logic retold here with ``import eddis.torch as hvd`` /
``import eddis.tensorflow as hvd``, on 2 and 3 real Open MPI ranks.

Where EDDIS differs, the documented error is asserted instead, on every rank that made the
call: an average of an integer tensor is refused (ConfigError: it would have to round),
where Horovod truncates.

This file is also the worker: ``mpirun -n N python tests/test_horovod_join.py OUT CASE``.
"""
import itertools
import sys

import numpy as np

from rank_results import write_result

OUT = None   # the worker's results folder (its first argument)


def _report(**values):
    write_result(OUT, values)


def _same_answer_everywhere(hvd, ret, first):
    """Horovod's closing checks of each case: join() did not name the rank that joined first,
    and named the same rank on every rank."""
    assert ret != first, f"join() returned {ret}, the rank that joined first"
    everyone = hvd.allgather_object(ret)
    assert everyone == [ret] * hvd.size(), f"join() returned {everyone} across the ranks"


def case_torch_allreduce():
    import torch

    import eddis.torch as hvd
    from eddis.errors import ConfigError

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    integral = (torch.int32, torch.int64)
    checked = refused = 0
    for dtype, dim, first, cached in itertools.product((torch.int32, torch.int64, torch.float32, torch.float64),
                                                      (1, 2, 3), range(size), (False, True)):
        torch.manual_seed(1234)
        # two tensors, so that two reductions are in flight at once
        a = torch.empty([5] * dim).random_(-100, 100).to(dtype)
        b = torch.empty([17] * dim).random_(-100, 100).to(dtype)

        def average_both():
            handles = [hvd.allreduce_async(a, name="tensor_a", average=True),
                       hvd.allreduce_async(b, name="tensor_b", average=True)]
            outcomes = []
            for handle in handles:
                try:
                    outcomes.append(hvd.synchronize(handle))
                except ConfigError as exc:
                    outcomes.append(exc)
            return outcomes

        if cached:
            average_both()    # every rank: checked below on the ranks that do it again
        if rank == first:
            ret = hvd.join()
        else:
            averaged = average_both()
            ret = hvd.join()
            if dtype in integral:
                # EDDIS refuses an integer average (Horovod truncates): the documented error
                assert all(isinstance(x, ConfigError) and "would have to round" in str(x) for x in averaged), averaged
                refused += 1
            else:
                for tensor, result in zip((a, b), averaged):
                    assert torch.allclose(result, tensor * (size - 1) / size, 0), (dtype, dim, first)
                checked += 1
        _same_answer_everywhere(hvd, ret, first)
    _report(rank=rank, checked=checked, refused=refused)
    hvd.shutdown()


def _each_rank_joins_first_while_the_others_call(hvd, collective):
    rank = hvd.rank()
    refused = 0
    for first in range(hvd.size()):
        if rank == first:
            ret = hvd.join()
        else:
            try:
                collective()
            except RuntimeError:   # Horovod's test accepts RuntimeError; EDDIS's UsageError is one
                refused += 1
            else:
                raise AssertionError("the collective beside a joined rank did not raise")
            ret = hvd.join()
        _same_answer_everywhere(hvd, ret, first)
    return refused


def case_torch_allgather():
    import torch

    import eddis.torch as hvd

    hvd.init()
    tensor = torch.zeros(17, 17, 17)
    refused = _each_rank_joins_first_while_the_others_call(hvd, lambda: hvd.allgather(tensor))
    _report(rank=hvd.rank(), refused=refused)
    hvd.shutdown()


def case_torch_broadcast():
    import torch

    import eddis.torch as hvd

    hvd.init()
    tensor = torch.zeros(17, 17, 17)
    # every rank names itself as the root, as Horovod's test does
    refused = _each_rank_joins_first_while_the_others_call(
        hvd, lambda: hvd.broadcast(tensor, hvd.rank(), name="test_horovod_join_broadcast"))
    _report(rank=hvd.rank(), refused=refused)
    hvd.shutdown()


def case_tensorflow_allreduce():
    import tensorflow as tf

    import eddis.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checked = 0
    for dtype, dim, first in itertools.product((tf.int32, tf.int64, tf.float16, tf.float32, tf.float64),
                                               (1, 2, 3), (0, 1)):
        values = np.random.default_rng(dim).integers(-100, 100, size=[17] * dim)
        tensor = tf.constant(values, dtype=dtype)   # the same on every rank
        if rank == first:
            ret = hvd.join()
        else:
            summed = hvd.allreduce(tensor, op=hvd.Sum)
            difference = float(tf.reduce_max(tf.abs(tf.cast(summed, tf.float64)
                                                    - tf.cast(tensor * (size - 1), tf.float64))))
            ret = hvd.join()
            assert difference == 0, (dtype, dim, first, difference)
            checked += 1
        _same_answer_everywhere(hvd, ret, first)
    _report(rank=rank, checked=checked)
    hvd.shutdown()


if __name__ == "__main__":
    OUT, case = sys.argv[1:]   # where each rank writes what it found; the case
    globals()[f"case_{case}"]()
    sys.exit(0)


# ---------------------------------------------------------------------- tests
import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402
from rank_results import rank_results  # noqa: E402

pytestmark = pytest.mark.mpi  # starts real Open MPI ranks


def reports(run_mpi, tmp_path, case, size, timeout=280):
    proc = run_mpi(size, [PYTHON, __file__, str(tmp_path), case], timeout=timeout)
    found = rank_results(proc, range(size), tmp_path)
    return {rank: {k: v for k, v in report.items() if k != "rank"} for rank, report in found.items()}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("size", [2, 3])
def test_horovod_join_allreduce_torch(run_mpi, tmp_path, size):
    found = reports(run_mpi, tmp_path, "torch_allreduce", size, timeout=380)
    for rank, report in found.items():
        # 2 float dtypes x 3 dims x 2 cachings per round in which this rank did not join first
        assert report == {"checked": 12 * (size - 1), "refused": 12 * (size - 1)}, (rank, report)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("case", ["torch_allgather", "torch_broadcast"])
def test_horovod_join_allgather_and_broadcast_torch_raise_beside_a_joined_rank(run_mpi, tmp_path, case, size):
    found = reports(run_mpi, tmp_path, case, size)
    assert found == {rank: {"refused": size - 1} for rank in range(size)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 3])
def test_horovod_join_allreduce_tensorflow(run_mpi, tmp_path, size):
    found = reports(run_mpi, tmp_path, "tensorflow_allreduce", size)
    for rank, report in found.items():
        # 5 dtypes x 3 dims, in the rounds where rank 0 or 1 joined first and this rank did not
        assert report == {"checked": 15 * sum(1 for first in (0, 1) if first != rank)}, (rank, report)
