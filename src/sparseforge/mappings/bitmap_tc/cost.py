"""The cost model's estimate of a bitmap-tc plan (tune/cost.py holds the GPU table and the shared terms)."""
from __future__ import annotations

from ...formats.bitmap_tiles import CHUNK_TILES, UNIT
from ...tune.cost import Estimate, Gpu
from .plan import BitmapTcPlan

TILE_INSTRUCTIONS = 62   # a tile's decode: the word, popc, the 3-step scan, 8 slots, packing (render.py)
N_TILE_INSTRUCTIONS = 8  # per n-tile and tile: B's two loads with their guards, the mma
CHUNK_INSTRUCTIONS = 40  # a chunk's copy loop, waits and pointers


def bitmap_tc_estimate(plan: BitmapTcPlan, batch: int, gpu: Gpu) -> Estimate:
    """bitmap-tc: W's tiles streamed from HBM once per batch entry as fast as the chunks in flight allow
    (stages - 1 a warp, times the warps an SM holds by shared memory and registers); every tile's decode as
    issue (empty ones too: a lane walks its 8 slots whatever they hold); B re-read per strip from L2."""
    c, f, es = plan.config, plan.format, plan.element_bytes
    chunks = f.strips * f.chunks_per_strip
    tiles = chunks * CHUNK_TILES
    warp_instr = (tiles * (TILE_INSTRUCTIONS + N_TILE_INSTRUCTIONS * plan.n_tiles) + chunks * CHUNK_INSTRUCTIONS) * batch
    issue = warp_instr / (gpu.sms * 4 * gpu.clock_hz)
    blocks_per_sm = max(1, min(gpu.registers // (c.threads * plan.registers),
                               227 * 1024 // plan.dynamic_shared_bytes, gpu.max_warps // c.warps_per_block))
    warps = f.strips * c.warps_per_block
    resident = min(warps, gpu.sms * blocks_per_sm * c.warps_per_block)
    chunk_bytes = f.units * UNIT / max(chunks, 1)
    rate = min(gpu.hbm_bytes_per_s, resident * (c.stages - 1) * chunk_bytes / gpu.hbm_latency_s)
    streamed = (plan.bytes_read() + plan.M * plan.N * es) * batch / rate
    b_reads = f.strips * plan.K * plan.N * es * batch / gpu.l2_bytes_per_s
    terms = {"issue": issue * 1e6, "operand": max(streamed, b_reads) * 1e6, "ifetch": 0.0, "latency": 0.0}
    return Estimate(gpu.launch_us + max(terms.values()), terms, 0.3)
