"""Per (layer, input width, execution mode) choice between the 2:4 path and dense, made by measurement and
kept for inspection. Pure: the timings come in, a `Decision` comes out.

Two modes, because they rank the paths differently: under CUDA-graph replay only GPU time counts; called
eagerly, a call also costs its host time, which at small widths exceeds the GPU time (measured on the
H200 host: 2:4 at N = 1 was 1.22x faster than cuBLAS replayed in a graph and 0.41x called eagerly)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..tune.choose import MIN_SPEEDUP, fastest_with_margin

SPARSE, DENSE = "2:4", "dense"
GEMV = "2:4-gemv"  # sparseforge's packed 2:4 GEMV on CUDA cores (decode widths), instead of cuSPARSELt
UNSTRUCTURED = "unstructured"  # the generated / CSR kernels of any pattern (nn.SparseLinear, SparseConv2d)
PATHS = (SPARSE, GEMV, UNSTRUCTURED, DENSE)


@dataclass(frozen=True)
class Decision:
    n: int                         # input rows (tokens) the decision is for
    path: str                      # "2:4" (cuSPARSELt), "2:4-gemv" (packed GEMV) or "dense"
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


def decide(n: int, sparse_us: float, dense_us: float, min_speedup: float = MIN_SPEEDUP, path: str = SPARSE,
           **extra) -> Decision:
    """The faster path by measurement (tune/choose.py), the sparse `path` only with a margin of `min_speedup`
    (MIN_SPEEDUP: the chooser's one margin)."""
    if not (sparse_us > 0 and dense_us > 0):
        raise ValueError(f"timings must be positive, got 2:4 {sparse_us} us, dense {dense_us} us")
    picked, ratio = fastest_with_margin({path: sparse_us, DENSE: dense_us}, DENSE, min_speedup)
    where = {"graph": " under graph replay", "eager": " called eagerly"}.get(extra.get("mode"), "")
    if picked == path:
        return Decision(n, path, f"{path} measured {ratio:.2f}x faster than dense{where}", sparse_us, dense_us,
                        **extra)
    return Decision(n, DENSE, f"{path} measured {ratio:.2f}x of dense{where} (< {min_speedup:.2f}x): dense kept",
                    sparse_us, dense_us, **extra)


def width_key(n, usage: str) -> int:
    """n as an input width (a positive int; numpy ints too, bools not) for a {width: ...} mapping, else a
    ValueError naming the key and `usage` (what the mapping takes)."""
    import operator

    try:
        count = operator.index(n)
    except TypeError:
        count = 0
    if isinstance(n, bool) or count < 1:
        raise ValueError(f"{usage}; got the key {n!r}")
    return count


def fixed(n: int, path: str, reason: str) -> Decision:
    """A decision made without measuring (policy, capture, unsupported shape or device)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
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
        return self.eager.path != DENSE or self.graph.path != DENSE

    def uses(self, path: str) -> bool:
        return path in (self.eager.path, self.graph.path)

    def path(self, capturing: bool) -> str:
        return (self.graph if capturing else self.eager).path

    def sparse(self, capturing: bool) -> bool:
        return self.path(capturing) != DENSE

    def decisions(self) -> list[Decision]:
        return [self.eager] if self.eager is self.graph else [self.eager, self.graph]


def decide_modes(n: int, sparse: dict[str, tuple[float, float]], dense: tuple[float, float],
                 min_speedup: float = MIN_SPEEDUP, **extra) -> WidthChoice:
    """Timings (graph replay, eager) of each sparse path and of dense -> per mode, the fastest sparse path
    against dense with the margin."""
    if not sparse:
        raise ValueError("no sparse path was timed")
    made = []
    for mode, i in (("eager", 1), ("graph", 0)):
        best = min(sparse, key=lambda path: sparse[path][i])
        made.append(decide(n, sparse[best][i], dense[i], min_speedup, path=best, mode=mode, **extra))
    return WidthChoice(*made)
