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
- csr-columns (mappings/csr/plan.py, kn): W as data, a warp per row with lanes across N (Sputnik's tiling), for
  large layers at moderate N, where the generated code's instruction stream is what limits;
- bitmap (mappings/bitmap/, N = 1): W as a bitmap + packed values, the fewest bytes of W for decode, where
  the weight's bytes bound the layer. Its second design (lanes over interleaved columns, x and
  the values in shared memory) is proposed only with unmeasured=True until designs.py has measured it;
- tc-scatter (mappings/tc_scatter/, float16 / bfloat16, N <= 64): W's nonzeros scattered into dense 16 x 16
  tiles for the tensor cores (mma.m16n8k16): a few instructions a nonzero whatever N is, where the CUDA-core
  kernels gather B per nonzero (the decode and small batches);
- csr-staged (mappings/csr/plan.py, N <= 16): the small-N kernel with B copied into shared memory once per block and
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

from ..mappings.registry import SPMM, families

SMS = 132  # H100 / H200 SXM: csr-staged's persistent blocks are a multiple of the GPU's SM count
SMS_BY_ARCH = {90: 132, 80: 108, 86: 84, 89: 142}  # each arch's largest part (H100 SXM / H200, A100,
# RTX 3090, L40S)


def sm_count(arch: int) -> int:
    """The SMs csr-staged's persistent blocks are sized for on sm_<arch>: the arch's largest part, from the
    arch alone, so that prebuilding without a GPU and compile_spmm on one name the same kernels (the choice
    key holds the arch, not the part). A part with fewer SMs runs the extra blocks as a second, partial wave:
    correct, and the chooser times it against the other candidates (twice as many blocks, csr)."""
    return SMS_BY_ARCH.get(arch, SMS)


def search_space(n: int, layout: str, m: int, row_nnz: float, relu: bool = False,
                 deterministic: bool = False, unmeasured: bool = False, dtype: str = "float32", sms: int = SMS) -> list:
    """Every candidate config of every kernel family (mappings/registry.py, in its order) for an
    M-row weight with row_nnz nonzeros per row on average, at width n, in dtype (the tensor-core kernel takes
    16-bit dtypes only). deterministic: no candidate that adds partial sums with atomics.
    unmeasured: also the families and configs not yet run on a GPU, which the default space leaves out until
    benchmarks/designs.py has measured them (bitmap, split-24, bitmap-tc's trial configs and tc-scatter below
    17 columns today; inline and
    csr-columns were measured on the H200, 2026-12-01, csr-staged and prefetch 2026-12-03, and won layers:
    docs/history.md). sms: the
    GPU's SM count (sm_count: csr-staged's persistent blocks; configs whose copy of B does not fit the arch
    are refused when their plans are made)."""
    configs = []
    for family in families(SPMM):
        if family.candidates is not None and (family.proposed or unmeasured):
            configs += family.hook("candidates")(n, layout, m, row_nnz, relu, dtype, sms)
        if family.trials is not None and unmeasured:
            configs += family.hook("trials")(n, layout, m, row_nnz, relu, dtype, sms)
    if deterministic:
        configs = [c for c in configs if not getattr(c, "segment_nnz", 0)]
    unique = []
    for c in configs:
        if c not in unique:
            unique.append(c)
    return unique


