"""The row-group neighbourhood of the design space (tune/space.py adds the other mappings): the heuristic
pick (measured rules, below) and its neighbours in rows per group, vector width, groups per block, split K
and, for nk, staging X. Ranking and timing are the chooser's (tune/choose.py)."""
from __future__ import annotations

import dataclasses
import math

from ...plan import TileConfig, pick_vec


def column_warps(n: int, vec: int, cap: int = 8) -> int:
    """Fewest power-of-two warps covering N columns, at most cap (more warps: more share one fetch)."""
    warps = 1
    while warps < cap and warps * 32 * vec < n:
        warps *= 2
    return warps


def _kn(n: int, rows: int, vec: int, groups: int = 1) -> TileConfig:
    vec = pick_vec(n, "kn", vec)
    # 16 loads in flight per warp: with few warps per SM the kernels are latency-bound (measured: 8 in
    # flight left a 100k-nonzero kernel at 0.12 instructions per clock on the H200)
    return TileConfig(rows_per_group=rows, warps_per_block=column_warps(n, vec), vec=vec, load_batch=16,
                      groups_per_block=groups)


# Small-N kn layers are split by default (segment_nnz a quarter of a group) when their rows average at
# least SPLIT_ROW_NNZ nonzeros and the unsplit launch has at most SPLIT_MAX_ITEMS work items (row groups x
# column tiles), under one per SM of an H200 (132): splitting buys warps where too few exist. Measured on
# the H200 (rn50 90%, fp32, batch 1): M <= 512 with K >= 1024 (~100+ nonzeros per row, <= 128 items) ran
# 1.3-2.3x faster split; K <= 512 (~50 per row) 0.6-1.0x, as did the Transformer's K = 512 at N = 256;
# M >= 1000 (250+ items) 0.6-0.75x even with long rows.
SPLIT_ROW_NNZ = 90
SPLIT_MAX_ITEMS = 132


def default_config(n: int, layout: str, row_nnz: float | None = None, relu: bool = False,
                   m: int | None = None) -> TileConfig:
    """The pick without measurement; row_nnz (mean nonzeros per row) and m (rows) let long-row layers with
    too few work items split."""
    if layout == "nk":
        # X transposed by the launch, then read like B in kn: measured 1.06-2.0x faster than staging X
        # through shared memory on all six Transformer layer-0 matrices (H200, fp32, N = 256)
        return dataclasses.replace(_kn(n, 4, 1), transpose_x=True)
    # rows grouped by shared columns: measured 1.02-1.23x faster on all 12 rn50 90% layers of designs.py
    # (geomean 1.10x, fp32, batch 1), 0.95-1.24x on the Transformer at N = 256 (geomean 1.02x)
    first = dataclasses.replace(_kn(n, 4, 4 if n >= 1024 else 2 if n >= 128 else 1), cluster_rows=True)
    if n > 256 or relu or not row_nnz or row_nnz < SPLIT_ROW_NNZ or not m:  # measured only at N <= 256
        return first
    if _work_items(first, n, m) > SPLIT_MAX_ITEMS:
        return first
    return dataclasses.replace(first, segment_nnz=max(int(row_nnz * first.rows_per_group / 4), 4))


def _work_items(config: TileConfig, n: int, m: int) -> int:
    """Row groups x column tiles of an unsplit kn launch."""
    return math.ceil(m / config.rows_per_group) * math.ceil(n / (config.warps_per_block * 32 * config.vec))


def split_candidates(first: TileConfig, n: int, group_nnz: float | None, m: int | None = None) -> list[TileConfig]:
    """Configs that split groups (segment_nnz), given the mean nonzeros of a default group: at twice the
    mean only outlier groups (long rows) are cut; where few work items leave few warps per SM (small N,
    or m rows making at most SPLIT_MAX_ITEMS items), a quarter or half of the mean multiplies the warps."""
    if not group_nnz or group_nnz < 2:
        return []
    few = n <= 256 or (m is not None and _work_items(first, n, m) <= SPLIT_MAX_ITEMS)
    fractions = (0.25, 0.5, 2.0) if few else (2.0,)
    return [dataclasses.replace(first, segment_nnz=max(int(group_nnz * f), 4)) for f in fractions]


# B rows per chunk of a run (kn). Measured slower on the H200 in both forms, so the tuner does not propose
# it: a function per (group, chunk) with accumulators through .param 2.4-3.3x slower than unchunked; one
# function per run, groups inline and chunk-outer (codegen/ptx.py: _run_function), still 1.05-4.3x slower
# on 11 of 12 rn50 90% layers and all 8 Transformer layers (designs.py, fp32: geomean 0.69x of cuBLAS
# against 1.24x unchunked on rn50), although the traffic model (plan.operand_bytes) predicts L2 fetches of B
# cut 1.64x by runs of 4 and 2.92x by runs of 8 over clustered rows: B re-reads hit L2, and a run's longer
# dependent FMA chains and register pressure cost more than they save.
CHUNK_K = 64


def chunked_candidates(first: TileConfig, n: int) -> list[TileConfig]:
    """A run of 4 groups at the pick's vector width, and a run of 8 clustered groups at vec 1 (kn)."""
    long_run = dataclasses.replace(_kn(n, first.rows_per_group, 1, 8), chunk_k=CHUNK_K, cluster_rows=True)
    return [dataclasses.replace(first, groups_per_block=4, chunk_k=CHUNK_K, cluster_rows=False), long_run]


def candidates(n: int, layout: str, row_nnz: float | None = None, relu: bool = False,
               m: int | None = None) -> list[TileConfig]:
    """Heuristic pick first, then (unless relu, which splits cannot fuse) splitting variants, then
    neighbours in rows per group, vector width, groups per block and (nk) staging X."""
    first = default_config(n, layout, row_nnz, relu, m)
    if layout == "nk":
        staged = [TileConfig(rows_per_group=r, warps_per_block=w, vec=1) for r, w in ((4, 8), (8, 8), (2, 8), (4, 16),
                                                                                       (4, 4))]
        pool = [dataclasses.replace(first, rows_per_group=8), *staged]
        unsplit = first
    else:
        unsplit = dataclasses.replace(first, segment_nnz=0)
        v = first.vec
        pool = [unsplit, dataclasses.replace(first, cluster_rows=False), dataclasses.replace(first, rows_per_group=4, load_batch=32, groups_per_block=1, segment_nnz=0,
                                                                      cluster_rows=False), _kn(n, 8, v), _kn(n, 2, v),
                _kn(n, 4, max(v // 2, 1)), _kn(n, 4, min(v * 2, 4)), _kn(n, 4, v, 2), _kn(n, 1, v),
                _kn(n, 8, max(v // 2, 1))]
    group_nnz = row_nnz * unsplit.rows_per_group if row_nnz else None
    out = [first]
    for config in ([] if relu else split_candidates(unsplit, n, group_nnz, m)) + pool:
        if config not in out:
            out.append(config)
    return out
