"""The design space the chooser ranks: every mapping of the SpMM work, as plan options.

- row groups (plan/plan.py; autotune.candidates: clustered or consecutive rows, 1-8 rows a group, vector
  widths, groups per block, nk staged or transposed X);
- row per block: one row (or two) per block, every warp of the block on that row's code, across N; many
  blocks. A plain kernel of this shape beat the row-group pick on 26 of 43 held-out rn50 layers:
  it wins where M is small and K large (few row groups leave SMs idle), the row groups where B-row sharing
  pays (M large, K small);
- split K (segment_nnz): atomics, so not in deterministic mode;
- small N (mappings/csr/): W as data, warps over nonzeros, for N <= SMALL_N_MAX;
- inline: row per block (or two clustered rows) with every group's code in the kernel, no calls, for
  small layers (their compile grows superlinearly): 1.18-1.21x over the called form on rn50's N = 3136
  layers;
- csr-columns (plan/csr.py, kn): W as data, a warp per row with lanes across N (Sputnik's tiling), for
  large layers at moderate N, where the generated code's instruction stream is what limits;
- bitmap (mappings/bitmap/, N = 1): W as a bitmap + packed values, the fewest bytes of W for decode, where
  the weight's bytes bound the layer. Its second design (lanes over interleaved columns, x and
  the values in shared memory) is proposed only with unmeasured=True until designs.py has measured it;
- tc-scatter (mappings/tc_scatter/, float16 / bfloat16, N <= 64): W's nonzeros scattered into dense 16 x 16
  tiles for the tensor cores (mma.m16n8k16): a few instructions a nonzero whatever N is, where the CUDA-core
  kernels gather B per nonzero (the decode and small batches);
- csr-staged (plan/csr.py, N <= 16): the small-N kernel with B copied into shared memory once per block and
  blocks persistent over the rows: one LDS a nonzero where the small-N kernel gathers B from L1/L2, the
  bound at N = 1-16. Measured on the H200 (fp16 / bf16 Llama 4096 x 4096):
  the fastest csr kernel at N = 1, 8 and 16 from 70% sparsity on;
- prefetch (CsrConfig.prefetch, csr and csr-staged): the next step's index and value loads issued before
  the current step's work (software pipelining), one HBM round trip a row: with csr-staged, 3.7 us against
  csr's 4.0 at N = 1, 90% (2.55x over cuBLAS);
- split-24 (mappings/split24/, semi/split24.py; nk, float16 / bfloat16, N >= SPLIT24_MIN_N): W as a 2:4 part on
  Sparse Tensor Cores (cuSPARSELt) plus the few nonzeros its 4-groups could not keep as a residual SpMM: the
  tensor-core path for large N (prefill). Proposed only with unmeasured=True until designs.py has measured it;
Which one runs is the chooser's call (tune/choose.py), not a rule here: this module only proposes.
"""
from __future__ import annotations

import dataclasses

from ..plan import TileConfig, pick_vec
from ..mappings.registry import SPMM, families
from ..plan.conv import conv_vector_width
from .autotune import column_warps, candidates

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


SMS = 132  # H100 / H200 SXM: csr-staged's persistent blocks are a multiple of the GPU's SM count
SMS_BY_ARCH = {90: 132, 80: 108, 86: 84, 89: 142}  # each arch's largest part (H100 SXM / H200, A100,
# RTX 3090, L40S)


def sm_count(arch: int) -> int:
    """The SMs csr-staged's persistent blocks are sized for on sm_<arch>: the arch's largest part, from the
    arch alone, so that prebuilding without a GPU and compile_spmm on one name the same kernels (the choice
    key holds the arch, not the part). A part with fewer SMs runs the extra blocks as a second, partial wave:
    correct, and the chooser times it against the other candidates (twice as many blocks, csr)."""
    return SMS_BY_ARCH.get(arch, SMS)


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


def search_space(n: int, layout: str, m: int, row_nnz: float, relu: bool = False,
                 deterministic: bool = False, unmeasured: bool = False, dtype: str = "float32", sms: int = SMS) -> list:
    """Every candidate config of every kernel family (mappings/registry.py, in its order) for an
    M-row weight with row_nnz nonzeros per row on average, at width n, in dtype (the tensor-core kernel takes
    16-bit dtypes only). deterministic: no candidate that adds partial sums with atomics.
    unmeasured: also the families not yet run on a GPU, which the default space leaves out until
    benchmarks/designs.py has measured them (bitmap, split-24 today; inline and csr-columns were measured on
    the H200, 2026-12-01, csr-staged and prefetch 2026-12-03, and won layers: docs/history.md). sms: the
    GPU's SM count (sm_count: csr-staged's persistent blocks; configs whose copy of B does not fit the arch
    are refused when their plans are made)."""
    configs = []
    for family in families(SPMM):
        if family.candidates is not None and (family.proposed or unmeasured):
            configs += family.hook("candidates")(n, layout, m, row_nnz, relu, dtype, sms)
    if deterministic:
        configs = [c for c in configs if not getattr(c, "segment_nnz", 0)]
    unique = []
    for c in configs:
        if c not in unique:
            unique.append(c)
    return unique


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
