"""The cost model's estimate of a bitmap-tc plan (tune/cost.py holds the GPU table and the shared terms)."""
from __future__ import annotations

from ...formats.bitmap_tiles import CHUNK_TILES, UNIT
from ...tune.cost import Estimate, Gpu
from .plan import BitmapTcPlan

# An SM's cycles a 16 x 16 tile, fitted to the H200 (benchmarks/designs.py --rotate-all, 4096 x 4096, 14336 x 4096
# and 4096 x 14336 at 50 / 70 / 90%, fp16, each case's best config, weights rotated; within 12% of those 27 cases):
# the decode, not W's bytes, bounds the kernel (14336 x 4096 at 50%: 2.2 TB/s), and it grows with the values a lane
# loads. (base, per unit of density, per n-tile past the first); B by 16-byte loads (X as N x K, N = 8 and 16) or
# loaded at the tile (X as K x N, N = 8; its n-tile term from an earlier kernel at N = 16).
TILE_CYCLES = {"loaded": (19.7, 19.9, 20.6), "wide": (17.9, 25.4, 6.0)}
# config.b_shared (B read from the block's copy in shared memory): not yet fitted. The decode is the same; an n-tile
# past the first costs a tile half a 16-byte shared load (2 of the SM's 128-byte wavefronts) and an mma (about 1.5
# cycles an SM for mma.sync on Hopper), so 3 cycles, not the 6 of B loaded from L1 / L2
SHARED_B_N_TILE_CYCLES = 3.0
# ...and a warp walks all its strip's chunks of the block alone: a tile's dependent chain (scan, value loads, mma)
# is not hidden by other warps of its strip. A prior, not fitted: scans of 4 tiles overlap, about 80 cycles a tile
WARP_TILE_CYCLES = 80.0


def bitmap_tc_estimate(plan: BitmapTcPlan, batch: int, gpu: Gpu) -> Estimate:
    """bitmap-tc: every tile's decode at the fitted rate (empty tiles too: a lane walks its 8 slots whatever
    they hold), spread over the SMs or, for layers of few strips, one strip's tiles on one SM; W's tiles
    streamed from HBM as fast as the chunks in flight allow (stages - 1 a busy warp, times the warps an SM
    holds by shared memory and registers)."""
    c, f, es = plan.config, plan.format, plan.element_bytes
    weights = len(plan.formats)  # a gated kernel decodes G's tiles beside W's
    chunks = f.strips * f.chunks_per_strip * weights
    tiles = chunks * CHUNK_TILES
    base, per_density, per_n_tile = TILE_CYCLES["wide" if plan.b_loads == "wide" else "loaded"]
    density = plan.nnz / max(plan.M * plan.K * weights, 1)
    if plan.warp_strips:
        per_n_tile = SHARED_B_N_TILE_CYCLES
    cycles = base + per_density * density + per_n_tile * (plan.n_tiles - 1)
    block_tiles = plan.chunks_per_block * CHUNK_TILES * (plan.strips_per_block if plan.warp_strips else plan.sources)
    tiles_per_sm = max(tiles / gpu.sms, block_tiles)  # at least a block's
    decode = batch * tiles_per_sm * cycles / gpu.clock_hz
    if plan.warp_strips:  # one warp's chunks in a row
        decode = max(decode, batch * plan.chunks_per_warp * CHUNK_TILES * WARP_TILE_CYCLES / gpu.clock_hz)
    blocks_per_sm = max(1, min(gpu.registers // (c.threads * plan.registers),
                               (227 * 1024) // plan.dynamic_shared_bytes, gpu.max_warps // c.warps_per_block))
    busy = c.warps_per_block if plan.warp_strips else \
        min(c.warps_per_block, -(-plan.chunks_per_block // plan.chunks_per_warp))  # warps of a block with chunks
    blocks = plan.grid[0] * plan.grid[1]  # a block: config.strips strips, or its part of k_split
    resident = min(blocks * busy, gpu.sms * blocks_per_sm * busy)
    chunk_bytes = sum(x.units for x in plan.formats) * UNIT / max(chunks, 1)
    in_flight = resident * (c.stages - 1) * plan.sources * chunk_bytes  # a stage holds a chunk of each strip
    rate = min(gpu.hbm_bytes_per_s, in_flight / gpu.hbm_latency_s)
    partials = 2 * c.k_split * plan.M * plan.N * 4 if c.k_split > 1 else 0  # k_split's workspace, written and read
    streamed = (plan.bytes_read() + plan.M * plan.N * es + partials) * batch / rate
    terms = {"issue": decode * 1e6, "operand": streamed * 1e6, "ifetch": 0.0, "latency": 0.0}
    if plan.warp_strips:  # B's chunks copied from L2 once a block row (the fitted decode rates hold B read a strip)
        terms["l2"] = plan.grid[1] * plan.K * plan.N * es * batch / gpu.l2_bytes_per_s * 1e6
    return Estimate(gpu.launch_us + max(terms.values()), terms, 0.3)
