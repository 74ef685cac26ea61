"""A numpy executor of a Plan: what the generated kernel computes, step for step, on the CPU.

It walks the same groups and column uses the lowering walks, so agreement with W @ B proves the plan
covers every nonzero exactly once; coverage() checks that directly.
"""
from __future__ import annotations

import numpy as np

from ..formats import SparseMatrix
from .plan import Plan


def execute_decoded(plan, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """What a W-as-data kernel computes in float64, given W (M x K) decoded out of the plan's own layout (so a
    layout bug shows as a wrong product): W B, plus the plan's bias, then its ReLU. b: [batch,] K x N (kn) or
    [batch,] N x K (nk); returns C / Y likewise."""
    b = np.asarray(b, dtype=np.float64)
    out = w @ (b if plan.layout == "kn" else np.swapaxes(b, -1, -2))
    if plan.bias is not None:
        out = out + np.asarray(plan.bias)[:, None]
    if plan.relu:
        out = np.maximum(out, 0)
    return out if plan.layout == "kn" else np.swapaxes(out, -1, -2)


def execute(plan: Plan, b: np.ndarray) -> np.ndarray:
    """Run the plan in float64. b: [batch,] K x N (kn) or [batch,] N x K (nk); returns C / Y likewise."""
    b = np.asarray(b, dtype=np.float64)
    if b.ndim == 3:
        return np.stack([execute(plan, one) for one in b])
    operand = b if plan.layout == "kn" else b.T
    if operand.shape != (plan.K, plan.N):
        want = (plan.K, plan.N) if plan.layout == "kn" else (plan.N, plan.K)
        raise ValueError(f"B has shape {b.shape}, the plan expects {want}")
    out = np.full((plan.M, plan.N), np.nan)
    out[list(plan.partial_rows)] = 0.0  # what the launch does before the kernel
    for group in plan.groups:
        acc = np.zeros((len(group.rows), plan.N))
        if plan.bias is not None and group.segment == 0:
            acc += np.array([plan.bias[r] for r in group.rows])[:, None]
        for column in group.columns:
            row_of_b = operand[column.k]
            for slot, weight in column.uses:
                acc[slot] += weight * row_of_b
        if group.partial:
            out[list(group.rows)] += acc  # the kernel's atomic add
            continue
        if plan.relu:
            acc = np.maximum(acc, 0.0)
        out[list(group.rows)] = acc
    return out if plan.layout == "kn" else out.T


def coverage(plan: Plan) -> np.ndarray:
    """How many times the plan visits each (row, k): must equal W's pattern (ones at nonzeros)."""
    counts = np.zeros((plan.M, plan.K), dtype=np.int64)
    for group in plan.groups:
        for column in group.columns:
            for slot, _ in column.uses:
                counts[group.rows[slot], column.k] += 1
    return counts


def check_plan(plan: Plan, w: SparseMatrix) -> None:
    """Raise AssertionError unless every row is written once (a split group's pieces together count as
    once: all of them present, none also written whole) and every nonzero used exactly once."""
    written = np.bincount([r for g in plan.groups if not g.partial for r in g.rows], minlength=plan.M)
    pieces: dict[tuple[int, ...], list[int]] = {}
    for g in plan.groups:
        if g.partial:
            pieces.setdefault(g.rows, []).append(g.segment)
            if sorted(pieces[g.rows]) == list(range(g.segments)):
                written[list(g.rows)] += 1
    if not (written == 1).all():
        raise AssertionError(f"rows written other than once: {np.nonzero(written != 1)[0][:10].tolist()}")
    pattern = np.zeros(w.shape, dtype=np.int64)
    pattern[np.repeat(np.arange(w.shape[0]), w.row_nnz), w.indices] = 1
    if not np.array_equal(coverage(plan), pattern):
        raise AssertionError("the plan's column uses do not cover W's nonzeros exactly once")
