"""The tc-scatter family's part of the design space (tune/space.py gathers every family's)."""
from __future__ import annotations

from .plan import TcScatterConfig

TC_SCATTER_MIN_N = 17  # with X as K x N, bitmap-tc beat it in all 18 Llama cases at N = 8 and 16 on the H200
# (fewer bytes a nonzero, no scatter through shared memory): below this, in kn, reachable by config= only. With
# X as N x K the two have not been timed side by side: both stay proposed
TC_SCATTER_MAX_N = 64  # the tensor cores do every 16 x 16 tile's dense work: past a few n-tiles the
# cuBLAS GEMM it then resembles is as fast (decode asks for N = 1..16, and up to 64 where it still wins)


def tc_scatter(n: int, dtype: str) -> list[TcScatterConfig]:
    """tc-scatter configs for 16-bit dtypes at N <= 64: 8 warps on a strip with 2 or 4 rounds read ahead,
    16 with 2 and 4 with 4 (more warps and more read-ahead: more bytes in flight for layers of few strips;
    fewer: less partial-sum traffic and fewer registers, so more warps an SM). On the H200
    8 warps won most LLM layers, 4 the 14336-row ones at N = 16, 16 the 1024-row ones."""
    if dtype not in ("float16", "bfloat16") or n > TC_SCATTER_MAX_N:
        return []
    return [TcScatterConfig(warps_per_block=w, ahead=a) for w, a in ((8, 2), (8, 4), (16, 2), (4, 4))]


def tc_scatter_candidates(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str,
                          sms: int) -> list[TcScatterConfig]:
    return tc_scatter(n, dtype) if n >= TC_SCATTER_MIN_N or layout == "nk" else []


def tc_scatter_trials(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str,
                      sms: int) -> list[TcScatterConfig]:
    """Below TC_SCATTER_MIN_N in kn, its configs for side-by-side timing only (unmeasured=True: designs.py)."""
    return tc_scatter(n, dtype) if n < TC_SCATTER_MIN_N and layout == "kn" else []
