"""The cost model's estimate of a bitmap-tc plan (tune/cost.py holds the GPU table and the shared terms)."""
from __future__ import annotations

from ...formats.bitmap_tiles import CHUNK_TILES, UNIT
from ...tune.cost import Estimate, Gpu
from .plan import BitmapTcPlan

# An SM's cycles a 16 x 16 tile, fitted to the H200 at N = 8 (benchmarks/designs.py and `bench llm:`, 4096 x 4096
# and 14336 x 4096 at 50 / 70 / 90%, weights rotated, 2026-12-04): the decode's dependent chain and its
# shared-memory and shuffle traffic, not W's bytes, bound the kernel, so its time moves little with density.
# (base, per unit of density, per n-tile past the first); B from L2 (kn) or staged with the weights (nk).
TILE_CYCLES = {"loaded": (28.4, 12.0, 20.6), "staged": (26.5, 25.0, 8.0)}


def bitmap_tc_estimate(plan: BitmapTcPlan, batch: int, gpu: Gpu) -> Estimate:
    """bitmap-tc: every tile's decode at the fitted rate (empty tiles too: a lane walks its 8 slots whatever
    they hold), spread over the SMs or, for layers of few strips, one strip's tiles on one SM; W's tiles
    streamed from HBM as fast as the chunks in flight allow (stages - 1 a busy warp, times the warps an SM
    holds by shared memory and registers)."""
    c, f, es = plan.config, plan.format, plan.element_bytes
    chunks = f.strips * f.chunks_per_strip
    tiles = chunks * CHUNK_TILES
    base, per_density, per_n_tile = TILE_CYCLES["staged" if plan.b_loads == "wide" else "loaded"]
    density = plan.nnz / max(plan.M * plan.K, 1)
    cycles = base + per_density * density + per_n_tile * (plan.n_tiles - 1)
    tiles_per_sm = max(tiles / gpu.sms, f.chunks_per_strip * CHUNK_TILES)
    decode = batch * tiles_per_sm * cycles / gpu.clock_hz
    blocks_per_sm = max(1, min(gpu.registers // (c.threads * plan.registers),
                               (227 * 1024) // plan.dynamic_shared_bytes, gpu.max_warps // c.warps_per_block))
    busy = min(c.warps_per_block, -(-f.chunks_per_strip // plan.chunks_per_warp))  # warps of a block with chunks
    resident = min(f.strips * busy, gpu.sms * blocks_per_sm * busy)
    chunk_bytes = f.units * UNIT / max(chunks, 1)
    rate = min(gpu.hbm_bytes_per_s, resident * (c.stages - 1) * chunk_bytes / gpu.hbm_latency_s)
    streamed = (plan.bytes_read() + plan.M * plan.N * es) * batch / rate
    terms = {"issue": decode * 1e6, "operand": streamed * 1e6, "ifetch": 0.0, "latency": 0.0}
    return Estimate(gpu.launch_us + max(terms.values()), terms, 0.3)
