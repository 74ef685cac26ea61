"""Pruning whole models and state dicts, with a per-layer report of what was pruned and skipped."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from .magnitude import check_sparsity, global_magnitude_masks, magnitude_mask, row_magnitude_mask
from .masking import apply_mask
from .nm import NMError, nm_mask
from .targets import LayerFilter, Skipped, check_selected, select_layers, select_state_dict, weight_matrix_view

# An importance criterion: (qualified name, module or None for a state dict entry, weight) -> a nonnegative
# score of the weight's shape; the masks keep the highest scores. None: the magnitude |w|.
Importance = Optional[Callable[[str, Optional[nn.Module], torch.Tensor], torch.Tensor]]
SCOPES = ("layer", "row", "global")


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
        return 1.0 - self.nonzero_after / self.numel if self.numel else 0.0


@dataclass
class PruneReport:
    method: str
    layers: list[LayerPruned] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    notes: list[Skipped] = field(default_factory=list)  # pruned, but with a caveat (e.g. will run dense)
    state_key: str | None = None  # prune_state_dict: the checkpoint key the weights sat under (None: at the top)

    @property
    def sparsity(self) -> float:
        """Sparsity over the pruned layers together."""
        total = sum(layer.numel for layer in self.layers)
        return 1.0 - sum(layer.nonzero_after for layer in self.layers) / total if total else 0.0

    @property
    def warnings(self) -> list[str]:
        """Layers pruning left without a single nonzero. They stay pruned as asked, but such a layer now
        outputs only its bias: usually a global threshold above every weight of a layer with small weights."""
        return [f"{layer.name} ({'x'.join(map(str, layer.shape))}) has no nonzero weight left and now outputs "
                "only its bias; prune per layer, exclude it, or lower the sparsity if that is not intended"
                for layer in self.layers if layer.nonzero_after == 0 and layer.nonzero_before > 0]


# Keys under which training code nests the weights of a checkpoint, tried in this order: Lightning
# ("state_dict"), the usual training loops ("model_state_dict", "model"), wrappers ("module", "net").
NESTED_STATE_KEYS = ("state_dict", "model_state_dict", "model", "module", "net", "network")


def find_state_dict(checkpoint: dict) -> tuple[str | None, dict]:
    """(key, state dict): where a checkpoint keeps its weights. A flat state dict (tensors at its top level)
    is its own (key None); else the mapping of tensors under one of NESTED_STATE_KEYS, else the only mapping
    that holds tensors. Raises ValueError when there is none, or several and none under a usual key."""
    def holds_tensors(mapping) -> bool:
        return isinstance(mapping, dict) and any(isinstance(v, torch.Tensor) for v in mapping.values())

    if holds_tensors(checkpoint):
        return None, checkpoint
    nested = {key: value for key, value in checkpoint.items() if holds_tensors(value)}
    for key in NESTED_STATE_KEYS:
        if key in nested:
            return key, nested[key]
    if len(nested) == 1:
        return next(iter(nested.items()))
    if not nested:
        keys = ", ".join(map(repr, list(checkpoint)[:6])) or "none"
        raise ValueError(f"the checkpoint holds no tensors, neither at its top level nor in a nested mapping "
                         f"(keys: {keys}); save model.state_dict()")
    raise ValueError(f"the checkpoint holds several mappings of tensors ({', '.join(map(repr, nested))}) and none "
                     f"under a usual key ({', '.join(NESTED_STATE_KEYS)}); save the one to prune on its own")


def parse_nm(nm) -> tuple[int, int]:
    """'2:4' or (2, 4) -> (2, 4). Integers only: int() would read (2.7, 4) as 2:4 and (True, 4) as 1:4."""
    try:
        parts = nm.split(":") if isinstance(nm, str) else list(nm)
        if len(parts) != 2 or any(isinstance(v, bool) or not isinstance(v, (str, numbers.Integral)) for v in parts):
            raise ValueError
        n, m = (int(v) for v in parts)
    except (ValueError, TypeError):
        raise NMError(f"N:M must look like '2:4' or (2, 4), got {nm!r}") from None
    if not 0 < n <= m:
        raise NMError(f"need 0 < N <= M, got {n}:{m}")
    return n, m


def importance_method(sparsity, nm, scope, importance: Importance = None) -> str:
    if (sparsity is None) == (nm is None):
        raise ValueError("give exactly one of sparsity=... (magnitude pruning) or nm='2:4' (N:M pruning)")
    if sparsity is not None:
        check_sparsity(sparsity)
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(map(repr, SCOPES))}, got {scope!r}")
    if importance is not None and not callable(importance):
        raise TypeError("importance must be a callable (name, module, weight) -> scores, "
                        f"got {type(importance).__name__}")
    # sparsity + 0.0: -0.0 is labelled 0
    method = f"{parse_nm(nm)[0]}:{parse_nm(nm)[1]}" if nm is not None else f"magnitude {sparsity + 0.0:g} ({scope})"
    if importance is not None:
        method += f" by {getattr(importance, '__name__', type(importance).__name__)} importance"
    return method


def _scores(weights: dict[str, torch.Tensor], importance: Importance, modules: dict[str, nn.Module]
            ) -> dict[str, torch.Tensor]:
    """What the masks rank: the weights themselves (by |w|), or importance(name, module, weight)."""
    if importance is None:
        return weights
    scores = {}
    for name, w in weights.items():
        score = importance(name, modules.get(name), w)
        if not isinstance(score, torch.Tensor) or score.shape != w.shape:
            raise ValueError(f"importance for {name} must return a tensor of the weight's shape {tuple(w.shape)}, "
                             f"got {tuple(score.shape) if isinstance(score, torch.Tensor) else type(score).__name__}")
        if not torch.isfinite(score).all():
            raise ValueError(f"importance for {name} holds NaN or inf scores; masks cannot rank them")
        if (score < 0).any():
            raise ValueError(f"importance for {name} holds negative scores; return nonnegative ones "
                             "(the masks keep the largest |score|)")
        scores[name] = score.detach()
    return scores


def _masks(weights: dict[str, torch.Tensor], sparsity, nm, scope, skipped: list[Skipped],
           importance: Importance = None, modules: dict[str, nn.Module] | None = None) -> dict[str, torch.Tensor]:
    for name, w in weights.items():  # named here: the mask functions only know "weight"
        if not torch.isfinite(w).all():
            raise ValueError(f"{name} holds NaN or inf values; pruning cannot rank them. Fix the weights first "
                             "(or leave the tensor out with exclude)")
    weights = _scores(weights, importance, modules or {})
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
    if scope == "row":
        return {name: row_magnitude_mask(w, sparsity) for name, w in weights.items()}
    return {name: magnitude_mask(w, sparsity) for name, w in weights.items()}


def prune_model(model: nn.Module, sparsity: float | None = None, nm=None, scope: str = "layer",
                include: LayerFilter = None, exclude: LayerFilter = None, keep_masks: bool = True,
                importance: Importance = None) -> PruneReport:
    """Prune the Linear and Conv2d layers of `model` in place.

    sparsity: fraction removed by magnitude, per layer (scope="layer"), per output row of every layer
    (scope="row": each row of the out x in view loses round(sparsity * in)), or under one global threshold
    (scope="global"); or nm: "2:4" style N:M masks along the input dimension. importance: rank by
    importance(name, module, weight) -> nonnegative scores of the weight's shape instead of |w| (for
    activation-aware Wanda scores see ActivationNorms). With keep_masks the masks stay attached as
    parametrizations so fine-tuning cannot revive pruned weights (remove_masks() bakes them in). Returns a
    report listing every pruned layer and every skipped one with the reason. Raises NothingSelectedError where
    no layer is left to prune (no Linear / Conv2d, or include / exclude leave none).
    """
    report = PruneReport(importance_method(sparsity, nm, scope, importance))
    layers, report.skipped = select_layers(model, include, exclude)
    check_selected(layers, report.skipped, include, exclude, "layer", "prune")
    modules = dict(layers)
    weights = {name: module.weight.detach() for name, module in layers}
    masks = _masks(weights, sparsity, nm, scope, report.skipped, importance, modules)
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
                     include: LayerFilter = None, exclude: LayerFilter = None, importance: Importance = None
                     ) -> tuple[dict[str, torch.Tensor], PruneReport]:
    """Prune the 2-D and 4-D floating 'weight' tensors of a state dict; returns (new state, report).

    A checkpoint that nests its state dict (`{"state_dict": ..., "epoch": ...}`, see find_state_dict) is
    pruned there and returned whole, its other keys unchanged; report.state_key names where. importance as in
    prune_model, called with module None. Raises NothingSelectedError where no tensor is left to prune."""
    report = PruneReport(importance_method(sparsity, nm, scope, importance))
    if not isinstance(state, dict):
        raise TypeError(f"state must be a state dict (name -> tensor), got {type(state).__name__}; "
                        "pass model.state_dict(), or use prune_model for a module")
    report.state_key, weights_in = find_state_dict(state)
    chosen, report.skipped = select_state_dict(weights_in, include, exclude)
    check_selected(chosen, report.skipped, include, exclude, "tensor", "prune")
    weights = {name: weights_in[name] for name in chosen}
    masks = _masks(weights, sparsity, nm, scope, report.skipped, importance)
    pruned = dict(weights_in)
    for name, mask in masks.items():
        pruned[name] = weights[name] * mask
        report.layers.append(LayerPruned(name, tuple(mask.shape), int(torch.count_nonzero(weights[name])),
                                         int(torch.count_nonzero(pruned[name]))))
    return (pruned if report.state_key is None else {**state, report.state_key: pruned}), report
