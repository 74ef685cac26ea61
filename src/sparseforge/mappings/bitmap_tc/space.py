"""The bitmap-tc family's part of the design space (tune/space.py gathers every family's)."""
from __future__ import annotations

from .plan import MAX_N, BitmapTcConfig

# (warps, stages[, scan group[, l2_ahead]]), scan group 1 and l2_ahead 0 where left out. Measured on the H200
# (benchmarks/designs.py --rotate-all, Llama shapes at 50 / 70 / 90%, fp16, weights rotated): X as N x K at N = 8,
# 3 buffers won 3 of 9 cases and came within 6% of the best in all; scans of 4 tiles ahead won most at N = 16 and
# within 9% everywhere; 4 warps with 4 buffers won 14336 x 4096 at 70 / 90%. 16 warps won none (12-36% behind),
# nor 2 buffers without scan groups (within 2-10%). At N = 1 delta-runs is 1.3-3.5x faster: not proposed there.
CONFIGS = ((8, 3), (8, 2, 4), (4, 4))
# compiled, checked, kept for other GPUs and shapes (benchmarks/designs.py times them); and, not yet timed, more
# chunks in flight an SM: at 50% an SM's 24 warps with one chunk each in flight hold about the 65 KB that 4.3 TB/s
# needs at 2 us of loaded latency (3 buffers won most cases at N = 8), so 4 and 6 buffers, and chunks 2 or 4
# further ahead prefetched into L2 (the fourth field)
TRIALS = ((8, 2), (16, 2), (8, 2, 8), (16, 2, 8), (4, 4, 8), (8, 4, 4), (4, 6, 4), (8, 2, 4, 2), (8, 3, 4, 2),
          (8, 2, 4, 4))


def _configs(table) -> list[BitmapTcConfig]:
    return [BitmapTcConfig(warps_per_block=w, stages=s, scan_group=rest[0] if rest else 1,
                           l2_ahead=rest[1] if len(rest) > 1 else 0) for w, s, *rest in table]


def bitmap_tc_candidates(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str,
                         sms: int) -> list[BitmapTcConfig]:
    """bitmap-tc configs for 16-bit dtypes at 2 <= N <= 16."""
    if dtype not in ("float16", "bfloat16") or not 2 <= n <= MAX_N:
        return []
    return _configs(CONFIGS)


def bitmap_tc_trials(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str,
                     sms: int) -> list[BitmapTcConfig]:
    """Configs not proposed by default (unmeasured=True: benchmarks/designs.py): the trials, and N = 1."""
    if dtype not in ("float16", "bfloat16") or n > MAX_N:
        return []
    return _configs(TRIALS + (CONFIGS if n == 1 else ()))
