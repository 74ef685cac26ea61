"""One Linear layer's 2:4 state on one GPU: the compressed weight, and per input width n a decision
(2:4 or dense, by measurement) with its cuSPARSELt plan. Built once, looked up on every call."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .cusparselt import CompressedWeight, MatmulPlan, Sparse24Error
from . import gemv as gemv_module
from .decide import DENSE, GEMV, MIN_SPEEDUP, SPARSE, Decision, WidthChoice, decide_modes, fixed
from .transpose import transpose_columns
from ..runtime.streams import ready_dense_fallback

POLICIES = ("measure", "sparse", "dense")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}: 'measure' picks 2:4 or dense per "
                         "input width by timing both, 'sparse' always runs 2:4, 'dense' never does")
    return policy


class Linear24Runtime:
    """Y = X W^T + b for a 2:4 weight on one CUDA device. `weight` (M x K, the masked dense weight) and
    `bias` stay referenced: dense is the fallback wherever 2:4 does not pay."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, policy: str = "measure",
                 min_speedup: float = MIN_SPEEDUP):
        self.policy = check_policy(policy)
        self.min_speedup = min_speedup
        self.weight, self.bias = weight, bias
        self.compressed = CompressedWeight(weight)
        self.entries: dict[int, tuple[WidthChoice, MatmulPlan | None]] = {}
        # per width, the callables (eager, graph) the decisions chose: one dict lookup per call, and no
        # capture query where both modes chose the same path (host time is what small eager layers pay)
        self._calls: dict[int, tuple] = {}
        self.gemv: gemv_module.Gemv24 | None = None  # built when a decode width first considers it
        ready_dense_fallback(weight, bias)  # a width first seen in a capture runs dense there

    @property
    def decisions(self) -> list[Decision]:
        return [d for choice, _ in self.entries.values() for d in choice.decisions()]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (n, K) contiguous, 16-byte aligned, the weight's dtype and device. Returns (n, M)."""
        calls = self._calls.get(x.shape[0])
        if calls is None:
            self.prepare(x)
            calls = self._calls[x.shape[0]]
        eager, graph = calls
        if eager is graph:
            return eager(x)
        return (graph if torch.cuda.is_current_stream_capturing() else eager)(x)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def _callable(self, path: str, plan: MatmulPlan | None):
        if path == SPARSE:
            return lambda x: _run_padded(plan, x)
        if path == GEMV:
            return self.gemv
        return self._dense

    def prepare(self, x: torch.Tensor) -> tuple[WidthChoice, MatmulPlan | None]:
        """Decide (and build the plan) for x's width; later calls of that width only look it up."""
        n = x.shape[0]
        if torch.cuda.is_current_stream_capturing():
            # Nothing can be timed or searched inside a capture; dense is never slower than dense.
            entry = (WidthChoice.both(fixed(n, DENSE, "first seen during CUDA graph capture, where nothing can be "
                                                      "measured; call sparseforge.prepare(model, widths) before "
                                                      "capturing")), None)
        elif self.policy == "dense":
            entry = (WidthChoice.both(fixed(n, DENSE, "policy 'dense'")), None)
        else:
            entry = self._measured(x)
        self.entries[n] = entry
        choice, plan = entry
        eager = self._callable(choice.eager.path, plan)
        self._calls[n] = (eager, eager if choice.graph.path == choice.eager.path else
                          self._callable(choice.graph.path, plan))
        return entry

    def _measured(self, x: torch.Tensor) -> tuple[WidthChoice, MatmulPlan | None]:
        n = x.shape[0]
        try:
            plan = MatmulPlan(self.compressed, n, self.bias)
            padded = padded_input(plan, x)
            out = torch.empty(self.compressed.rows, plan.padded_n, dtype=x.dtype, device=x.device)
            plan.search(padded, out)
        except Sparse24Error as exc:
            return WidthChoice.both(fixed(n, DENSE, f"cuSPARSELt cannot run this width: {exc}")), None
        extra = {"config_id": plan.config_id, "padded_n": plan.padded_n if plan.padded_n != n else None}
        if self.policy == "sparse":
            return WidthChoice.both(Decision(n, SPARSE, "policy 'sparse': 2:4 without comparing to dense",
                                             **extra)), plan
        timed = {SPARSE: _both_us(lambda: _run_padded(plan, x))}
        if gemv_module.USE_IN_DECISIONS and n <= gemv_module.DECISION_MAX_N:
            self.gemv = self.gemv or gemv_module.Gemv24(self.weight, self.bias)
            timed[GEMV] = _both_us(lambda: self.gemv(x))
        choice = decide_modes(n, timed, _both_us(lambda: F.linear(x, self.weight, self.bias)), self.min_speedup,
                              **extra)
        return choice, (plan if choice.uses(SPARSE) else None)


def padded_input(plan: MatmulPlan, x: torch.Tensor) -> torch.Tensor:
    if plan.padded_n == x.shape[0]:
        return x
    # Rows past n only feed output rows that are dropped, so they need no particular value.
    padded = torch.empty(plan.padded_n, x.shape[1], dtype=x.dtype, device=x.device)
    padded[: x.shape[0]].copy_(x)
    return padded


def _run_padded(plan: MatmulPlan, x: torch.Tensor) -> torch.Tensor:
    out_t = torch.empty(plan.weight.rows, plan.padded_n, dtype=x.dtype, device=x.device)
    plan.run(padded_input(plan, x), out_t)
    return transpose_columns(out_t, x.shape[0])


def _graph_us(fn) -> float:
    """Median GPU microseconds per call under CUDA-graph replay (what a graph-captured model sees)."""
    from ..runtime.timing import TimingContention, eager_time_us, graph_time_us

    try:
        return graph_time_us(lambda _: fn(), [None], calls_per_graph=10, repeats=15)
    except TimingContention:
        raise
    except RuntimeError:  # not capturable: the eager figure is the honest one
        return eager_time_us(lambda _: fn(), [None] * 10, repeats=15)


def _both_us(fn) -> tuple[float, float]:
    """(graph replay, eager) medians of fn."""
    return _graph_us(fn), _eager_us(fn)


def _eager_us(fn) -> float:
    """Median microseconds per call issued eagerly, back to back: host time included where it dominates."""
    from ..runtime.timing import eager_time_us

    return eager_time_us(lambda _: fn(), [None] * 10, repeats=15)
