"""The cost model's estimate of a tc-scatter plan (tune/cost.py holds the GPU table and the shared terms)."""
from __future__ import annotations

import math

import numpy as np

from ...tune.cost import Estimate, Gpu
from .plan import TILES_PER_CHUNK, TcScatterPlan


def tc_scatter_estimate(plan: TcScatterPlan, batch: int, gpu: Gpu) -> Estimate:
    """tc-scatter: W's format streamed from HBM once per column group, as fast as the bytes in flight allow
    (config.ahead rounds of entries a warp, by cp.async, times the warps an SM holds by registers and shared
    memory); per round ~45 instructions (the lane's tile, four stores, the next copy), per chunk the tiles'
    ldmatrix and mma, the zeroing and B's loads; the slowest warp's rounds as a chain."""
    f, c, es = plan.format, plan.config, plan.element_bytes
    work = plan.grid[0] * batch
    rounds_per_chunk = np.diff(f.chunks[:, 0].astype(np.int64))
    nt = plan.n_tiles
    warps = f.strips * c.warps_per_block * work
    chunks = f.strips * f.chunks_per_strip
    warp_instr = (f.rounds * 45 + chunks * (TILES_PER_CHUNK * (1 + nt) + 30 + 8 * nt)) * work \
        + warps * (120 + 4 * c.warps_per_block)
    issue = warp_instr / (gpu.sms * 4 * gpu.clock_hz)
    streamed = plan.bytes_read() * work + plan.M * plan.N * es * batch
    blocks_per_sm = max(1, min(gpu.registers // (c.threads * plan.registers), 227 * 1024 // plan.shared_bytes,
                               gpu.max_warps // c.warps_per_block))
    resident = min(warps, gpu.sms * blocks_per_sm * c.warps_per_block)
    per_round = (f.entries * (1 + es) + f.rounds * 8) / max(f.rounds, 1)
    rate = min(gpu.hbm_bytes_per_s, resident * c.ahead * per_round / gpu.hbm_latency_s)
    memory = streamed / rate
    b_reads = f.strips * plan.K * min(plan.N, plan.block_columns) * es * work / gpu.l2_bytes_per_s
    per_strip = rounds_per_chunk.reshape(f.strips, -1)
    per_warp = np.add.reduceat(per_strip, np.arange(0, per_strip.shape[1], plan.chunks_per_warp), axis=1)
    waves = max(1, math.ceil(warps / max(resident, 1)))
    latency = waves * (float(per_warp.max(initial=0)) * gpu.scatter_round_cycles / gpu.clock_hz + gpu.hbm_latency_s)
    terms = {"issue": issue * 1e6, "operand": max(memory, b_reads) * 1e6, "ifetch": 0.0, "latency": latency * 1e6}
    return Estimate(gpu.launch_us + max(terms.values()), terms, 0.3)
