"""Pruning whole models and state dicts, with a per-layer report of what was pruned and skipped."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .magnitude import global_magnitude_masks, magnitude_mask
from .masking import apply_mask
from .nm import NMError, nm_mask
from .targets import LayerFilter, Skipped, select_layers, select_state_dict, weight_matrix_view


@dataclass(frozen=True)
class LayerPruned:
    name: str
    shape: tuple[int, ...]
    nonzero_before: int
    nonzero_after: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def sparsity(self) -> float:
        return 1.0 - self.nonzero_after / self.numel


@dataclass
class PruneReport:
    method: str
    layers: list[LayerPruned] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    notes: list[Skipped] = field(default_factory=list)  # pruned, but with a caveat (e.g. will run dense)

    @property
    def sparsity(self) -> float:
        """Sparsity over the pruned layers together."""
        total = sum(layer.numel for layer in self.layers)
        return 1.0 - sum(layer.nonzero_after for layer in self.layers) / total if total else 0.0


def parse_nm(nm) -> tuple[int, int]:
    """'2:4' or (2, 4) -> (2, 4)."""
    try:
        n, m = (int(v) for v in (nm.split(":") if isinstance(nm, str) else nm))
    except (ValueError, TypeError):
        raise NMError(f"N:M must look like '2:4' or (2, 4), got {nm!r}") from None
    if not 0 < n <= m:
        raise NMError(f"need 0 < N <= M, got {n}:{m}")
    return n, m


def _method(sparsity, nm, scope) -> str:
    if (sparsity is None) == (nm is None):
        raise ValueError("give exactly one of sparsity=... (magnitude pruning) or nm='2:4' (N:M pruning)")
    if scope not in ("layer", "global"):
        raise ValueError(f"scope must be 'layer' or 'global', got {scope!r}")
    return f"{parse_nm(nm)[0]}:{parse_nm(nm)[1]}" if nm is not None else f"magnitude {sparsity:g} ({scope})"


def _masks(weights: dict[str, torch.Tensor], sparsity, nm, scope, skipped: list[Skipped]) -> dict[str, torch.Tensor]:
    if nm is not None:
        n, m = parse_nm(nm)
        masks = {}
        for name, w in weights.items():
            if weight_matrix_view(w).shape[1] % m:
                skipped.append(Skipped(name, f"input dimension {weight_matrix_view(w).shape[1]} is not a multiple of {m}"))
            else:
                masks[name] = nm_mask(w, n, m)
        return masks
    if scope == "global":
        return global_magnitude_masks(weights, sparsity)
    return {name: magnitude_mask(w, sparsity) for name, w in weights.items()}


def prune_model(model: nn.Module, sparsity: float | None = None, nm=None, scope: str = "layer",
                include: LayerFilter = None, exclude: LayerFilter = None, keep_masks: bool = True) -> PruneReport:
    """Prune the Linear and Conv2d layers of `model` in place.

    sparsity: fraction removed by magnitude, per layer (scope="layer") or under one global threshold
    (scope="global"); or nm: "2:4" style N:M masks along the input dimension. With keep_masks the masks
    stay attached as parametrizations so fine-tuning cannot revive pruned weights (remove_masks() bakes
    them in). Returns a report listing every pruned layer and every skipped one with the reason.
    """
    report = PruneReport(_method(sparsity, nm, scope))
    layers, report.skipped = select_layers(model, include, exclude)
    modules = dict(layers)
    weights = {name: module.weight.detach() for name, module in layers}
    masks = _masks(weights, sparsity, nm, scope, report.skipped)
    for name, mask in masks.items():
        module = modules[name]
        before = int(torch.count_nonzero(weights[name]))
        if keep_masks:
            apply_mask(module, mask)
        else:
            with torch.no_grad():
                module.weight.mul_(mask)
        report.layers.append(LayerPruned(name, tuple(mask.shape), before, int(torch.count_nonzero(module.weight))))
    return report


def prune_state_dict(state: dict[str, torch.Tensor], sparsity: float | None = None, nm=None, scope: str = "layer",
                     include: LayerFilter = None, exclude: LayerFilter = None
                     ) -> tuple[dict[str, torch.Tensor], PruneReport]:
    """Prune the 2-D and 4-D floating 'weight' tensors of a state dict; returns (new state, report)."""
    report = PruneReport(_method(sparsity, nm, scope))
    chosen, report.skipped = select_state_dict(state, include, exclude)
    weights = {name: state[name] for name in chosen}
    masks = _masks(weights, sparsity, nm, scope, report.skipped)
    pruned = dict(state)
    for name, mask in masks.items():
        pruned[name] = weights[name] * mask
        report.layers.append(LayerPruned(name, tuple(mask.shape), int(torch.count_nonzero(weights[name])),
                                         int(torch.count_nonzero(pruned[name]))))
    return pruned, report
