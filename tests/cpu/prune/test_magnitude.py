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


def test_wrong_types_are_named():
    import numpy as np

    from sparseforge.prune import row_magnitude_mask

    with pytest.raises(TypeError, match="sparsity must be a number.*got str"):
        magnitude_mask(torch.randn(4, 4), "0.5")
    with pytest.raises(TypeError, match="weight must be a torch.Tensor, got ndarray"):
        magnitude_mask(np.ones((4, 4)), 0.5)
    with pytest.raises(TypeError, match="boolean tensor"):
        magnitude_mask(torch.ones(4, 4, dtype=torch.bool), 0.5)
    with pytest.raises(TypeError, match="weights must be a dict"):
        global_magnitude_masks([torch.ones(4)], 0.5)
    with pytest.raises(ValueError, match="row pruning needs a weight with output rows.*1-D"):
        row_magnitude_mask(torch.randn(5), 0.4)  # rows of one entry: would silently prune nothing
    assert row_magnitude_mask(torch.zeros(0, 3), 0.5).shape == (0, 3)
