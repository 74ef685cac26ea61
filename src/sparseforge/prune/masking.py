"""Keeping masks applied while a pruned model is fine-tuned.

A mask becomes a parametrization of the layer's weight (torch.nn.utils.parametrize): the weight the
forward pass sees is always original * mask, so no optimizer step (momentum, weight decay, Adam's
running moments) can bring a pruned weight back. The stored original is zeroed where the mask is off
as well, so re-ranking by magnitude later never resurrects it.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize


class FixedMask(nn.Module):
    """Parametrization: weight -> weight * mask, the mask a (non-trainable) boolean buffer."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.register_buffer("mask", mask.to(torch.bool))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.mask


def _mask_of(module: nn.Module) -> FixedMask | None:
    if not parametrize.is_parametrized(module, "weight"):
        return None
    for p in module.parametrizations.weight:
        if isinstance(p, FixedMask):
            return p
    return None


def apply_mask(module: nn.Module, mask: torch.Tensor) -> None:
    """Attach (or replace) the fixed mask of module.weight; zero the stored weight where it is off."""
    weight = module.weight
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}; wrap a numpy array with "
                        "torch.from_numpy")
    if mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all():
        # .to(bool) would read 0.5 (or a score) as "keep": a mask of all ones, silently
        raise ValueError("mask holds values other than 0 and 1; pass a boolean mask (True: keep)")
    if mask.shape != weight.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match weight shape {tuple(weight.shape)}")
    mask = mask.to(device=weight.device, dtype=torch.bool)
    existing = _mask_of(module)
    if existing is None:
        with torch.no_grad():
            weight.mul_(mask)
        parametrize.register_parametrization(module, "weight", FixedMask(mask))
    else:
        existing.mask.copy_(mask)
        with torch.no_grad():
            module.parametrizations.weight.original.mul_(mask)


def current_mask(module: nn.Module) -> torch.Tensor | None:
    found = _mask_of(module)
    return None if found is None else found.mask


def masked_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if _mask_of(m) is not None}


def remove_masks(model: nn.Module) -> list[str]:
    """Bake every fixed mask into its weight (for export or inference) and drop the parametrization."""
    baked = []
    for name, module in masked_modules(model).items():
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        baked.append(name)
    return baked
