"""The cost model's estimate of a generated (row-group) plan, an SpMM's or a convolution's over its bordered
input, and its predicted compile (tune/cost.py holds the GPU table and the shared terms)."""
from __future__ import annotations

import numpy as np

from ...tune.cost import Estimate, Gpu, wave_count


def groups_estimate(plan, batch: int, gpu: Gpu) -> Estimate:
    c, es = plan.config, plan.element_bytes
    vec = c.vec if plan.direct else 1
    wide = es == 2
    # per group: a load per distinct k (+ widening of 16-bit values), an FMA per nonzero and column of the
    # thread's vector, the epilogue, and the call into the group's function
    call = 0 if c.inline else 24  # the call into a group's function: parameters, call, return
    instr = np.array([g.width * (1 + (vec if wide else 0)) + g.nnz * vec + len(g.rows) * vec * (3 if wide else 1)
                      + call for g in plan.groups] or [0], dtype=np.float64)
    tiles, row_blocks = plan.grid
    warps_per_tile = c.warps_per_block if plan.direct else 1
    per_block = c.groups_per_block if plan.direct else c.warps_per_block
    warp_instr = instr.sum() * tiles * warps_per_tile * batch
    issue = warp_instr / (gpu.sms * 4 * gpu.clock_hz)
    row_bytes = plan.N * es
    if plan.bordered:  # a convolution's: a stride along rows spreads a warp's loads over that many times the bytes
        row_bytes *= plan.geometry.stride[1]
    fetched = plan.b_loads * row_bytes
    written = plan.M * plan.N * es * (1 + sum(g.partial for g in plan.groups) / max(len(plan.groups), 1))
    if plan.bordered and plan.output_strides[1] > 1:
        written *= _nhwc_store_spread(plan)
    traffic = (fetched + written) * batch / gpu.l2_bytes_per_s
    ifetch = instr.sum() * gpu.sass_bytes * tiles * batch * (1 if plan.direct else 1) / gpu.ifetch_bytes_per_s
    if per_block > 1:  # a block's chain: its groups one after another
        padded = np.concatenate([instr, np.zeros((-len(instr)) % per_block)])
        chains = padded.reshape(-1, per_block).sum(axis=1)
    else:
        chains = instr
    accumulators = max((len(g.rows) for g in plan.groups), default=1) * vec
    registers = 24 + accumulators + c.load_batch * vec
    if c.inline:  # ptxas hoists a row's loads: 72-254 registers read off ptxas -v on rn50 layers
        registers = 24 + accumulators + 4 * c.load_batch * vec
    blocks = tiles * row_blocks * batch
    waves = wave_count(blocks, c.warps_per_block, registers, gpu)
    latency = ((waves - 1) * chains.mean() + chains.max()) * gpu.cycles_per_instruction / gpu.clock_hz
    if c.inline:
        latency *= gpu.inline_latency
    terms = {"issue": issue * 1e6, "operand": traffic * 1e6, "ifetch": ifetch * 1e6, "latency": latency * 1e6}
    border = 0.0
    if plan.bordered:  # x read and its copy written inside the border, before the kernel
        g = plan.geometry
        copies = plan.shifts  # shifted copies: one more launch and the image's bytes once more each
        border = gpu.border_copy_us * (1 if copies == 1 else 2) \
            + 2 * copies * g.channels * g.height * g.width * es * batch / gpu.hbm_bytes_per_s * 1e6
        terms["border"] = border
    compile_s = tile_compile_seconds(plan.nnz, vec, c.inline, bordered=plan.bordered)
    return Estimate(gpu.launch_us + border + max(v for k, v in terms.items() if k != "border"), terms, compile_s)


def _nhwc_store_spread(plan) -> float:
    """Sector bytes an NHWC store touches per byte it writes: a warp's 32 pixels are Cout elements apart, so
    each lane's run of channels sits in a sector with min(32, Cout*es) bytes of its pixel (a sector count,
    not yet measured against the H200; the chooser's timing decides)."""
    runs = [count for g in plan.groups for _, count in plan.store_runs(g)]
    run_bytes = plan.element_bytes * sum(runs) / max(len(runs), 1)
    return max(1.0, min(32, plan.M * plan.element_bytes) / max(run_bytes, 1))


def tile_compile_seconds(nnz: int, vec: int, inline: bool, bordered: bool = False) -> float:
    """Predicted cold compile of a generated kernel with `nnz` nonzeros at vector width `vec` (one FMA a
    nonzero and column of the vector): known from the config and W's nonzero count alone, so a config can be
    dropped before its plan is made. bordered: a convolution's, whose every distinct (channel, tap) is a load
    at its own offset into the bordered image: about 95 bytes of PTX a nonzero against an SpMM's fewer."""
    if inline:  # one module compiled whole, superlinear (ptxas 13.0: 0.17 s at 1.6k FMAs, 4.1 s at 30k)
        return 0.05 + (nnz * vec) ** 1.1 / 2e4
    if bordered:  # measured with ptxas 13.0, its plan and render included, one core: 99 rn50 90% candidates,
        # 0.3 s at 6.5k nonzeros x vec, 1.3 s at 26k, 2.5 s at 52k, 5-6 s at 105k, 14 s at 236k
        return 0.08 + nnz * vec / 2.0e4
    return 0.3 + nnz * vec / 6e4  # measured: median 0.8 s per rn50 90% matrix (20-50k nonzeros) on 2-16 cores


def tile_config_compile_seconds(config, nnz: int) -> float:
    """A row-group config's predicted cold compile for W's nonzero count (before any plan is made)."""
    return tile_compile_seconds(nnz, config.vec, config.inline)
