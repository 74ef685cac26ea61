"""split_24 (mappings/split24/plan.py): W = part24 + residual exactly, part24 is 2:4 holding each group's two
largest |w|, and the statistics the design quotes (99.6% of 4-groups fit at 90%)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseforge import SparseMatrix
from sparseforge.mappings.split24.plan import split_24


def _dense(m, k, density, seed):
    rng = np.random.default_rng(seed)
    return np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0).astype(np.float32)


@given(st.integers(1, 9), st.integers(1, 12), st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]), st.integers(0, 999))
@settings(max_examples=60, deadline=None)
def test_parts_add_up_to_w_and_part24_keeps_the_two_largest(m, groups, density, seed):
    dense = _dense(m, 4 * groups, density, seed)
    split = split_24(SparseMatrix.from_dense(dense))
    part, rest = split.part24.to_dense(), split.residual.to_dense()
    assert np.array_equal(part + rest, dense) and not np.any((part != 0) & (rest != 0))
    kept = (part != 0).reshape(m, groups, 4)
    assert kept.sum(axis=2).max(initial=0) <= 2
    for r, g in zip(*np.nonzero((dense != 0).reshape(m, groups, 4).sum(axis=2) > 2)):
        window = np.abs(dense[r, 4 * g:4 * g + 4])
        assert np.sort(np.abs(part[r, 4 * g:4 * g + 4]))[-2:].tolist() == np.sort(window)[-2:].tolist()
    assert split.overflow_groups == int(((dense != 0).reshape(m, groups, 4).sum(axis=2) > 2).sum())


def test_at_90_percent_almost_every_group_already_fits():
    """A group of 4 holds >= 3 nonzeros with probability 4 * 0.1^3 * 0.9 + 0.1^4 = 0.37% at 90%."""
    split = split_24(SparseMatrix.from_dense(_dense(512, 4096, 0.1, 0)))
    assert 0.995 < split.fitting_groups_fraction < 0.998
    assert split.residual_fraction < 0.012


def test_k_not_a_multiple_of_4_is_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        split_24(SparseMatrix.from_dense(np.ones((2, 6), np.float32)))
