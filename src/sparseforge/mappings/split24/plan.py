"""An unstructured weight as a 2:4 part plus a residual (the tensor-core path, its inspector half).

Sparse Tensor Cores multiply a 2:4 matrix (at most 2 nonzeros in every 4 consecutive columns of a row).
A magnitude-pruned matrix is not 2:4, but at 90% sparsity 99.6% of its 4-groups already hold at most 2
nonzeros (a group of 4 holds 3 or more with probability 0.37%), so W = W24 + R with W24 2:4 (each group's
2 largest |w|) and R small: Y = W24 X on Sparse Tensor Cores (cuSPARSELt) plus R X from an SpMM kernel
adding into Y. This module is that split, exact (W24 + R == W, every value in exactly one part), its
statistics, and the chooser's plan option for it (Split24Plan: mapping "split-24", layout "nk", 16-bit
dtypes); semi/split24.py is its runtime (the cuSPARSELt product, the transpose to X's layout, the residual's
own SpMM kernel adding in place).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...formats import SparseMatrix

GROUP = 4
KEEP = 2
DIM_MULTIPLE = 16  # cuSPARSELt's 16-bit 2:4 weights: M and K multiples of 16 (semi/cusparselt.check_weight)
SPLIT24_DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class Split24:
    part24: SparseMatrix   # 2:4 along K: at most 2 nonzeros in each group of 4 consecutive columns
    residual: SparseMatrix  # what the groups held beyond their 2 largest |w|
    groups: int            # 4-groups of W (M x K/4)
    overflow_groups: int   # groups that held 3 or 4 nonzeros

    @property
    def residual_fraction(self) -> float:
        """The residual's share of W's nonzeros: the work left to the CUDA-core SpMM."""
        total = self.part24.nnz + self.residual.nnz
        return self.residual.nnz / total if total else 0.0

    @property
    def fitting_groups_fraction(self) -> float:
        """The share of 4-groups that already were 2:4."""
        return 1 - self.overflow_groups / self.groups if self.groups else 1.0


def split_24(w: SparseMatrix) -> Split24:
    """W = part24 + residual: in every group of 4 consecutive columns of a row, the 2 largest |w| go to
    part24 (ties by the lower column, as a stable sort keeps them), the rest to residual. K must be a
    multiple of 4 (Sparse Tensor Cores need more: cuSPARSELt refuses what its own checks name)."""
    m, k = w.shape
    if k % GROUP:
        raise ValueError(f"K = {k}: a 2:4 split groups K in fours; pad W to a multiple of 4 columns")
    rows = np.repeat(np.arange(m, dtype=np.int64), w.row_nnz)
    cols = w.indices.astype(np.int64)
    group = rows * (k // GROUP) + cols // GROUP
    magnitude = np.abs(w.values.astype(np.float64))
    # within each group, rank the nonzeros by |w| descending (stable: the lower column first on ties)
    order = np.lexsort((cols, -magnitude, group))
    sorted_group = group[order]
    first = np.concatenate([[0], np.flatnonzero(np.diff(sorted_group)) + 1]) if order.size else np.zeros(0, np.int64)
    counts = np.diff(np.concatenate([first, [order.size]]))  # nonzeros of each nonempty group
    rank = np.arange(order.size) - np.repeat(first, counts)
    keep = np.zeros(order.size, bool)
    keep[order[rank < KEEP]] = True
    overflow = int(np.count_nonzero(counts > KEEP))
    return Split24(_subset(w, rows, keep), _subset(w, rows, ~keep), m * (k // GROUP), overflow)


def _subset(w: SparseMatrix, rows: np.ndarray, mask: np.ndarray) -> SparseMatrix:
    """The nonzeros of W where mask holds, as a SparseMatrix of W's shape (rows stay sorted by column)."""
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows[mask], minlength=w.shape[0]))]).astype(np.int64)
    return SparseMatrix(indptr, w.indices[mask], w.values[mask], w.shape, w.dtype)


@dataclass(frozen=True)
class Split24Config:
    """The split-24 mapping has no tiling of its own: cuSPARSELt searches its algorithm per width, and the
    residual's kernel is chosen for R by the same chooser."""

    def short(self) -> str:
        return "split24"


@dataclass(frozen=True)
class Split24Plan:
    """Y (N x M) = X (N x K) W^T + bias as W24 on Sparse Tensor Cores plus R on an SpMM kernel."""
    M: int
    K: int
    N: int
    dtype: str
    split: Split24 = field(repr=False)
    bias: tuple[float, ...] | None = None
    arch: int = 90
    digest: str = ""
    config: Split24Config = Split24Config()
    layout: str = "nk"

    family = "split-24"
    mapping = "split-24"
    relu = False
    residual = False
    partial_rows: tuple[int, ...] = ()

    @property
    def nnz(self) -> int:
        return self.split.part24.nnz + self.split.residual.nnz

    @property
    def name(self) -> str:
        return f"split24_{self.M}x{self.K}_n{self.N}_{self.dtype}_{self.digest[:12]}"


def make_split24_plan(w: SparseMatrix, n: int, dtype: str, layout: str, config: Split24Config, bias=None,
                      relu: bool = False, arch: int = 90, residual: bool = False) -> Split24Plan:
    """The split-24 plan of W at width n, or ValueError naming why this problem cannot take it: the product is
    X W^T with X (n x K) (layout "nk"), in float16 / bfloat16, with M and K multiples of 16, on sm_80 or newer,
    without a fused ReLU or residual (the two products would have to meet before them)."""
    if layout != "nk":
        raise ValueError("split-24 computes Y = X W^T (layout 'nk'): cuSPARSELt multiplies the 2:4 part by X as "
                         "it lies")
    if dtype not in SPLIT24_DTYPES:
        raise ValueError(f"split-24 runs on Sparse Tensor Cores, which take {' or '.join(SPLIT24_DTYPES)}; "
                         f"got {dtype}")
    m, k = w.shape
    if m % DIM_MULTIPLE or k % DIM_MULTIPLE:
        raise ValueError(f"split-24 needs M and K multiples of {DIM_MULTIPLE} (cuSPARSELt), got {m} x {k}")
    if relu or residual:
        raise ValueError("split-24 fuses no ReLU or residual: its two products meet in the output first")
    if arch < 80:
        raise ValueError(f"split-24 needs Sparse Tensor Cores (sm_80 or newer), got sm_{arch}")
    return Split24Plan(m, k, int(n), dtype, split_24(w), None if bias is None else tuple(float(b) for b in bias),
                       arch, w.digest(), config)


def split24_traffic(plan: Split24Plan) -> dict[str, int]:
    """W24 compressed (half its values + 2 bits each), X, Y^T written and read back by the transpose, Y
    written, R as CSR; and the floor (W24, X and Y once)."""
    es = 2
    w24 = plan.M * plan.K // 2 * es + plan.M * plan.K // 8
    x, y = plan.N * plan.K * es, plan.M * plan.N * es
    return {"fetched_bytes": w24 + x + 3 * y + plan.split.residual.nnz * (es + 4), "floor_bytes": w24 + x + y}
