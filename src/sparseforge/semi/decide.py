"""Per (layer, input width, execution mode) choice between the 2:4 path and dense, made by measurement and
kept for inspection. Pure: the timings come in, a `Decision` comes out.

Two modes, because they rank the paths differently: under CUDA-graph replay only GPU time counts; called
eagerly, a call also costs its host time, which at small widths exceeds the GPU time (measured on the
H200 host: 2:4 at N = 1 was 1.22x faster than cuBLAS replayed in a graph and 0.41x called eagerly)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

SPARSE, DENSE = "2:4", "dense"

# 2:4 is taken only when it measured at least this much faster than dense: medians of repeated CUDA-event
# timings still move by ~1-2% between runs, and a tie is better served by the path with no plan to keep.
MIN_SPEEDUP = 1.03


@dataclass(frozen=True)
class Decision:
    n: int                         # input rows (tokens) the decision is for
    path: str                      # "2:4" or "dense"
    reason: str                    # why, in words
    sparse_us: float | None = None  # measured median per call of the 2:4 path, if measured
    dense_us: float | None = None   # measured median per call of dense cuBLAS, if measured
    config_id: int | None = None    # cuSPARSELt algorithm chosen by its search
    padded_n: int | None = None     # the width cuSPARSELt ran (input padded up to it), if different from n
    mode: str = "any"               # "graph" (GPU time, graph replay), "eager" (host time included) or "any"

    @property
    def speedup(self) -> float | None:
        if self.sparse_us and self.dense_us:
            return self.dense_us / self.sparse_us
        return None

    def as_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup}


def decide(n: int, sparse_us: float, dense_us: float, min_speedup: float = MIN_SPEEDUP, **extra) -> Decision:
    """The faster path by measurement, 2:4 only with a margin of `min_speedup`."""
    if not (sparse_us > 0 and dense_us > 0):
        raise ValueError(f"timings must be positive, got 2:4 {sparse_us} us, dense {dense_us} us")
    ratio = dense_us / sparse_us
    where = {"graph": " under graph replay", "eager": " called eagerly"}.get(extra.get("mode"), "")
    if ratio >= min_speedup:
        return Decision(n, SPARSE, f"2:4 measured {ratio:.2f}x faster than dense{where}", sparse_us, dense_us,
                        **extra)
    return Decision(n, DENSE, f"2:4 measured {ratio:.2f}x of dense{where} (< {min_speedup:.2f}x): dense kept",
                    sparse_us, dense_us, **extra)


def fixed(n: int, path: str, reason: str) -> Decision:
    """A decision made without measuring (policy, capture, unsupported shape or device)."""
    if path not in (SPARSE, DENSE):
        raise ValueError(f"path must be {SPARSE!r} or {DENSE!r}, got {path!r}")
    return Decision(n, path, reason)


@dataclass(frozen=True)
class WidthChoice:
    """The decisions for one input width: one per execution mode (the same one twice when not measured)."""
    eager: Decision
    graph: Decision

    @classmethod
    def both(cls, decision: Decision) -> "WidthChoice":
        return cls(decision, decision)

    @property
    def any_sparse(self) -> bool:
        return SPARSE in (self.eager.path, self.graph.path)

    def sparse(self, capturing: bool) -> bool:
        return (self.graph if capturing else self.eager).path == SPARSE

    def decisions(self) -> list[Decision]:
        return [self.eager] if self.eager is self.graph else [self.eager, self.graph]


def decide_modes(n: int, graph_us: tuple[float, float], eager_us: tuple[float, float],
                 min_speedup: float = MIN_SPEEDUP, **extra) -> WidthChoice:
    """(2:4, dense) timings under graph replay and called eagerly -> the decision for each mode."""
    graph = decide(n, *graph_us, min_speedup, mode="graph", **extra)
    eager = decide(n, *eager_us, min_speedup, mode="eager", **extra)
    return WidthChoice(eager, graph)
