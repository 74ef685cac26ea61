"""Which layers of a model get pruned, and why the others are skipped."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Union

import torch
from torch import nn

# A name filter: a regular expression searched in the qualified name, or a callable (name, module) -> bool.
LayerFilter = Union[str, Callable[[str, nn.Module], bool], None]


@dataclass(frozen=True)
class Skipped:
    name: str
    reason: str


def name_filter(spec: LayerFilter, argument: str) -> Callable[[str, nn.Module | None], bool] | None:
    """The filter as a callable; a pattern is compiled here, so a bad one is named before any work is done."""
    if spec is None or callable(spec):
        return spec
    if not isinstance(spec, (str, re.Pattern)):  # re.compile(5) would say only "first argument must be string"
        raise TypeError(f"{argument} must be a regular expression (a str) or a callable (name, module) -> bool, "
                        f"got {type(spec).__name__} {spec!r}; join several names as 'a|b'")
    try:
        pattern = re.compile(spec)
    except re.error as err:
        raise ValueError(f"{argument} {spec!r} is not a valid regular expression ({err}); escape characters "
                         "such as ( [ + * ? with a backslash to match them literally") from None
    return lambda name, module: pattern.search(name) is not None


def weight_matrix_view(weight: torch.Tensor) -> torch.Tensor:
    """The 2-D view pruning works on: Linear as out x in, Conv2d as Cout x (Cin/groups * kh * kw)."""
    if weight.ndim == 0:
        raise ValueError("a 0-d tensor (a scalar) has no rows to prune; pass a Linear or Conv2d weight")
    # the column count spelled out: reshape(0, -1) cannot infer it for a weight with no rows
    return weight.reshape(weight.shape[0], math.prod(weight.shape[1:]))


# The dtypes pruning ranks and the kernels take; float8 weights (a quantised checkpoint) are left as they are.
PRUNABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _weight_skip_reason(weight: torch.Tensor) -> str | None:
    """Why a Linear / Conv2d weight cannot be pruned (None: it can)."""
    if not torch.is_floating_point(weight):
        return f"weight dtype {weight.dtype} is not floating point"
    if weight.dtype not in PRUNABLE_DTYPES:
        return (f"weight dtype {weight.dtype} is not one pruning ranks (float16, bfloat16, float32, float64); "
                "upcast it first (.to(torch.bfloat16)) to prune it")
    if weight.numel() == 0:
        return f"the weight holds no values (shape {'x'.join(map(str, weight.shape))}): nothing to prune"
    return None


def select_layers(model: nn.Module, include: LayerFilter = None, exclude: LayerFilter = None
                  ) -> tuple[list[tuple[str, nn.Module]], list[Skipped]]:
    """Split the model's weighted modules into (prunable Linear/Conv2d layers, skipped with reasons). A model
    that is itself a Linear or Conv2d is its own one layer, under the qualified name "" (torch's name for it)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}"
                        + ("; for a state dict use prune_state_dict" if isinstance(model, dict) else ""))
    include, exclude = name_filter(include, "include"), name_filter(exclude, "exclude")
    chosen: list[tuple[str, nn.Module]] = []
    skipped: list[Skipped] = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        if not isinstance(module, (nn.Linear, nn.Conv2d)):
            skipped.append(Skipped(name, f"{type(module).__name__} is not nn.Linear or nn.Conv2d"))
        elif include is not None and not include(name, module):
            skipped.append(Skipped(name, "not matched by include"))
        elif exclude is not None and exclude(name, module):
            skipped.append(Skipped(name, "matched by exclude"))
        elif reason := _weight_skip_reason(weight):
            skipped.append(Skipped(name, reason))
        else:
            chosen.append((name, module))
    return chosen, skipped


def select_state_dict(state: dict[str, torch.Tensor], include: LayerFilter = None, exclude: LayerFilter = None
                      ) -> tuple[list[str], list[Skipped]]:
    """The same choice over a bare state dict: 2-D (Linear) and 4-D (Conv2d) floating 'weight' tensors."""
    if not isinstance(state, dict):
        raise TypeError(f"a state dict is a dict of name -> tensor, got {type(state).__name__}; "
                        "pass model.state_dict(), or prune_model(model) for a module")
    include, exclude = name_filter(include, "include"), name_filter(exclude, "exclude")
    chosen: list[str] = []
    skipped: list[Skipped] = []
    for name, tensor in state.items():
        reason = _state_skip_reason(name, tensor, include, exclude)
        if reason:
            skipped.append(Skipped(name, reason))
        else:
            chosen.append(name)
    return chosen, skipped


def _state_skip_reason(name: str, tensor, include, exclude) -> str | None:
    if not isinstance(tensor, torch.Tensor):
        return f"not a tensor ({type(tensor).__name__})"
    if not isinstance(name, str):
        return f"key {name!r} is not a parameter name (a str)"
    if tensor.layout != torch.strided:  # masks are computed on dense tensors; torch has no ops for these here
        return f"stored in torch's {tensor.layout} layout; save it dense (.to_dense()) to prune it"
    if not name.endswith("weight"):
        return "not a weight (bias, buffer or statistic)"
    if tensor.ndim not in (2, 4):
        return f"{tensor.ndim}-D tensor: only 2-D (Linear) and 4-D (Conv2d) weights are pruned"
    if reason := _weight_skip_reason(tensor):
        return reason
    if include is not None and not include(name, None):
        return "not matched by include"
    if exclude is not None and exclude(name, None):
        return "matched by exclude"
    return None


def names(items: Iterable[tuple[str, nn.Module]]) -> list[str]:
    return [name for name, _ in items]
