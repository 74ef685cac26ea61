"""The CSR families' part of the design space (tune/space.py gathers every family's): the small-N kernel,
csr-staged and their prefetching forms (csr), csr-columns, and the direct convolution's csr-columns configs."""
from __future__ import annotations

import dataclasses

from ...plan.conv import CONV_COLUMNS
from ...tune.space import SMS
from .plan import CsrColumnsConfig, CsrConfig

SMALL_N_MAX = 64  # widths where the small-N kernel is proposed (the target was N = 1..32; the chooser
# decides by measurement where it stops winning)


def small_n(n: int, row_nnz: float) -> list[CsrConfig]:
    """Lanes per row near the row's nonzeros / 8 (each lane then takes about two steps of 4), and all 32;
    columns per lane covering N up to 8 (16 for N > 8: fewer re-reads of W's data per column tile); one
    or two steps per iteration (two: half the dependent round trips, twice the registers)."""
    want = 4
    while want < 32 and want * 8 < row_nnz:
        want *= 2
    columns = [min(1 << (n - 1).bit_length(), 8)] + ([16] if n > 8 else [])
    return [CsrConfig(lanes, c, 4, unroll) for lanes in sorted({want, 32}) for c in columns
            for unroll in ((1, 2) if c <= 8 else (1,))]


STAGED_MAX_N = 16  # csr-staged holds N in one column tile (columns <= 16: a step's B values in registers)


def csr_staged(n: int, row_nnz: float, sms: int = SMS) -> list[CsrConfig]:
    """csr-staged configs (plan.py) for N <= STAGED_MAX_N: one column tile (columns: N rounded up to a
    power of two), lanes per row as small_n picks them, and the same threads an SM two ways: 16 warps in one
    block an SM, or 8 in two (a copy of B over 113 KB leaves room for one only: the launch then runs a
    second wave, which the timing shows); one or two steps in flight where the columns allow it."""
    if n > STAGED_MAX_N:
        return []
    want = 4
    while want < 32 and want * 8 < row_nnz:
        want *= 2
    columns = 1 << (n - 1).bit_length()
    return [CsrConfig(lanes, columns, warps, unroll, stage_b=True, ctas=blocks * sms)
            for lanes in sorted({want, 32}) for warps, blocks in ((16, 1), (8, 2))
            for unroll in ((1, 2) if columns <= 8 else (1,))]


def prefetched(configs: list[CsrConfig]) -> list[CsrConfig]:
    """The same small-N / csr-staged configs with the next step's loads issued ahead (CsrConfig.prefetch):
    one HBM round trip a row instead of one a step, for more registers."""
    return [dataclasses.replace(c, prefetch=True) for c in configs]


CSR_COLUMNS_MIN_N = 8  # below this most of a warp's 32 lanes would idle: the small-N kernel's ground


def csr_columns(n: int, row_nnz: float) -> list[CsrColumnsConfig]:
    """Column tiles of 32, 64 and 128 (1, 2, 4 columns a lane) up to the one that covers N; warps per row
    so that each warp takes about one or two chunks of 32 nonzeros, and twice that; 4 warps a block."""
    columns = [c for c in (1, 2, 4) if c == 1 or 32 * c // 2 < n]
    want = 1
    while want < 8 and want * 64 < row_nnz:
        want *= 2
    splits = sorted({want, min(8, 2 * want)})
    return [CsrColumnsConfig(c, s, max(1, 4 // s)) for c in columns for s in splits]


def csr_columns_candidates(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str,
                           sms: int) -> list[CsrColumnsConfig]:
    return csr_columns(n, row_nnz) if layout == "kn" and n >= CSR_COLUMNS_MIN_N else []


def csr_candidates(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str, sms: int) -> list[CsrConfig]:
    """The small-N kernel, csr-staged, and both prefetching, for N <= SMALL_N_MAX."""
    if n > SMALL_N_MAX:
        return []
    staged = csr_staged(n, row_nnz, sms)
    return small_n(n, row_nnz) + staged + prefetched(small_n(n, row_nnz) + staged)


def conv_columns_candidates(geometry, w, relu: bool = False) -> list[CsrColumnsConfig]:
    """The direct convolution's csr-columns configs: the SpMM's (N = OH*OW) with the pixels a lane it takes."""
    n, row_nnz = geometry.out_height * geometry.out_width, w.nnz / max(w.shape[0], 1)
    return [c for c in csr_columns(max(n, 8), row_nnz) if c.columns in CONV_COLUMNS] or [CsrColumnsConfig()]
