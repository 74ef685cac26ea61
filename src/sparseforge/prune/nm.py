"""N:M masks (2:4 by default) along the input dimension, the layout Sparse Tensor Cores need:
in every run of M consecutive input weights of one output row, at most N are nonzero."""
from __future__ import annotations

import numbers

import torch

from .targets import weight_matrix_view


class NMError(ValueError):
    """A weight does not follow, or cannot take, an N:M pattern."""


def _check_nm_args(weight: torch.Tensor, n: int, m: int) -> int:
    # exact ints only: 2.5 or "2" would fail inside topk / reshape, and True would count as 1
    for what, value in (("N", n), ("M", m)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise NMError(f"{what} must be an integer, got {type(value).__name__} {value!r}; e.g. n=2, m=4 for 2:4")
    if not isinstance(weight, torch.Tensor):
        raise NMError(f"weight must be a torch.Tensor, got {type(weight).__name__}; wrap a numpy array with "
                      "torch.from_numpy")
    if not (0 < n <= m):
        raise NMError(f"need 0 < N <= M, got {n}:{m}")
    if weight.ndim not in (2, 4):
        raise NMError(f"N:M works on 2-D (Linear) or 4-D (Conv2d) weights, got {weight.ndim}-D {tuple(weight.shape)}")
    k = weight_matrix_view(weight).shape[1]
    if k % m:
        raise NMError(f"input dimension {k} is not a multiple of M = {m}; {n}:{m} groups would straddle rows. "
                      "Pad the layer or leave it dense")
    return k


def nm_mask(weight: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    """Boolean mask keeping the n largest-|w| entries in every group of m along the input dimension.
    Conv2d weights are grouped along Cin*kh*kw in PyTorch's (Cin, kh, kw) order."""
    k = _check_nm_args(weight, n, m)
    if not torch.isfinite(weight).all():
        raise NMError("weight holds NaN or inf values; fix the weights before computing an N:M mask")
    # |w| before the cast: .float() of a complex weight would drop its imaginary part
    matrix = weight_matrix_view(weight.detach()).abs().float()
    groups = matrix.reshape(matrix.shape[0], k // m, m)  # k // m, not -1: a weight with no rows has no -1
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(2, groups.topk(n, dim=2).indices, True)
    return keep.reshape(weight.shape)


def nm_violations(weight: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    """Indices (row, group) of the groups holding more than n nonzeros."""
    k = _check_nm_args(weight, n, m)
    matrix = weight_matrix_view(weight.detach())
    counts = (matrix != 0).reshape(matrix.shape[0], k // m, m).sum(dim=2)
    return torch.nonzero(counts > n)


def is_nm(weight: torch.Tensor, n: int = 2, m: int = 4) -> bool:
    return nm_violations(weight, n, m).numel() == 0


def check_nm(weight: torch.Tensor, n: int = 2, m: int = 4, name: str = "weight") -> None:
    """Raise NMError naming the first group that breaks the N:M pattern."""
    bad = nm_violations(weight, n, m)
    if bad.numel():
        row, group = (int(v) for v in bad[0])
        raise NMError(f"{name}: row {row}, input columns {group * m}..{group * m + m - 1} hold more than "
                      f"{n} nonzeros ({len(bad)} such groups); not {n}:{m} sparse")
