"""The delta-runs decode family's part of the design space (tune/space.py gathers every family's)."""
from __future__ import annotations

from .plan import DeltaRunsConfig

# measured on the H200 (benchmarks/proto/delta_runs_bench.py, Llama shapes at 50-90%, fp16 / bf16): 8 warps
# a block won every case, 2 or 4 slots in flight a lane
CONFIGS = ((8, 2), (8, 4), (4, 4), (16, 2))
# not yet timed on a GPU: 4-bit gaps (2.5 bytes a nonzero), the row's first loads before X's copy, and N = 2..8
# (warps, ahead, gap bits, overlap)
TRIALS_N1 = ((8, 2, 4, False), (8, 4, 4, False), (8, 2, 8, True), (8, 2, 4, True))
TRIALS_WIDE = ((8, 2, 8, False), (8, 4, 8, False), (8, 2, 4, False), (8, 2, 8, True))


def delta_runs_candidates(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str,
                          sms: int) -> list[DeltaRunsConfig]:
    """Delta-runs configs: N = 1 in float16 / bfloat16, 8-bit gaps (measured). 4-bit gaps, the overlapped
    first loads and N = 2..8 are delta_runs_trials until a GPU has timed them."""
    if n != 1 or dtype not in ("float16", "bfloat16"):
        return []
    return [DeltaRunsConfig(warps_per_block=w, ahead=a) for w, a in CONFIGS]


def delta_runs_trials(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str,
                      sms: int) -> list[DeltaRunsConfig]:
    """The configs that compile, and match float64 in the PTX interpreter, but have not been timed on a GPU:
    4-bit gaps, the overlapped first loads, and N = 2..8. Proposed only with unmeasured=True (benchmarks/designs.py) until they are."""
    if not 1 <= n <= 8 or dtype not in ("float16", "bfloat16"):
        return []
    return [DeltaRunsConfig(warps_per_block=w, ahead=a, gap_bits=g, overlap=o) for w, a, g, o in
            (TRIALS_N1 if n == 1 else TRIALS_WIDE)]
