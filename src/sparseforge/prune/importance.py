"""Importance criteria other than |w| for prune_model / GradualPruner (their `importance=` argument).

Wanda (Sun et al., "A Simple and Effective Pruning Approach for Large Language Models", 2023) scores
weight (i, j) of a Linear by |W_ij| * ||X_j||_2, the L2 norm of input feature j over the tokens the layer
has seen: a small weight on a loud input can matter more than a large one on a quiet input.
ActivationNorms records those norms with forward hooks.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from .targets import LayerFilter, Skipped, select_layers


def wanda_scores(weight: torch.Tensor, input_norm: torch.Tensor) -> torch.Tensor:
    """|W_ij| * ||X_j||_2 for a Linear weight (out x in) and the norms of its in input features."""
    if weight.ndim != 2 or input_norm.shape != (weight.shape[1],):
        raise ValueError(f"need a 2-D weight (out x in) and {weight.shape[-1]} input norms, got weight "
                         f"{tuple(weight.shape)} and norms {tuple(input_norm.shape)}")
    return weight.detach().abs().float() * input_norm.to(weight.device, torch.float32)[None, :]


class ActivationNorms:
    """Forward hooks on the nn.Linear layers of `model` (chosen by include / exclude as prune_model chooses
    them) summing the square of every input feature over the tokens seen: norms()[name] is ||X_j||_2.

    refresh=True (the default): a layer's sums restart with the first input it sees after they were last
    read (norms / wanda), so under GradualPruner each mask update ranks by the batches since the previous
    one. refresh=False: they accumulate until reset().

    token_mask: optionally a boolean tensor (batch, seq) of the tokens to count (e.g. the attention mask,
    to leave padding out); inputs whose leading dimensions match its shape count only those rows, others
    count every row. `with norms.paused():` stops recording (evaluation passes). remove() drops the hooks.
    Conv2d layers are not recorded (listed in .skipped); wanda raises for a layer with no statistics.
    """

    def __init__(self, model: nn.Module, include: LayerFilter = None, exclude: LayerFilter = None,
                 refresh: bool = True):
        layers, self.skipped = select_layers(model, include, exclude)
        self.refresh = refresh
        self.token_mask: torch.Tensor | None = None
        self.recording = True
        self._sums: dict[str, torch.Tensor] = {}
        self._tokens: dict[str, int] = {}
        self._read: set[str] = set()
        self._handles = []
        for name, module in layers:
            if isinstance(module, nn.Linear):
                self._handles.append(module.register_forward_hook(self._hook(name)))
            else:
                self.skipped.append(Skipped(name, f"{type(module).__name__}: only nn.Linear inputs are recorded"))
        self.names = [name for name, module in layers if isinstance(module, nn.Linear)]

    def _hook(self, name: str):
        def record(module, inputs, output):
            if not self.recording:
                return
            x = inputs[0].detach()
            mask = self.token_mask
            if mask is not None and x.shape[:mask.ndim] == mask.shape:
                x = x[mask.to(device=x.device, dtype=torch.bool)]
            x = x.reshape(-1, x.shape[-1]).float()
            squares = x.pow(2).sum(dim=0)
            if name in self._read and self.refresh:
                self._read.discard(name)
                self._sums.pop(name, None)
                self._tokens.pop(name, None)
            if name in self._sums:
                self._sums[name] += squares
                self._tokens[name] += x.shape[0]
            else:
                self._sums[name], self._tokens[name] = squares, x.shape[0]
        return record

    @contextmanager
    def paused(self):
        """Inputs seen inside this block are not recorded."""
        before, self.recording = self.recording, False
        try:
            yield self
        finally:
            self.recording = before

    def tokens(self) -> dict[str, int]:
        """How many input rows (tokens) each layer's current norms cover."""
        return dict(self._tokens)

    def norms(self) -> dict[str, torch.Tensor]:
        """||X_j||_2 per input feature of every recorded layer (marks them read, see refresh)."""
        self._read.update(self._sums)
        return {name: s.sqrt() for name, s in self._sums.items()}

    def norm(self, name: str) -> torch.Tensor:
        if name not in self._sums:
            if name in self.names:
                raise ValueError(f"no inputs recorded for {name} yet: run some (calibration) batches through the "
                                 "model before pruning with activation-aware importance")
            raise ValueError(f"{name} is not a layer these ActivationNorms record (recorded: nn.Linear layers "
                             "chosen by include / exclude)")
        self._read.add(name)
        return self._sums[name].sqrt()

    def wanda(self, name: str, module: nn.Module | None, weight: torch.Tensor) -> torch.Tensor:
        """Importance for prune_model / GradualPruner: |W_ij| * ||X_j||_2."""
        return wanda_scores(weight, self.norm(name))

    def reset(self) -> None:
        self._sums.clear()
        self._tokens.clear()
        self._read.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
