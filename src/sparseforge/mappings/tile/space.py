"""The generated (row-group) family's part of the design space (tune/space.py gathers every family's): row
groups (autotune.py), row per block, inline, and the generated convolution's configs."""
from __future__ import annotations

import dataclasses

from ...plan import TileConfig, pick_vec
from ...plan.conv import conv_vector_width
from ...tune.space import SMS
from .autotune import candidates, column_warps

# Layers up to this many FMAs (nonzeros x vector width) also get inline candidates (config.inline): one
# module compiled whole, ~0.17 s at 1.6k, 1.9 s at 15k, 4.1 s at 30k FMAs on one core (ptxas 13.0, rn50 90%
# layers), against ~0.5 s for their called-function forms compiled in parallel.
INLINE_MAX_FMAS = 20_000


def row_per_block(n: int, layout: str) -> list[TileConfig]:
    """One row per block at vector width 1 (128 columns a block, the issue's reference) and at the widest
    vector N allows; two rows per block; a run of two single-row groups per block."""
    transposed = layout == "nk"
    vec = pick_vec(n, "kn", 4 if n >= 1024 else 2 if n >= 128 else 1)
    one = dict(warps_per_block=column_warps(n, vec, cap=4), vec=vec, load_batch=16)
    out = [TileConfig(rows_per_group=1, warps_per_block=column_warps(n, 1, cap=4), vec=1, load_batch=16),
           TileConfig(rows_per_group=1, **one),
           TileConfig(rows_per_group=2, cluster_rows=True, **one),
           TileConfig(rows_per_group=1, groups_per_block=2, **one)]
    return [dataclasses.replace(c, transpose_x=transposed) for c in out]


def inline(n: int, layout: str, m: int, row_nnz: float) -> list[TileConfig]:
    """Row per block with every row's code inline (the shape of the NVRTC reference kernel, which
    beat the called-function form by 1.0-1.25x), and two clustered rows at the pick's vector width."""
    vec = pick_vec(n, "kn", 4 if n >= 1024 else 2 if n >= 128 else 1)
    fits = lambda v: m * row_nnz * v <= INLINE_MAX_FMAS  # noqa: E731
    out = [TileConfig(rows_per_group=1, warps_per_block=column_warps(n, 1, cap=4), vec=1, load_batch=16,
                      inline=True)] if fits(1) else []
    if fits(vec):
        out.append(TileConfig(rows_per_group=2, warps_per_block=column_warps(n, vec, cap=4), vec=vec, load_batch=16,
                              cluster_rows=True, inline=True))
    return [dataclasses.replace(c, transpose_x=layout == "nk") for c in out]


def tile_candidates(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str, sms: int) -> list[TileConfig]:
    """The generated kernels' configs: row groups (autotune.candidates), row per block, inline."""
    return candidates(n, layout, row_nnz, relu, m) + row_per_block(n, layout) + inline(n, layout, m, row_nnz)


def conv_tile_candidates(geometry, w, relu: bool = False) -> list[TileConfig]:
    """The generated convolution's configs: the SpMM's row groups, row per block, split K and inline for
    M = Cout, N = OH*OW, at the vector width the bordered input allows (conv_vector_width: 1 for kernels wider
    than one column), duplicates dropped."""
    n, row_nnz = geometry.out_height * geometry.out_width, w.nnz / max(w.shape[0], 1)
    generated = []
    for config in tile_candidates(n, "kn", w.shape[0], row_nnz, relu, "float32", SMS):
        config = dataclasses.replace(config, vec=conv_vector_width(geometry, config.vec))
        if config not in generated:
            generated.append(config)
    return generated
