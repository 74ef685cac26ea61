"""The cost model's estimate of a bitmap decode plan (tune/cost.py holds the GPU table and the shared terms)."""
from __future__ import annotations

import numpy as np

from ...tune.cost import Estimate, Gpu, wave_count
from .plan import BitmapPlan


def bitmap_estimate(plan: BitmapPlan, batch: int, gpu: Gpu) -> Estimate:
    """Bitmap decode (N = 1): W's bytes streamed once from HBM per batch entry; per row and word a scan and a
    block copy (one global round trip), then the lanes' walks over shared memory, as long as the lane with
    the most set bits (/ unroll)."""
    c, es = plan.config, plan.element_bytes
    counts = np.bitwise_count(plan.masks).astype(np.int64)  # set bits per (row, word, lane)
    iterations = (-(-counts // c.unroll)).max(axis=2)        # the slowest lane of each word
    per_iteration = 4 + c.unroll * (8 + (4 if es == 2 else 0))
    per_word = 45
    rows_words = plan.M * plan.words
    warp_instr = (iterations.sum() * per_iteration + rows_words * per_word + plan.M * 25) * batch
    issue = warp_instr / (gpu.sms * 4 * gpu.clock_hz)
    streamed = (plan.bytes_read() + plan.M * es) * batch / gpu.hbm_bytes_per_s
    staged = plan.grid[1] * batch * plan.K * es / gpu.l2_bytes_per_s  # x into every block's shared memory
    chain = iterations.sum(axis=1) * gpu.bitmap_iteration_cycles + plan.words * gpu.step_cycles / 2
    per_block = chain.reshape(-1)[: plan.M]
    registers = 64 + 8 * c.unroll
    waves = wave_count(plan.grid[1] * batch, c.warps_per_block, registers, gpu)
    latency = ((waves - 1) * per_block.mean() * c.rows_per_warp + per_block.max() * c.rows_per_warp) / gpu.clock_hz
    terms = {"issue": issue * 1e6, "operand": max(streamed, staged) * 1e6, "ifetch": 0.0, "latency": latency * 1e6}
    return Estimate(gpu.launch_us + max(terms.values()), terms, 0.3)
