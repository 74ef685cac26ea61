"""Gradual magnitude pruning (Zhu & Gupta, "To prune, or not to prune", 2017).

Sparsity rises from s_i to s_f over n pruning steps spaced dt apart, starting at t0:
    s_t = s_f + (s_i - s_f) * (1 - (t - t0) / (n * dt)) ** 3
pruning fast while many redundant weights remain and slowly near the target.
"""
from __future__ import annotations

import math
import numbers

from torch import nn

from .api import Importance, PruneReport, importance_method, prune_model
from .targets import LayerFilter, check_selected, select_layers


def _check_step(value, what: str) -> None:
    # a float or NaN step count would make `% frequency == 0` never true: masks silently never updated
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an integer (a training step count), got {type(value).__name__} {value!r}")


def cubic_sparsity(step: int, final_sparsity: float, begin_step: int, end_step: int,
                   initial_sparsity: float = 0.0) -> float:
    """The target sparsity at `step` (clamped to [initial, final] outside [begin_step, end_step])."""
    if isinstance(step, bool) or not isinstance(step, numbers.Real):
        raise TypeError(f"step must be a number, got {type(step).__name__} {step!r}")
    if math.isnan(step):  # min/max would pass NaN through: a NaN sparsity
        raise ValueError("step is NaN; pass the training step count")
    for what, value in (("begin_step", begin_step), ("end_step", end_step)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{what} must be finite, got {value}")
    if end_step <= begin_step:
        raise ValueError(f"end_step ({end_step}) must be after begin_step ({begin_step})")
    if not 0.0 <= initial_sparsity <= final_sparsity < 1.0:
        raise ValueError(f"need 0 <= initial_sparsity <= final_sparsity < 1, got {initial_sparsity}, {final_sparsity}")
    progress = min(max((step - begin_step) / (end_step - begin_step), 0.0), 1.0)
    return final_sparsity + (initial_sparsity - final_sparsity) * (1.0 - progress) ** 3


class GradualPruner:
    """Call .step() once per training step (after optimizer.step()); every `frequency` steps between
    begin_step and end_step it re-ranks weights and tightens the masks to the cubic schedule. Masks
    stay applied between updates (see masking.py), so the optimizer never revives a pruned weight.

    scope: "layer", "row" or "global" (see prune_model). importance: what the updates rank instead of |w|,
    a callable (name, module, weight) -> scores (e.g. ActivationNorms(model).wanda, whose input statistics
    cover the batches since the previous update)."""

    def __init__(self, model: nn.Module, final_sparsity: float, begin_step: int, end_step: int,
                 frequency: int = 100, initial_sparsity: float = 0.0, scope: str = "layer",
                 include: LayerFilter = None, exclude: LayerFilter = None, importance: Importance = None):
        for what, value in (("frequency", frequency), ("begin_step", begin_step), ("end_step", end_step)):
            _check_step(value, what)
        if frequency < 1:
            raise ValueError(f"frequency must be >= 1, got {frequency}")
        cubic_sparsity(begin_step, final_sparsity, begin_step, end_step, initial_sparsity)  # validates
        # scope, importance and the include / exclude patterns are checked now, not at the first update
        # thousands of training steps later
        importance_method(final_sparsity, None, scope, importance)
        check_selected(*select_layers(model, include, exclude), include, exclude, "layer", "prune")
        self.model, self.scope, self.include, self.exclude = model, scope, include, exclude
        self.importance = importance
        self.final_sparsity, self.initial_sparsity = final_sparsity, initial_sparsity
        self.begin_step, self.end_step, self.frequency = begin_step, end_step, frequency
        self.step_count = 0
        self.last_report: PruneReport | None = None

    def sparsity_at(self, step: int) -> float:
        return cubic_sparsity(step, self.final_sparsity, self.begin_step, self.end_step, self.initial_sparsity)

    def step(self) -> bool:
        """Advance one step; returns True when the masks were updated at this step."""
        t = self.step_count
        self.step_count += 1
        due = self.begin_step <= t <= self.end_step and (t - self.begin_step) % self.frequency == 0
        if not due and t != self.end_step:
            return False
        self.last_report = prune_model(self.model, sparsity=self.sparsity_at(t), scope=self.scope,
                                       include=self.include, exclude=self.exclude, importance=self.importance)
        return True
