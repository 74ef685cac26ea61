"""Per (layer, input width) choice between the 2:4 path and dense, made by measurement and kept for
inspection. Pure: the timings come in, a `Decision` comes out."""
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
    if ratio >= min_speedup:
        return Decision(n, SPARSE, f"2:4 measured {ratio:.2f}x faster than dense", sparse_us, dense_us, **extra)
    return Decision(n, DENSE, f"2:4 measured {ratio:.2f}x of dense (< {min_speedup:.2f}x): dense kept",
                    sparse_us, dense_us, **extra)


def fixed(n: int, path: str, reason: str) -> Decision:
    """A decision made without measuring (policy, capture, unsupported shape or device)."""
    if path not in (SPARSE, DENSE):
        raise ValueError(f"path must be {SPARSE!r} or {DENSE!r}, got {path!r}")
    return Decision(n, path, reason)
