import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparseforge.prune import NMError, check_nm, is_nm, nm_mask


@given(st.integers(1, 16), st.integers(1, 16), st.sampled_from([(2, 4), (1, 4), (4, 8), (1, 2)]), st.integers(0, 10**6))
def test_every_group_keeps_exactly_n_largest(rows, groups, nm, seed):
    n, m = nm
    w = torch.randn(rows, groups * m, generator=torch.Generator().manual_seed(seed))
    mask = nm_mask(w, n, m)
    per_group = mask.reshape(rows, groups, m)
    assert (per_group.sum(-1) == n).all()
    pruned = w * mask
    assert is_nm(pruned, n, m)
    mags = w.abs().reshape(rows, groups, m)
    kept_min = torch.where(per_group, mags, torch.inf).min(-1).values
    dropped_max = torch.where(per_group, -torch.inf, mags).max(-1).values
    assert (kept_min >= dropped_max).all()


def test_conv_weight_grouped_along_cin_kh_kw():
    w = torch.randn(8, 4, 3, 3)
    mask = nm_mask(w)
    assert mask.shape == w.shape
    assert ((w * mask).reshape(8, -1, 4) != 0).sum(-1).le(2).all()


def test_validator_names_first_bad_group():
    w = torch.zeros(2, 8)
    w[1, 4:7] = 1.0
    with pytest.raises(NMError, match="row 1, input columns 4..7"):
        check_nm(w)
    check_nm(torch.zeros(2, 8))


def test_k_not_multiple_of_m():
    with pytest.raises(NMError, match="not a multiple of M = 4"):
        nm_mask(torch.randn(3, 6))


def test_bad_rank_and_bad_nm():
    with pytest.raises(NMError, match="2-D"):
        nm_mask(torch.randn(4))
    with pytest.raises(NMError, match="0 < N <= M"):
        nm_mask(torch.randn(4, 4), 5, 4)


def test_nan_rejected():
    w = torch.randn(2, 4)
    w[0, 0] = float("inf")
    with pytest.raises(NMError, match="NaN or inf"):
        nm_mask(w)


@pytest.mark.parametrize("n, m, message", [(2.5, 4, "N must be an integer, got float 2.5"),
                                           ("2", 4, "N must be an integer, got str"),
                                           (2, 4.0, "M must be an integer, got float 4.0"),
                                           (True, 4, "N must be an integer, got bool")])
def test_non_integer_n_or_m_is_named(n, m, message):
    with pytest.raises(NMError, match=message):
        nm_mask(torch.randn(2, 8), n, m)
    with pytest.raises(NMError, match=message):
        check_nm(torch.randn(2, 8), n, m)


def test_not_a_tensor_is_named():
    import numpy as np

    with pytest.raises(NMError, match="must be a torch.Tensor, got ndarray"):
        nm_mask(np.ones((2, 8)))


def test_complex_weights_rank_by_modulus_not_real_part():
    w = torch.tensor([[1 + 0j, 0 + 5j, 2 + 0j, 0 + 0.5j]])
    assert nm_mask(w).tolist() == [[False, True, True, False]]


def test_weight_with_no_rows():
    assert nm_mask(torch.zeros(0, 8)).shape == (0, 8) and is_nm(torch.zeros(0, 8))
