"""An unstructured weight as a 2:4 part plus a residual (issue 11's tensor-core path, its inspector half).

Sparse Tensor Cores multiply a 2:4 matrix (at most 2 nonzeros in every 4 consecutive columns of a row).
A magnitude-pruned matrix is not 2:4, but at 90% sparsity 99.6% of its 4-groups already hold at most 2
nonzeros (a group of 4 holds 3 or more with probability 0.37%), so W = W24 + R with W24 2:4 (each group's
2 largest |w|) and R small: Y = W24 X on Sparse Tensor Cores (cuSPARSELt) plus R X from an SpMM kernel
adding into Y. This module is that split, exact (W24 + R == W, every value in exactly one part), and its
statistics; the runtime composing the two products is not built yet.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..formats import SparseMatrix

GROUP = 4
KEEP = 2


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
