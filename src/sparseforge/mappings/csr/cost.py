"""The cost model's estimates of the W-as-data kernels over padded CSR: the small-N kernel, csr-staged (B in
shared memory) and csr-columns (tune/cost.py holds the GPU table and the shared terms)."""
from __future__ import annotations

import math

import numpy as np

from ...tune.cost import H200, Estimate, Gpu, wave_count
from .plan import NNZ_PER_STEP


def csr_warp_work(plan) -> tuple[np.ndarray, int, int]:
    """The small-N kernel's work per warp (csr and csr-staged): loop iterations of each warp (its rows'
    most), warp instructions an iteration, and those of the butterfly and epilogue."""
    c, es = plan.config, plan.element_bytes
    counts = (plan.rows[:, 1] - plan.rows[:, 0]).astype(np.int64)
    steps = -(-counts // (c.lanes_per_row * NNZ_PER_STEP * c.unroll))  # loop iterations per row
    rows_per_warp = 32 // c.lanes_per_row
    padded = np.concatenate([steps, np.zeros((-len(steps)) % rows_per_warp, np.int64)])
    warp_steps = padded.reshape(-1, rows_per_warp).max(axis=1)
    loads = c.columns // plan.load_width
    unpack = 1 if plan.index_bytes == 2 else 0  # a 16-bit index is one AND or shift out of its word
    per_step = c.unroll * (12 + NNZ_PER_STEP * (4 + unpack + loads + c.columns * (2 if es == 2 else 1)))
    reduce = c.columns * 2 * int(math.log2(c.lanes_per_row)) + 2 * c.columns + 30
    return warp_steps, per_step, reduce


def prefetch_registers(plan) -> int:
    """The registers prefetch holds a step's next index and value words in: per step of 4 nonzeros, 4 for
    32-bit indices (2 for 16-bit) and 4 for fp32 values (2 for 16-bit)."""
    per_step = (NNZ_PER_STEP if plan.index_bytes == 4 else 2) + (NNZ_PER_STEP if plan.element_bytes == 4 else 2)
    return per_step * plan.config.unroll


def step_chain(steps: np.ndarray, cycles: float, prefetch: bool, gpu: Gpu) -> np.ndarray:
    """Cycles of a row's `steps` loop iterations as a chain: each a whole step, or with prefetch the first
    one whole and the others the part their issued-ahead loads leave (Gpu.prefetch_step_fraction)."""
    if not prefetch:
        return steps * cycles
    return np.where(steps > 0, cycles * (1 + gpu.prefetch_step_fraction * np.maximum(steps - 1, 0)), 0.0)


def csr_small_n_estimate(plan, batch: int, gpu: Gpu) -> Estimate:
    c, es = plan.config, plan.element_bytes
    tiles, row_blocks = plan.grid
    warp_steps, per_step, reduce = csr_warp_work(plan)
    warp_instr = (warp_steps.sum() * per_step + len(warp_steps) * reduce) * tiles * batch
    issue = warp_instr / (gpu.sms * 4 * gpu.clock_hz)
    data = plan.slots * (plan.index_bytes + es) * tiles * batch
    gathers = plan.nnz * tiles * batch * min(32, c.columns * es) if plan.layout == "kn" else \
        plan.nnz * tiles * batch * c.columns * 32
    written = plan.M * plan.N * es * batch
    traffic = (data + gathers + written) / gpu.l2_bytes_per_s
    blocks = tiles * row_blocks * batch
    registers = 40 + c.columns * (NNZ_PER_STEP * c.unroll + 1) + (prefetch_registers(plan) if c.prefetch else 0)
    waves = wave_count(blocks, c.warps_per_block, registers, gpu)
    chain = step_chain(warp_steps, gpu.step_cycles, c.prefetch, gpu) + reduce * gpu.cycles_per_instruction
    latency = ((waves - 1) * chain.mean() + chain.max()) / gpu.clock_hz
    terms = {"issue": issue * 1e6, "operand": traffic * 1e6, "ifetch": 0.0, "latency": latency * 1e6}
    return Estimate(gpu.launch_us + max(terms.values()), terms, 0.3)


def csr_staged_estimate(plan, batch: int, gpu: Gpu) -> Estimate:
    """csr-staged: each of the grid's persistent blocks copies B (from L2 after the first) into shared
    memory, then takes row blocks in turn; W's data streams from HBM once, as fast as the warps' index and
    value loads in flight allow (one step of each lane, shared memory limiting the blocks an SM holds)."""
    c, es = plan.config, plan.element_bytes
    ctas = plan.grid[1] * batch
    warp_steps, per_step, reduce = csr_warp_work(plan)
    staged = plan.dynamic_shared_bytes
    stage_instr = ctas * staged / 16 / 32 * 10  # a warp's 16-byte copy: address, predicate, load, store
    warp_instr = (warp_steps.sum() * per_step + len(warp_steps) * reduce) * batch + stage_instr
    issue = warp_instr / (gpu.sms * 4 * gpu.clock_hz)
    data = plan.slots * (plan.index_bytes + es) * batch
    blocks_per_sm = max(1, min((227 * 1024) // max(staged, 1), gpu.max_warps // c.warps_per_block))
    in_flight = min(ctas, gpu.sms * blocks_per_sm) * c.threads * NNZ_PER_STEP * c.unroll * (plan.index_bytes + es)
    rate = min(gpu.hbm_bytes_per_s, in_flight / gpu.hbm_latency_s)
    memory = (data + plan.M * plan.N * es * batch) / rate + ctas * staged / gpu.l2_bytes_per_s
    waves = max(1, math.ceil(ctas / (gpu.sms * blocks_per_sm)))
    row_blocks = -(-plan.M // c.rows_per_block)
    steps = step_chain(warp_steps, gpu.staged_step_cycles, c.prefetch, gpu)
    chain = (float(steps.mean()) if len(steps) else 0.0) + reduce * gpu.cycles_per_instruction
    stage_chain = -(-staged // (4 * c.threads * 16)) * gpu.hbm_latency_s / 2  # the copy's rounds, from L2
    latency = waves * (stage_chain + -(-row_blocks // max(plan.grid[1], 1)) * chain / gpu.clock_hz)
    terms = {"issue": issue * 1e6, "operand": memory * 1e6, "ifetch": 0.0, "latency": latency * 1e6}
    return Estimate(gpu.launch_us + max(terms.values()), terms, 0.3)


def csr_columns_estimate(plan, batch: int, gpu: Gpu) -> Estimate:
    """csr-columns: per warp, chunks of 32 of its row's slots (dealt round robin over warps_per_row); per
    chunk one (index, value) load, then 32 x (2 shuffles, an address, the B loads, the FMAs). Its chain is
    the small-N kernel's step (indices, then B: two dependent round trips) once per chunk."""
    c, es = plan.config, plan.element_bytes
    tiles, row_blocks = plan.grid
    counts = (plan.rows[:, 1] - plan.rows[:, 0]).astype(np.int64)
    chunks = -(-counts // 32)
    warp_chunks = -(-chunks // c.warps_per_row)  # the most any warp of the row runs
    loads = c.columns // plan.load_width
    per_chunk = 14 + 32 * (5 + 2 * loads + c.columns * (2 if es == 2 else 1))
    reduce = (c.warps_per_row > 1) * (c.columns * 2 * c.warps_per_row + 20) + 3 * c.columns + 25
    warp_instr = (chunks.sum() * per_chunk + len(counts) * c.warps_per_row * reduce) * tiles * batch
    issue = warp_instr / (gpu.sms * 4 * gpu.clock_hz)
    data = plan.slots * (plan.index_bytes + es) * tiles * batch
    segment = -(-min(c.tile_columns, plan.N) * es // 32) * 32
    if getattr(plan, "geometry", None) is not None and plan.geometry.layout == "nhwc":  # a convolution's plan
        # a warp's pixels are sw*Cin elements apart in x: each lane's element takes a 32-byte sector to itself
        # once that spacing reaches 32 bytes (a sector count, not yet measured against the H200)
        spacing = min(32, plan.geometry.stride[1] * plan.geometry.pixel_stride * es)
        segment = -(-min(c.tile_columns, plan.N) * spacing // 32) * 32
    gathers = plan.nnz * tiles * batch * segment
    written = plan.M * plan.N * es * batch
    traffic = (data + gathers + written) / gpu.l2_bytes_per_s
    blocks = tiles * row_blocks * batch
    registers = 128 if c.columns <= 2 else 170
    waves = wave_count(blocks, c.warps_per_row * c.rows_per_block, registers, gpu)
    chain = warp_chunks * gpu.step_cycles + reduce * gpu.cycles_per_instruction
    latency = ((waves - 1) * chain.mean() + chain.max()) / gpu.clock_hz
    terms = {"issue": issue * 1e6, "operand": traffic * 1e6, "ifetch": 0.0, "latency": latency * 1e6}
    return Estimate(gpu.launch_us + max(terms.values()), terms, 0.4)


def csr_estimate(plan, batch: int = 1, gpu: Gpu = H200) -> Estimate:
    """The small-N kernel's time, staged (B in shared memory) or not."""
    return (csr_staged_estimate if plan.staged else csr_small_n_estimate)(plan, batch, gpu)
