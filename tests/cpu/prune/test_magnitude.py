import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparseforge.prune import global_magnitude_masks, magnitude_mask


@given(st.integers(1, 40), st.integers(1, 40), st.floats(0.0, 0.99), st.integers(0, 2**31 - 1))
def test_mask_prunes_exact_count_of_smallest(rows, cols, sparsity, seed):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    mask = magnitude_mask(w, sparsity)
    assert int((~mask).sum()) == round(sparsity * w.numel())
    if mask.any() and (~mask).any():
        assert w[mask].abs().min() >= w[~mask].abs().max()


def test_global_threshold_is_shared():
    a = torch.full((10, 10), 0.1)
    b = torch.full((10, 10), 5.0)
    masks = global_magnitude_masks({"a": a, "b": b}, 0.5)
    assert not masks["a"].any() and masks["b"].all()


@pytest.mark.parametrize("sparsity", [-0.1, 1.0, 1.5])
def test_bad_sparsity(sparsity):
    with pytest.raises(ValueError, match="sparsity must be in"):
        magnitude_mask(torch.randn(4, 4), sparsity)


def test_nan_weights_rejected():
    w = torch.randn(4, 4)
    w[1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        magnitude_mask(w, 0.5)
    with pytest.raises(ValueError, match="layer1 holds NaN"):
        global_magnitude_masks({"layer1": w}, 0.5)
