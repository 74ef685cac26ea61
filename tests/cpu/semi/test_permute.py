import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from sparseforge.semi import kept_magnitude, permute_pair, search_permutation


@given(st.integers(1, 12), st.integers(1, 12), st.integers(0, 10**6))
@settings(max_examples=40, deadline=None)
def test_permutation_never_lowers_kept_magnitude_and_is_a_permutation(rows, groups, seed):
    w = torch.randn(rows, groups * 4, generator=torch.Generator().manual_seed(seed))
    result = search_permutation(w, time_budget=0.2, patience=3, batch=64, seed=seed)
    assert sorted(result.permutation.tolist()) == list(range(groups * 4))
    assert result.kept_after >= result.kept_before - 1e-4
    assert abs(result.kept_after - kept_magnitude(w[:, result.permutation])) < 1e-3 * max(result.total, 1)


def test_search_finds_the_obvious_reordering():
    w = torch.zeros(1, 8)
    w[0, :4] = 1.0  # four large weights in one group: 2:4 keeps only two of them
    result = search_permutation(w, time_budget=1.0)
    assert result.kept_before == 2.0 and result.kept_after == 4.0


def test_permute_pair_keeps_the_function():
    torch.manual_seed(0)
    first, second = nn.Linear(6, 8), nn.Linear(8, 3)
    x = torch.randn(5, 6)
    before = second(torch.relu(first(x)))
    permute_pair(first, second, torch.randperm(8))
    assert torch.allclose(second(torch.relu(first(x))), before, atol=1e-6)


def test_permute_pair_shape_mismatch():
    import pytest

    with pytest.raises(ValueError, match="must all agree"):
        permute_pair(nn.Linear(4, 8), nn.Linear(6, 2), torch.arange(8))
