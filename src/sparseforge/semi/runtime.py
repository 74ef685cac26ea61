"""One Linear layer's 2:4 state on one GPU: the compressed weight, and per input width n a decision
(2:4 or dense, by measurement) with its cuSPARSELt plan. Built once, looked up on every call."""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
import torch.nn.functional as F

from .cusparselt import CompressedWeight, MatmulPlan, Sparse24Error
from . import gemv as gemv_module
from .decide import DENSE, GEMV, MIN_SPEEDUP, SPARSE, Decision, WidthChoice, decide_modes, fixed, width_key
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
    `bias` stay referenced: dense is the fallback wherever 2:4 does not pay, until drop_dense lets go of W
    (every decided width runs a 2:4 path; the packed copy then stands for W: densify)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, policy: str = "measure",
                 min_speedup: float = MIN_SPEEDUP, pinned: dict | None = None):
        self.policy = check_policy(policy)
        self.min_speedup = min_speedup
        # {n: (eager path, graph path)}: widths run as another layer of the same shape decided, nothing timed
        self.pinned = check_pinned(pinned or {})
        self.weight, self.bias = weight, bias  # weight: None once drop_dense let go of it
        self._own_dense = False  # weight made again from the packed copy after drop_dense (device_bytes counts it)
        # compressed now (a weight cuSPARSELt refuses is named at once), unless every width is pinned off it
        off_cusparselt = bool(self.pinned) and all(SPARSE not in paths for paths in self.pinned.values())
        self._compressed: CompressedWeight | None = None if off_cusparselt else CompressedWeight(weight)
        self._captured: set[int] = set()  # widths first seen in a capture: dense until prepared outside one
        self.entries: dict[int, tuple[WidthChoice, MatmulPlan | None]] = {}
        # per width, the callables (eager, graph) the decisions chose: one dict lookup per call, and no
        # capture query where both modes chose the same path (host time is what small eager layers pay)
        self._calls: dict[int, tuple] = {}
        self.gemv: gemv_module.Gemv24 | None = None  # built when a decode width first considers it
        ready_dense_fallback(weight, bias)  # a width first seen in a capture runs dense there

    @property
    def decisions(self) -> list[Decision]:
        return [d for choice, _ in self.entries.values() for d in choice.decisions()]

    @property
    def compressed(self) -> CompressedWeight:
        """cuSPARSELt's compressed W; compressed again from the dense W if release_unused dropped it."""
        if self._compressed is None:
            # from the packed copy where W was dropped: a dense W only while compressing
            weight = self.weight if self.weight is not None else self.densify(torch.empty(
                self.gemv.packed.rows, self.gemv.packed.cols, dtype=self.gemv.dtype, device=self.gemv.device))
            self._compressed = CompressedWeight(weight)
        return self._compressed

    @property
    def holds_dense(self) -> bool:
        """Whether the runtime references a dense W (False after drop_dense, until a new width needs one)."""
        return self.weight is not None

    def dense_weight(self) -> torch.Tensor:
        """The dense W a dense call or a measurement reads: the layer's, or, after drop_dense, made again from
        the packed copy and kept (a width decided after the drop: the memory drop_dense saved comes back)."""
        if self.weight is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("a CUDA graph captures this 2:4 layer on a width it never ran, and the layer "
                                   "keeps no dense W to run it on: run (or prepare) that width before capturing")
            packed = self.gemv.packed
            self.weight = self.densify(torch.empty(packed.rows, packed.cols, dtype=self.gemv.dtype,
                                                   device=self.gemv.device))
            self._own_dense = True
        return self.weight

    def densify(self, out: torch.Tensor) -> torch.Tensor:
        """W dense into `out` (M x K, contiguous, W's dtype and device): from the packed copy where there is one
        (one kernel, no host sync), else copied from the dense W."""
        if self.gemv is not None:
            return self.gemv.densify(out)
        return out.copy_(self.weight)

    def drop_dense(self) -> bool:
        """Let go of the dense W where every decided width runs a 2:4 path under graph replay (DecodeLinear's
        decode widths: its prefill densifies into a workspace shared by the layers of its shape). A width whose
        eager call measured dense faster then runs its graph path eagerly too, said so in its decision. The
        packed copy stays (built here if no decision uses the GEMV): it writes W back (densify) for prefill and
        for a width decided later. Returns whether no dense W is referenced now; False (W kept) with nothing
        decided, under policy "dense", or where a width runs dense under graph replay."""
        if self.weight is None:
            return True
        if self.policy == "dense" or not self.entries or any(
                n in self._captured or choice.graph.path == DENSE for n, (choice, _) in self.entries.items()):
            return False
        self.gemv = self.gemv or gemv_module.Gemv24(self.weight, self.bias)
        for n, (choice, plan) in list(self.entries.items()):
            if choice.eager.path != DENSE:
                continue
            graph, eager = choice.graph, choice.eager
            runs = Decision(n, graph.path, f"{graph.path} eagerly too: dense measured faster called eagerly "
                                           f"({eager.reason}), but the layer keeps no dense W",
                            None, eager.dense_us, graph.config_id, graph.padded_n, mode="eager")
            self.entries[n] = (dataclasses.replace(choice, eager=runs), plan)
            call = self._calls[n][1]
            self._calls[n] = (call, call)
        self.weight, self._own_dense = None, False
        return True

    def decided(self, n: int) -> bool:
        """Whether width n has a decision made outside a CUDA graph capture (measured, pinned or by policy)."""
        return n in self.entries and n not in self._captured

    def chosen_paths(self) -> dict[int, tuple[str, str]]:
        """{width: (eager path, graph path)} of the widths decided outside a capture."""
        return {n: (choice.eager.path, choice.graph.path) for n, (choice, _) in self.entries.items()
                if n not in self._captured}

    def release_unused(self, widths: Iterable[int] | None = None) -> None:
        """Drop the copies of W that no decision of `widths` (default: every width decided) runs: cuSPARSELt's
        compressed W where each of them chose the GEMV or dense, the packed GEMV weight where none chose it. A
        width decided later builds again what it needs. Call once the widths a model runs are decided
        (nn.DecodeLinear.prepare does, with its kernel widths)."""
        keep = set(self.entries) if widths is None else set(widths)
        for n in set(self.entries) - keep:  # forgotten (their plans and GEMV calls hold copies): decided again if run
            self.entries.pop(n)
            self._calls.pop(n, None)
            self._captured.discard(n)
        used = {d.path for choice, _ in self.entries.values() for d in choice.decisions()}
        if SPARSE not in used:
            self._compressed = None
        if GEMV not in used and self.weight is not None:  # without a dense W the packed copy stands for it
            self.gemv = None

    def device_bytes(self) -> dict[str, int]:
        """Bytes held on the device beyond the dense W and bias: cuSPARSELt's compressed W, the packed GEMV
        weight, and the plans' workspaces."""
        plans = [plan for _, plan in self.entries.values() if plan is not None]
        dense = self.weight.numel() * self.weight.element_size() if self._own_dense else 0
        return {"compressed": 0 if self._compressed is None else self._compressed.nbytes,
                "packed": 0 if self.gemv is None else self.gemv.nbytes,
                "workspace": sum(plan.workspace.numel() for plan in plans), "dense": dense}

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
        return F.linear(x, self.dense_weight(), self.bias)

    def _callable(self, path: str, plan: MatmulPlan | None):
        if path == SPARSE:
            return lambda x: _run_padded(plan, x)
        if path == GEMV:
            return self.gemv
        return self._dense

    def prepare(self, x: torch.Tensor) -> tuple[WidthChoice, MatmulPlan | None]:
        """Decide (and build the plan) for x's width; later calls of that width only look it up."""
        n = x.shape[0]
        self._captured.discard(n)
        if torch.cuda.is_current_stream_capturing():
            # Nothing can be timed or searched inside a capture; dense is never slower than dense.
            entry = (WidthChoice.both(fixed(n, DENSE, "first seen during CUDA graph capture, where nothing can be "
                                                      "measured; call sparseforge.prepare(model, widths) before "
                                                      "capturing")), None)
            self._captured.add(n)
        elif self.policy == "dense":
            entry = (WidthChoice.both(fixed(n, DENSE, "policy 'dense'")), None)
        elif n in self.pinned:
            entry = self._as_pinned(x, *self.pinned[n])
        else:
            entry = self._measured(x)
        self.entries[n] = entry
        choice, plan = entry
        eager = self._callable(choice.eager.path, plan)
        self._calls[n] = (eager, eager if choice.graph.path == choice.eager.path else
                          self._callable(choice.graph.path, plan))
        return entry

    def _as_pinned(self, x: torch.Tensor, eager: str, graph: str) -> tuple[WidthChoice, MatmulPlan | None]:
        """x's width on the pinned paths, nothing timed: cuSPARSELt's plan (its algorithm searched) where a
        mode runs it, the packed GEMV built where one does; a path that cannot run this width runs dense,
        said so in its decision."""
        n, plan, why, extra = x.shape[0], None, {}, {}
        if GEMV in (eager, graph) and n > gemv_module.MAX_N:
            why[GEMV] = f"pinned to the 2:4 GEMV, which takes at most {gemv_module.MAX_N} rows: dense"
        if SPARSE in (eager, graph):
            try:
                plan = MatmulPlan(self.compressed, n, self.bias)
                out = torch.empty(self.compressed.rows, plan.padded_n, dtype=x.dtype, device=x.device)
                plan.search(padded_input(plan, x), out)
                _run_padded(plan, x)  # loaded now, the transpose after it too: the first call may be a capture
                extra = {"config_id": plan.config_id, "padded_n": plan.padded_n if plan.padded_n != n else None}
            except Sparse24Error as exc:
                plan, why[SPARSE] = None, f"pinned to 2:4, but cuSPARSELt cannot run this width ({exc}): dense"
        if GEMV in (eager, graph) and GEMV not in why:
            self.gemv = self.gemv or gemv_module.Gemv24(self.dense_weight(), self.bias)
            self.gemv(x)  # the same for its kernel
        made = [Decision(n, DENSE, why[path], mode=mode) if path in why else
                Decision(n, path, "pinned: as a layer of the same shape measured", mode=mode,
                         **(extra if path == SPARSE else {}))
                for mode, path in (("eager", eager), ("graph", graph))]
        return WidthChoice(*made), plan

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
        # decode widths: each path timed over copies of what it reads, rotated through HBM, as the unstructured
        # kernels and dense are (runtime.timing.ROTATED_MAX_N); one copy in L2 flattered the path of fewer
        # bytes: a Llama-3-8B's 2:4 Linears were predicted 1.74x faster than dense and ran 1.11x in the model
        # (each path's copies freed before the next path's are made: together they would hold about 2x W)
        count = _copies_to_rotate(n, x)
        copies = [None] + [self.compressed.data.clone() for _ in range(count(self.compressed.nbytes) - 1)]
        timed = {SPARSE: _both_us([lambda c=c: _run_padded(plan, x, c) for c in copies])}
        del copies
        if gemv_module.USE_IN_DECISIONS and n <= gemv_module.DECISION_MAX_N:
            self.gemv = self.gemv or gemv_module.Gemv24(self.dense_weight(), self.bias)
            gemvs = [self.gemv] + [self.gemv.with_copy_of_w() for _ in range(count(self.gemv.nbytes) - 1)]
            timed[GEMV] = _both_us([lambda g=g: g(x) for g in gemvs])
            del gemvs
        weight = self.dense_weight()
        weights = [weight] + [weight.clone() for _ in range(count(weight.numel() * weight.element_size()) - 1)]
        dense = _both_us([lambda w=w: F.linear(x, w, self.bias) for w in weights])
        del weights
        choice = decide_modes(n, timed, dense, self.min_speedup, **extra)
        return choice, (plan if choice.uses(SPARSE) else None)


