"""Folding an eval-mode BatchNorm2d into the Conv2d before it: W' = W * g / sqrt(var + eps) per output
channel, b' = (b - mean) * g / sqrt(var + eps) + beta, computed in float64 and rounded once to the layer's
dtype. The BatchNorm becomes nn.Identity, so the sparse convolution's fused bias carries the shift.

Which pairs fold is read from the model's graph (torch.fx): a BatchNorm2d whose only input is a Conv2d's
output, that output used by nothing else, and each module called once (a module reused at two places, or a
model fx cannot trace, folds nothing: the report says why). Zeros of W stay zeros (a scale per row), so the
pruned pattern is kept."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch import nn

from ..prune.targets import Skipped


@dataclass
class FoldReport:
    folded: list[tuple[str, str]] = field(default_factory=list)  # (conv, batchnorm)
    skipped: list[Skipped] = field(default_factory=list)


def fold_conv_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> None:
    """Fold `bn` (its running statistics: eval-mode semantics) into `conv` in place; exact in float64."""
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError("the BatchNorm tracks no running statistics (track_running_stats=False): there is no "
                         "fixed affine map to fold")
    from torch.nn.utils import parametrize

    if parametrize.is_parametrized(conv, "weight"):
        # a pruning mask (prune.FixedMask): conv.weight is computed, original * mask. A per-row scale commutes
        # with the mask, so scaling the original is exact; any other parametrization may not commute.
        if not all(type(p).__name__ == "FixedMask" for p in conv.parametrizations.weight):
            raise ValueError("the convolution's weight is parametrized by something other than a pruning mask: "
                             "remove it first (torch.nn.utils.parametrize.remove_parametrizations)")
        target = conv.parametrizations.weight.original
    else:
        target = conv.weight
    with torch.no_grad():
        var, mean = bn.running_var.double(), bn.running_mean.double()
        gamma = bn.weight.double() if bn.weight is not None else torch.ones_like(var)
        beta = bn.bias.double() if bn.bias is not None else torch.zeros_like(var)
        scale = gamma / torch.sqrt(var + bn.eps)
        weight = target.double() * scale.view(-1, 1, 1, 1)
        bias = conv.bias.double() if conv.bias is not None else torch.zeros_like(mean)
        shift = (bias - mean) * scale + beta
        target.copy_(weight.to(target.dtype))
        if conv.bias is None:
            conv.bias = nn.Parameter(shift.to(conv.weight.dtype), requires_grad=conv.weight.requires_grad)
        else:
            conv.bias.copy_(shift.to(conv.bias.dtype))


class LeafTracer(torch.fx.Tracer):
    """fx's tracer with sparseforge's layers (sparseforge.nn) as leaves: their forward checks and dispatches at
    run time. Models built in sparseforge.models are traced through like any other."""

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return type(m).__module__.startswith("sparseforge.nn.") or super().is_leaf_module(m, qualified_name)


def fold_batchnorms(model: nn.Module) -> FoldReport:
    """Fold, in place, every BatchNorm2d that directly and only follows a Conv2d (see the module docstring).
    The model should be in eval mode: folding uses the running statistics."""
    report = FoldReport()
    try:
        graph = LeafTracer().trace(model)
    except Exception as exc:  # data-dependent control flow and the like
        report.skipped.append(Skipped("(model)", f"torch.fx cannot trace the model ({type(exc).__name__}: "
                                                 f"{str(exc)[:120]}): no BatchNorm folded"))
        return report
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(model.get_submodule(node.target), nn.BatchNorm2d):
            continue
        source = node.args[0] if node.args else None
        conv = model.get_submodule(source.target) if getattr(source, "op", None) == "call_module" else None
        if not isinstance(conv, nn.Conv2d):
            report.skipped.append(Skipped(node.target, "its input is not a Conv2d's output"))
        elif len(source.users) != 1:
            report.skipped.append(Skipped(node.target, f"{source.target}'s output is used elsewhere too"))
        elif calls[node.target] != 1 or calls[source.target] != 1:
            report.skipped.append(Skipped(node.target, "the module is called at more than one place"))
        elif model.get_submodule(node.target).training:
            report.skipped.append(Skipped(node.target, "in training mode (batch statistics): call model.eval() "
                                                       "first; folding uses the running statistics"))
        else:
            try:
                fold_conv_bn(conv, model.get_submodule(node.target))
            except ValueError as exc:
                report.skipped.append(Skipped(node.target, str(exc)))
                continue
            parent, _, child = node.target.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, nn.Identity())
            report.folded.append((source.target, node.target))
    return report
