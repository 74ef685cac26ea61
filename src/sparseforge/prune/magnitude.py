"""Magnitude pruning masks: per tensor, per output row, and global across tensors (one threshold for the whole
model). Any nonnegative importance score can stand in for the weight: the masks rank |input|."""
from __future__ import annotations

import torch


def _check_sparsity(sparsity: float) -> None:
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}: it is the fraction of weights removed")


def _check_finite(weight: torch.Tensor, name: str = "weight") -> None:
    if not torch.isfinite(weight).all():
        raise ValueError(f"{name} holds NaN or inf values; magnitude pruning cannot rank them. Fix the weights first")


def magnitude_mask(weight: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Boolean mask (same shape as weight) keeping the largest-|w| entries so that exactly
    round(sparsity * numel) entries are pruned. Ties are broken by position (stable sort)."""
    _check_sparsity(sparsity)
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
    _check_sparsity(sparsity)
    _check_finite(weight)
    matrix = weight.detach().abs().reshape(weight.shape[0], -1).float()
    n_prune = int(round(sparsity * matrix.shape[1]))
    mask = torch.ones_like(matrix, dtype=torch.bool)
    if n_prune:
        order = torch.argsort(matrix, dim=1, stable=True)
        mask.scatter_(1, order[:, :n_prune], False)
    return mask.reshape(weight.shape)


def global_magnitude_masks(weights: dict[str, torch.Tensor], sparsity: float) -> dict[str, torch.Tensor]:
    """Masks for several tensors under one magnitude threshold, pruning round(sparsity * total) entries
    in all: layers with many small weights lose more than layers with few."""
    _check_sparsity(sparsity)
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
