"""The delta-runs decode family's part of the design space (tune/space.py gathers every family's)."""
from __future__ import annotations

from .plan import DeltaRunsConfig

# (warps, ahead, gap bits, overlap, X's staged bits). Measured on the H200 (benchmarks/designs.py --rotate-all,
# Llama shapes at 50 / 70 / 90%, fp16, weights rotated through HBM): the row's first loads issued before X's copy
# won 11 of 12 cases; 2 slots ahead beat 4; 4-bit gaps won where gaps are short (50-70% on 4096 x 4096 and
# 4096 x 14336), 8-bit ones elsewhere; X staged in 16 bits (half the bytes a block copies and holds) won at 90%
# and on 14336 x 4096, where many blocks each copy X; 4, 8 and 16 warps split the cases. Several rows a warp
# (X staged once for more rows) lost everywhere: a warp's rows in a chain hold fewer loads in flight.
CONFIGS = ((8, 2, 8, True, 32), (16, 2, 8, True, 32), (8, 2, 4, True, 32), (16, 2, 4, True, 32),
           (8, 2, 8, True, 16), (4, 2, 8, True, 16))
# compiled and checked against float64 in the PTX interpreter, not yet timed: persistent blocks (X copied once
# a block, the next row's record in flight while a row is summed) at N = 1 and N = 2..8, where the copy per
# block of warps made delta-runs 0.2-1.1x of cuBLAS at N = 8 (4096 x 8 fp32 is 128 KB: a block an SM); the
# last field is the persistent blocks an SM. With 4-bit gaps, also 1 slot ahead: 40 registers against 2 slots'
# 55 (6 blocks an SM of 8 warps, not 4), for the short rows (K = 4096 at 50%) where 4-bit gaps streamed slower
TRIALS_N1 = ((8, 2, 8, True, 32, 2), (8, 2, 4, True, 32, 2), (16, 2, 8, True, 16, 1),
             (8, 1, 4, True, 32, 0), (16, 1, 4, True, 32, 0))
TRIALS = ((16, 2, 8, False, 16, 1), (8, 2, 4, False, 16, 2), (8, 2, 8, False, 16, 2), (8, 2, 8, True, 16, 2),
          (8, 2, 8, False, 32, 0), (8, 2, 4, False, 32, 0))


def _configs(table, sms: int = 0) -> list[DeltaRunsConfig]:
    return [DeltaRunsConfig(warps_per_block=w, ahead=a, gap_bits=g, overlap=o, x_bits=x,
                            ctas=sms * rest[0] if rest else 0) for w, a, g, o, x, *rest in table]


def delta_runs_candidates(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str,
                          sms: int) -> list[DeltaRunsConfig]:
    """Delta-runs configs: N = 1 in float16 / bfloat16 (measured). The rest are delta_runs_trials."""
    if n != 1 or dtype not in ("float16", "bfloat16"):
        return []
    return _configs(CONFIGS)


def delta_runs_trials(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str,
                      sms: int) -> list[DeltaRunsConfig]:
    """Configs that compile and match float64 in the PTX interpreter but have not won a GPU timing: persistent
    blocks at N = 1, and N = 2..8. Proposed only with unmeasured=True (benchmarks/designs.py)."""
    if not 1 <= n <= 8 or dtype not in ("float16", "bfloat16"):
        return []
    return _configs(TRIALS_N1 if n == 1 else TRIALS, sms)
