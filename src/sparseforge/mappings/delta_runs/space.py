"""The delta-runs decode family's part of the design space (tune/space.py gathers every family's)."""
from __future__ import annotations

from .plan import DeltaRunsConfig

# measured on the H200 (benchmarks/proto/delta_runs_bench.py, Llama shapes at 50-90%, fp16 / bf16): 8 warps
# a block won every case, 2 or 4 quads in flight a lane
CONFIGS = ((8, 2), (8, 4), (4, 4), (16, 2))


def delta_runs_candidates(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str,
                          sms: int) -> list[DeltaRunsConfig]:
    """Delta-runs configs: N = 1 in float16 / bfloat16. N = 2..8 compile, and match float64 in the PTX
    interpreter, but have not been timed on a GPU: they are reachable by config= until they are."""
    if n != 1 or dtype not in ("float16", "bfloat16"):
        return []
    return [DeltaRunsConfig(warps_per_block=w, ahead=a) for w, a in CONFIGS]