def _copies_to_rotate(n: int, x: torch.Tensor):
    """count(nbytes): how many copies of a W of nbytes a timing loop on x rotates through so that none is read
    from L2 (runtime.timing.weight_copies, X's bytes counted) at decode widths (n <= ROTATED_MAX_N); 1 above."""
    from ..runtime.timing import ROTATED_MAX_N, l2_bytes, weight_copies

    if n > ROTATED_MAX_N:
        return lambda nbytes: 1
    l2, in_bytes = l2_bytes(x.device), x.numel() * x.element_size()
    return lambda nbytes: weight_copies(nbytes + in_bytes, l2)


def check_pinned(pinned: dict) -> dict[int, tuple[str, str]]:
    """{n: (eager path, graph path)} with n a positive int and each path 2:4's, the GEMV's or dense."""
    checked = {}
    for n, paths in pinned.items():
        count = width_key(n, "pinned takes {input width: (eager path, graph path)}")
        if not (isinstance(paths, (tuple, list)) and len(paths) == 2 and
                all(path in (SPARSE, GEMV, DENSE) for path in paths)):
            raise ValueError(f"pinned[{count}] must be (eager path, graph path), each one of "
                             f"{(SPARSE, GEMV, DENSE)}; got {paths!r}")
        checked[count] = (str(paths[0]), str(paths[1]))
    return checked


