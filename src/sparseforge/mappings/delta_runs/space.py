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
# Timed on the H200 and lost (benchmarks/designs.py --rotate-all, Llama shapes at 50 / 70 / 90%, fp16, weights
# rotated), so not proposed, but reachable by config= and kept tested: persistent blocks (X copied once a block,
# the next row's record in flight; the last field is the blocks an SM) lost all 12 N = 1 cases to the configs
# above (by 10-70%) and at N = 8 ran 0.95x of cuBLAS where bitmap-tc and csr-staged ran faster; 4-bit gaps
# 1 slot ahead (40 registers against 55) lost all 12 N = 1 cases; N = 2..8 without persistent blocks ran 0.2-1.1x
KEPT_N1 = ((8, 2, 8, True, 32, 2), (8, 2, 4, True, 32, 2), (16, 2, 8, True, 16, 1),
           (8, 1, 4, True, 32, 0), (16, 1, 4, True, 32, 0))
KEPT = ((16, 2, 8, False, 16, 1), (8, 2, 4, False, 16, 2), (8, 2, 8, False, 16, 2), (8, 2, 8, True, 16, 2),
        (8, 2, 8, False, 32, 0), (8, 2, 4, False, 32, 0))


def _configs(table, sms: int = 0) -> list[DeltaRunsConfig]:
    return [DeltaRunsConfig(warps_per_block=w, ahead=a, gap_bits=g, overlap=o, x_bits=x,
                            ctas=sms * rest[0] if rest else 0) for w, a, g, o, x, *rest in table]


def delta_runs_candidates(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str,
                          sms: int) -> list[DeltaRunsConfig]:
    """Delta-runs configs: N = 1 in float16 / bfloat16 (measured; delta_runs_kept has the configs that lost)."""
    if n != 1 or dtype not in ("float16", "bfloat16"):
        return []
    return _configs(CONFIGS)


def delta_runs_kept(n: int, sms: int) -> list[DeltaRunsConfig]:
    """The configs that lost their GPU timing (KEPT_N1 at N = 1, KEPT at N = 2..8), for config= and the tests."""
    if not 1 <= n <= 8:
        return []
    return _configs(KEPT_N1 if n == 1 else KEPT, sms)
