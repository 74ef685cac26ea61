"""The cost model's estimate of a delta-runs decode plan (tune/cost.py holds the GPU table and the shared terms)."""
from __future__ import annotations

import numpy as np

from ...plan.config import WARP
from ...tune.cost import Estimate, Gpu
from .plan import DeltaRunsPlan

SLOT_INSTRUCTIONS = 6    # a lane's slot: two loads and the loop's share
ENTRY_INSTRUCTIONS = 5   # an entry: extract its gap, add, shared load, widen, FMA (N = 1; N more FMAs wider)
ROW_INSTRUCTIONS = 60    # a warp's row: its slots and base, the butterfly, the store
GROUP_LATENCY_S = 0.5e-6  # a group's loads as seen by the lane that waits for them (the next group in flight)


def delta_runs_estimate(plan: DeltaRunsPlan, batch: int, gpu: Gpu) -> Estimate:
    """Delta-runs decode: W's format streamed once from HBM per batch entry, X staged into every block from
    L2; the lanes' slots as issue; the longest run's groups as a chain."""
    c, es = plan.config, plan.element_bytes
    formats = (plan.format,) if plan.gate is None else (plan.format, plan.gate)  # a gated kernel walks both
    slots = sum(np.asarray(f.rows[:, 1].cpu() if hasattr(f.rows, "cpu") else f.rows[:, 1], dtype=np.int64)
                for f in formats)
    per_slot = SLOT_INSTRUCTIONS + plan.format.per_slot * (ENTRY_INSTRUCTIONS + plan.N - 1)
    streamed = (plan.bytes_read() + plan.M * es) * batch / gpu.hbm_bytes_per_s
    staged = plan.grid[1] * batch * plan.K * plan.N * es / gpu.l2_bytes_per_s
    warp_instr = (slots.sum() * per_slot / WARP + plan.M * ROW_INSTRUCTIONS
                  + plan.grid[1] * plan.K * 4 / c.threads) * batch
    issue = warp_instr / (gpu.sms * 4 * gpu.clock_hz)
    longest = int(slots.max(initial=0))
    groups = -(-longest // (WARP * c.ahead)) + 1
    rows_a_warp = -(-plan.M // (plan.grid[1] * c.warps_per_block))  # persistent blocks: a warp's rows in a chain
    chain = groups * GROUP_LATENCY_S * rows_a_warp
    terms = {"issue": issue * 1e6, "operand": max(streamed, staged) * 1e6, "ifetch": 0.0, "latency": chain * 1e6}
    return Estimate(gpu.launch_us + max(terms.values()), terms, 0.3)
