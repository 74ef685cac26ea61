"""The bitmap-tc family's part of the design space (tune/space.py gathers every family's)."""
from __future__ import annotations

from .plan import MAX_N, MAX_N_SHARED_B, N_TILE, BitmapTcConfig, grouped_columns

# (warps, stages[, scan group[, l2_ahead]]) or a config: scan group 1 and l2_ahead 0 where left out. Measured on the
# H200 (benchmarks/designs.py --rotate-all, Llama shapes at 50 / 70 / 90%, fp16, weights rotated): X as N x K at
# N = 8, 3 buffers won 3 of 9 cases and came within 6% of the best in all; scans of 4 tiles ahead won most at
# N = 16 and within 9% everywhere; 4 warps with 4 buffers won 14336 x 4096 at 70 / 90%. 16 warps won none (12-36%
# behind), nor 2 buffers without scan groups (within 2-10%). At N = 1 delta-runs is 1.3-3.5x faster: not proposed
# there.
CONFIGS = ((8, 3), (8, 2, 4), (4, 4))
# compiled, checked, kept for other GPUs and shapes (benchmarks/designs.py times them). More chunks in flight lost
# on the H200 (N = 8, X as N x K, rotated): 4 and 6 buffers and the L2 prefetch ahead (fourth field) were 0-9%
# behind 3 buffers. With B's loads replaced by constants the kernel ran 27% faster (4096 x 4096, 70%), but warps over
# 2 strips (each B fragment feeds 2 mmas) gained only where strips are many (14336 x 4096: 2-10% at N = 16, even at
# N = 8) and lost up to 33% elsewhere (half the blocks); 4 strips lost everywhere. Not yet timed: registers, not
# bytes, hold an SM to 16-20 warps (80-86 a thread), so blocks_per_sm asks ptxas for fewer; b_ahead takes B's load
# latency off the mma's path; k_split spreads layers of few strips (1024 rows) over more blocks; b_shared stages B's
# chunk once a block for its warps' strips, the kernel for N = 17-64 (B from L2 a strip ran 0.21x of cuBLAS at 64)
# and a try at 8-16. Timed at N = 32 / 64 (X as N x K, Llama shapes at 50 / 70 / 90%, rotated): the best b_shared
# config or tc-scatter came to 0.77x / 0.49x of cuBLAS (geomean), and on 4096 x 14336 no faster at 90% than at 70%: not bytes but
# latency, with 2 blocks of 4 warps an SM (180 registers, 80 KB of shared memory at N = 64) and each n-tile's 4
# mmas one dependent chain. The mmas now go tile by tile across the n-tiles (not yet timed); K split over 8 blocks
# gives the 4096-row shapes 512 blocks (4 warps each).


def _trial(warps: int, stages: int, scan_group: int, **more) -> BitmapTcConfig:
    return BitmapTcConfig(warps_per_block=warps, stages=stages, scan_group=scan_group, **more)


TRIALS = ((8, 2), (16, 2), (8, 2, 8), (16, 2, 8), (4, 4, 8), (8, 4, 4), (4, 6, 4), (8, 2, 4, 2), (8, 3, 4, 2),
          (8, 2, 4, 4),
          _trial(8, 2, 4, strips=2), _trial(4, 2, 4, strips=2), _trial(4, 3, 2, strips=2),
          _trial(8, 2, 4, blocks_per_sm=3), _trial(8, 2, 4, blocks_per_sm=4), _trial(8, 2, 4, blocks_per_sm=5),
          _trial(8, 3, 1, blocks_per_sm=3), _trial(8, 2, 8, blocks_per_sm=4), _trial(4, 2, 4, blocks_per_sm=8),
          _trial(4, 3, 4, blocks_per_sm=6), _trial(16, 2, 4, blocks_per_sm=2),
          _trial(8, 3, 1, b_ahead=1), _trial(8, 2, 4, b_ahead=1), _trial(4, 4, 1, b_ahead=1),
          _trial(8, 2, 4, blocks_per_sm=3, b_ahead=1),
          _trial(8, 3, 1, k_split=2), _trial(8, 2, 4, k_split=4), _trial(4, 4, 1, k_split=4),
          _trial(8, 2, 4, k_split=8),
          _trial(8, 2, 4, b_shared=1), _trial(8, 3, 4, b_shared=1), _trial(4, 3, 4, b_shared=1),
          _trial(4, 4, 2, b_shared=1), _trial(8, 2, 4, b_shared=1, k_split=2), _trial(8, 2, 4, b_shared=1, k_split=4),
          _trial(4, 3, 4, b_shared=1, k_split=4), _trial(4, 3, 4, b_shared=1, k_split=8))


def _configs(table) -> list[BitmapTcConfig]:
    return [entry if isinstance(entry, BitmapTcConfig) else
            BitmapTcConfig(warps_per_block=entry[0], stages=entry[1], scan_group=entry[2] if len(entry) > 2 else 1,
                           l2_ahead=entry[3] if len(entry) > 3 else 0)
            for entry in table]


def bitmap_tc_candidates(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str,
                         sms: int) -> list[BitmapTcConfig]:
    """bitmap-tc configs for 16-bit dtypes at 2 <= N <= 16."""
    if dtype not in ("float16", "bfloat16") or not 2 <= n <= MAX_N:
        return []
    return _configs(CONFIGS)


def bitmap_tc_trials(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str,
                     sms: int) -> list[BitmapTcConfig]:
    """Configs not proposed by default (unmeasured=True: benchmarks/designs.py): the trials, and N = 1; with B
    staged a block (b_shared) at N = 8-64 and X as N x K."""
    if dtype not in ("float16", "bfloat16") or n > MAX_N_SHARED_B:
        return []
    return [c for c in _configs(TRIALS + (CONFIGS if n == 1 else ()))
            if (n >= N_TILE and layout == "nk" if c.b_shared else n <= MAX_N)
            and (c.strips == 1 or n >= N_TILE) and (not c.b_ahead or grouped_columns(n, layout))]
