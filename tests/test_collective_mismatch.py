"""Calls that do not match across the ranks, on real Open MPI ranks: every rank gets the same
clear error from the round of announcements, the data never moves (no mixing, no crash in
MPI), and the next collective works.

This file is also the worker: ``mpirun -n N python tests/test_collective_mismatch.py OUT``.
"""
import sys

from rank_results import write_result


def main():
    import torch

    import eddis.torch as hvd
    from eddis.errors import EddisError

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    errors = {}

    def attempt(label, call):
        try:
            call()
        except EddisError as exc:
            errors[label] = [type(exc).__name__, str(exc)]

    attempt("kinds", lambda: hvd.allreduce(torch.ones(2), name="loss") if r == 0
            else hvd.broadcast(torch.ones(2), root_rank=0, name="weights"))
    attempt("shapes", lambda: hvd.allreduce(torch.ones(2 + r), name="loss"))
    attempt("roots", lambda: hvd.broadcast_object("x", root_rank=r))
    attempt("unpicklable", lambda: hvd.broadcast_object(lambda: r if r == 0 else None, root_rank=0))
    attempt("rest_of_shape", lambda: hvd.synchronize(hvd.allgather_async(torch.ones(1, 2 + r))))
    after = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum).item()
    write_result(sys.argv[1], {"rank": r, "errors": errors, "after": after})
    hvd.shutdown()


if __name__ == "__main__":
    main()
    sys.exit(0)


# ---------------------------------------------------------------------- tests
import pytest  # noqa: E402

from conftest import PYTHON  # noqa: E402
from rank_results import rank_results  # noqa: E402

pytestmark = pytest.mark.mpi  # starts real Open MPI ranks


@pytest.mark.timeout(200)
def test_mismatched_calls_fail_alike_on_every_rank_and_the_next_call_works(run_mpi, tmp_path):
    found = rank_results(run_mpi(2, [PYTHON, __file__, str(tmp_path)], timeout=180), range(2), tmp_path)
    for r, result in found.items():
        errors = result["errors"]
        assert errors["kinds"][0] == "UsageError", errors
        assert "rank 0 called eddis.allreduce(loss) while rank 1 called eddis.broadcast(weights)" in errors["kinds"][1]
        assert errors["shapes"][0] == "ConfigError" and "rank 0 has (2,), rank 1 has (3,)" in errors["shapes"][1]
        assert errors["roots"][0] == "ConfigError" and "root rank differs" in errors["roots"][1]
        assert errors["unpicklable"][0] == "ConfigError" and "does not pickle" in errors["unpicklable"][1]
        assert "rank 0:" in errors["unpicklable"][1], errors
        assert "shape after the first dimension" in errors["rest_of_shape"][1], errors
        assert result["after"] == 1.0, result
    assert found[0]["errors"] == found[1]["errors"]   # the same words on every rank
