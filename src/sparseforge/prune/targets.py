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


NOT_INCLUDED, EXCLUDED = "not matched by include", "matched by exclude"
NOT_A_LAYER = " is not nn.Linear or nn.Conv2d"  # the end of the reason a weighted module of another kind gets
# what a selection is of: the noun for one, and the plural naming those include / exclude were searched in
_SELECTED = {"layer": "Linear / Conv2d layers", "tensor": "weights that can be pruned"}


class NothingSelectedError(ValueError):
    """include / exclude, or the model itself, leave no layer to work on: said at once, not as an empty report
    (the call would return having done nothing). `skipped` holds every layer left out, with its reason."""

    def __init__(self, skipped: list[Skipped], include: LayerFilter, exclude: LayerFilter, what: str, verb: str,
                 option_prefix: str = ""):
        self.skipped, self.include, self.exclude, self.what, self.verb = skipped, include, exclude, what, verb
        super().__init__(_nothing_selected(skipped, include, exclude, what, verb, option_prefix))

    def as_options(self) -> NothingSelectedError:
        """The same error in the command line's words: include / exclude spelled as its --include / --exclude."""
        return NothingSelectedError(self.skipped, self.include, self.exclude, self.what, self.verb, "--")


def check_selected(chosen: list, skipped: list[Skipped], include: LayerFilter, exclude: LayerFilter, what: str,
                   verb: str) -> None:
    """Raise NothingSelectedError when `chosen` (select_layers' or select_state_dict's) is empty."""
    if not chosen:
        raise NothingSelectedError(skipped, include, exclude, what, verb)


def _some(names: list[str], at_most: int = 4) -> str:
    shown = ", ".join(str(n) or "the model itself" for n in names[:at_most])
    return shown + (f" and {len(names) - at_most} more" if len(names) > at_most else "")


def _nothing_selected(skipped: list[Skipped], include, exclude, what: str, verb: str, prefix: str) -> str:
    not_included = [s.name for s in skipped if s.reason == NOT_INCLUDED]
    excluded = [s.name for s in skipped if s.reason == EXCLUDED]
    inc, exc, among = f"{prefix}include", f"{prefix}exclude", _SELECTED[what]
    if excluded and not_included:
        return (f"{inc} and {exc} together leave no {what} to {verb}: {exc} matched every one {inc} matched "
                f"({_some(excluded)}); narrow {exc}, or widen {inc}")
    if excluded:
        return (f"{exc} matched every {what} there is to {verb} ({_some(excluded)}): nothing is left; narrow it, "
                "or leave it out")
    if not_included:
        if isinstance(include, (str, re.Pattern)):
            pattern = include if isinstance(include, str) else include.pattern
            return (f"{inc} matched no {what}: {pattern!r} is found in none of the names of the {len(not_included)} "
                    f"{among} ({_some(not_included)}); give a regular expression found in one of them")
        return (f"{inc} matched no {what}: it returned False for each of the {len(not_included)} {among} "
                f"({_some(not_included)})")
    if what == "layer":
        others = [s for s in skipped if not s.reason.endswith(NOT_A_LAYER)]
        if not others:
            kinds = _some(list(dict.fromkeys(s.reason[:-len(NOT_A_LAYER)] for s in skipped)))
            return (f"the model has no nn.Linear or nn.Conv2d layer: nothing to {verb}"
                    + (f" (its modules with weights are {kinds})" if skipped else ""))
        skipped = others
    reasons = "; ".join(f"{s.name}: {s.reason}" for s in skipped[:3]) + \
        (f"; and {len(skipped) - 3} more" if len(skipped) > 3 else "")
    if what == "tensor":
        return ("no tensor is a 2-D or 4-D floating-point weight that can be pruned as asked"
                + (f" ({reasons})" if reasons else ": the state dict is empty"))
    return f"nothing to {verb}: every layer is skipped ({reasons})"


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
            skipped.append(Skipped(name, type(module).__name__ + NOT_A_LAYER))
        elif include is not None and not include(name, module):
            skipped.append(Skipped(name, NOT_INCLUDED))
        elif exclude is not None and exclude(name, module):
            skipped.append(Skipped(name, EXCLUDED))
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
        return NOT_INCLUDED
    if exclude is not None and exclude(name, None):
        return EXCLUDED
    return None


def names(items: Iterable[tuple[str, nn.Module]]) -> list[str]:
    return [name for name, _ in items]