def padded_input(plan: MatmulPlan, x: torch.Tensor) -> torch.Tensor:
    if plan.padded_n == x.shape[0]:
        return x
    # Rows past n only feed output rows that are dropped, so they need no particular value.
    padded = torch.empty(plan.padded_n, x.shape[1], dtype=x.dtype, device=x.device)
    padded[: x.shape[0]].copy_(x)
    return padded


def _run_padded(plan: MatmulPlan, x: torch.Tensor, compressed: torch.Tensor | None = None) -> torch.Tensor:
    out_t = torch.empty(plan.weight.rows, plan.padded_n, dtype=x.dtype, device=x.device)
    plan.run(padded_input(plan, x), out_t, compressed)
    return transpose_columns(out_t, x.shape[0])


def _graph_us(calls: list) -> float:
    """Median GPU microseconds per call under CUDA-graph replay (what a graph-captured model sees), the
    graph calling each of `calls` (zero-argument callables, e.g. one a copy of W) in turn."""
    from ..runtime.timing import TimingContention, rotating_graph_time_us

    try:
        return rotating_graph_time_us(lambda call: call(), calls, repeats=15)
    except TimingContention:
        raise
    except RuntimeError:  # not capturable: the eager figure is the honest one
        return _eager_us(calls)


def _both_us(calls: list) -> tuple[float, float]:
    """(graph replay, eager) medians over `calls`: the first reads the W the layer runs with, the others
    copies of it, so that each call streams W from HBM."""
    return _graph_us(calls), _eager_us(calls)


def _eager_us(calls: list) -> float:
    """Median microseconds per call issued eagerly, back to back, each of `calls` in turn (at least 10 a
    sample): host time included where it dominates."""
    from ..runtime.timing import eager_time_us

    return eager_time_us(lambda call: call(), calls * max(1, -(-10 // len(calls))), repeats=15)
