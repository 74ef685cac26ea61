"""What a plan makes the kernel read: bytes of the dense operand fetched from L2 / HBM, by schedule.
A model to compare designs before timing them (docs/history.md), not a measurement."""
from __future__ import annotations

from .plan import Plan


def operand_bytes(plan: Plan) -> dict[str, int]:
    """Per batch entry. `one_pass`: each group reads each of its distinct k once per column tile (no reuse
    across groups: a group's whole-K slice does not stay in L1). `chunked`: with config.chunk_k, a run's
    groups share each chunk through L1, so a k used by any group of the run is fetched once per run.
    `minimum`: every row of B once. `atomics`: partial sums written by split groups."""
    row = plan.N * plan.element_bytes
    run = plan.config.groups_per_block if plan.direct else 1
    chunk = plan.config.chunk_k or plan.K
    fetched = 0
    for start in range(0, len(plan.groups), run):
        members = plan.groups[start:start + run]
        if plan.config.chunk_k:
            fetched += len({c.k for g in members for c in g.columns}) * row
        else:
            fetched += sum(len(g.columns) for g in members) * row
    pieces = [g for g in plan.groups if g.partial]
    return {"one_pass": plan.b_loads * row, "chunked": fetched if plan.config.chunk_k else plan.b_loads * row,
            "minimum": plan.K * row, "atomics": sum(len(g.rows) for g in pieces) * row,
            "chunks": -(-plan.K // chunk)}


def tile_traffic(plan: Plan) -> dict[str, int]:
    """The bytes a row-group plan makes its kernel move (B re-read per row group, split groups' atomics, C
    written once) and the floor (B and C moved once)."""
    output = plan.M * plan.N * plan.element_bytes
    traffic = operand_bytes(plan)
    return {"fetched_bytes": traffic["chunked"] + traffic["atomics"] + output,
            "floor_bytes": traffic["minimum"] + output}
