"""Whole-model conversion to SparseLinear24, and preparing the decisions before CUDA graph capture."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn

from ..prune.targets import LayerFilter, Skipped, select_layers
from ..semi.cusparselt import Sparse24Error, check_weight
from ..semi.decide import MIN_SPEEDUP, Decision
from .linear24 import SparseLinear24


@dataclass
class ConversionReport:
    converted: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{len(self.converted)} Linear layers now SparseLinear24, {len(self.skipped)} left as they were"]
        lines += [f"  skipped {s.name}: {s.reason}" for s in self.skipped]
        return "\n".join(lines)


def to_sparse24(model: nn.Module, include: LayerFilter = None, exclude: LayerFilter = None,
                policy: str = "measure", min_speedup: float = MIN_SPEEDUP) -> ConversionReport:
    """Replace, in place, every nn.Linear of `model` (filtered by include / exclude: a regex on the
    qualified name or a callable (name, module) -> bool) whose weight is 2:4, float16/bfloat16 and
    16-aligned in shape by a SparseLinear24 holding the same (masked) weights. Other layers stay as they
    were, listed in the report with the reason. Prune first with sparseforge.semi.sparsify_24; cast the
    model with .half() or .to(torch.bfloat16)."""
    chosen, skipped = select_layers(model, include, exclude)
    report = ConversionReport(skipped=list(skipped))
    for name, module in chosen:
        if not isinstance(module, nn.Linear):
            report.skipped.append(Skipped(name, f"{type(module).__name__}: cuSPARSELt has no convolution; "
                                                "the layer stays as it is"))
            continue
        try:
            check_weight(module.weight.detach())
        except Sparse24Error as exc:
            report.skipped.append(Skipped(name, str(exc)))
            continue
        _replace(model, name, SparseLinear24.from_dense(module, policy=policy, min_speedup=min_speedup))
        report.converted.append(name)
    return report


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def prepare(model: nn.Module, widths: Iterable[int], seed: int = 0) -> list[Decision]:
    """Decide now, for every SparseLinear24 of `model` (on a CUDA device) and every input width n in
    `widths`, between 2:4 and dense (measuring on seeded random inputs), so that a later CUDA graph
    capture or latency-critical call finds every decision made. Returns the decisions."""
    widths = sorted({int(n) for n in widths})
    if not widths or widths[0] < 1:
        raise ValueError(f"widths must be positive input row counts, got {widths}")
    made = []
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for module in model.modules():
        if not isinstance(module, SparseLinear24):
            continue
        if module.weight.device.type != "cuda":
            raise ValueError("prepare needs the model on a CUDA device: call model.cuda() first")
        runtime = module.runtime()
        for n in widths:
            x = torch.randn(n, module.in_features, generator=generator).to(module.weight.device, module.weight.dtype)
            made.extend(runtime.prepare(x)[0].decisions())
    return made
