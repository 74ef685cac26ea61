"""Magnitude pruning masks: per tensor, per output row, and global across tensors (one threshold for the whole
model). Any nonnegative importance score can stand in for the weight: the masks rank |input|."""
from __future__ import annotations

import math
import numbers

import torch


def check_sparsity(sparsity: float) -> None:
    # a str or a tensor would fail later inside round() or a format string, far from the argument
    if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real):
        raise TypeError(f"sparsity must be a number in [0, 1), got {type(sparsity).__name__} {sparsity!r}"
                        + ("; pass float(sparsity)" if isinstance(sparsity, (str, torch.Tensor)) else ""))
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}: it is the fraction of weights removed")


def _check_finite(weight: torch.Tensor, name: str = "weight") -> None:
    """Refuse what magnitudes cannot rank: non-tensors, booleans, NaN / inf."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}; "
                        "wrap a numpy array with torch.from_numpy")
    if weight.dtype == torch.bool:
        raise TypeError(f"{name} is a boolean tensor; a mask has no magnitudes to rank, pass the weight itself")
    if not torch.isfinite(weight).all():
        raise ValueError(f"{name} holds NaN or inf values; magnitude pruning cannot rank them. Fix the weights first")


def magnitude_mask(weight: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Boolean mask (same shape as weight) keeping the largest-|w| entries so that exactly
    round(sparsity * numel) entries are pruned. Ties are broken by position (stable sort)."""
    check_sparsity(sparsity)
    _check_finite(weight)
    flat = weight.detach().abs().flatten().float()
    n_prune = int(round(sparsity * flat.numel()))
    mask = torch.ones_like(flat, dtype=torch.bool)
    if n_prune:
        order = torch.argsort(flat, stable=True)
        mask[order[:n_prune]] = False
    return mask.reshape(weight.shape)


def row_magnitude_mask(weight: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Boolean mask pruning, in every output row of the 2-D view (Linear: out x in; Conv2d: Cout x
    Cin*kh*kw), exactly round(sparsity * row length) of its smallest-|w| entries: every output keeps the
    same number of inputs (Wanda's comparison group). Ties broken by position (stable sort)."""
    check_sparsity(sparsity)
    _check_finite(weight)
    if weight.ndim < 2:  # a 1-D tensor is rows of one entry each: nothing would ever be pruned
        raise ValueError(f"row pruning needs a weight with output rows (2-D Linear or 4-D Conv2d), got "
                         f"{weight.ndim}-D {tuple(weight.shape)}; use magnitude_mask for other tensors")
    matrix = weight.detach().abs().reshape(weight.shape[0], math.prod(weight.shape[1:])).float()
    n_prune = int(round(sparsity * matrix.shape[1]))
    mask = torch.ones_like(matrix, dtype=torch.bool)
    if n_prune:
        order = torch.argsort(matrix, dim=1, stable=True)
        mask.scatter_(1, order[:, :n_prune], False)
    return mask.reshape(weight.shape)


def global_magnitude_masks(weights: dict[str, torch.Tensor], sparsity: float) -> dict[str, torch.Tensor]:
    """Masks for several tensors under one magnitude threshold, pruning round(sparsity * total) entries
    in all: layers with many small weights lose more than layers with few."""
    check_sparsity(sparsity)
    if not isinstance(weights, dict):
        raise TypeError(f"weights must be a dict of name -> tensor, got {type(weights).__name__}")
    for name, w in weights.items():
        _check_finite(w, name)
    flats = [w.detach().abs().flatten().float().cpu() for w in weights.values()]
    if not flats:
        return {}
    everything = torch.cat(flats)
    n_prune = int(round(sparsity * everything.numel()))
    keep = torch.ones_like(everything, dtype=torch.bool)
    if n_prune:
        keep[torch.argsort(everything, stable=True)[:n_prune]] = False
    masks, offset = {}, 0
    for (name, w), flat in zip(weights.items(), flats):
        masks[name] = keep[offset:offset + flat.numel()].reshape(w.shape).to(w.device)
        offset += flat.numel()
    return masks
