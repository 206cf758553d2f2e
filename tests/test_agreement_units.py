"""eddis.core.progress.agreement's comparison of the ranks' checksums, without MPI."""
import pytest

from eddis.core.progress import agreement


def entries(*values, shapes=None):
    shapes = shapes or [(2, 2)] * len(values)
    return [(f"t{i}", shape, total, norm) for i, ((total, norm), shape) in enumerate(zip(values, shapes))]


@pytest.mark.timeout(30)
def test_equal_and_noise_level_checksums_agree():
    ref = entries((1.5, 3.0), (0.0, 2.0))
    assert agreement.disagreement([ref, ref]) is None
    noisy = entries((1.5 + 1e-9, 3.0), (1e-10, 2.0 - 1e-9))   # summation order on another device
    assert agreement.disagreement([ref, noisy]) is None


@pytest.mark.timeout(30)
def test_the_first_differing_rank_and_its_tensors_are_named():
    ref = entries((1.5, 3.0), (0.0, 2.0), (4.0, 4.0))
    drifted = entries((1.5, 3.0), (0.01, 2.0), (4.0, 4.1))   # a sum that cancels to ~0 still counts
    assert agreement.disagreement([ref, ref, drifted]) == (2, ["t1", "t2"])


@pytest.mark.timeout(30)
def test_ranks_that_know_different_parameters_are_not_compared():
    assert agreement.disagreement([entries((1.0, 1.0)), entries((1.0, 1.0), (2.0, 2.0))]) is None
    assert agreement.disagreement([entries((1.0, 1.0)), entries((5.0, 5.0), shapes=[(4,)])]) is None
