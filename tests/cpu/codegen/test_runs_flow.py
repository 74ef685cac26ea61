"""The chunked-runs entry (kn, chunk_k) walked by a small interpreter of its control flow: for every block,
each group of its run is called chunk by chunk in order, its accumulators handed from one call to the
next in the same registers, and no other group's. Catches slot bookkeeping errors without a GPU."""
import re

import numpy as np
import pytest

from sparseforge import SparseMatrix
from sparseforge.codegen import render
from sparseforge.plan import TileConfig, make_plan


def _entry_body(text: str) -> list[str]:
    lines = [line.strip() for line in text.splitlines()]
    start = lines.index("mov.u32 %rgbase, %rgid;")
    return lines[start:]


def _walk(body: list[str], gid: int, gend: int) -> list[tuple[str, list[str], list[str]]]:
    """Run the entry from the run's start for one block: returns its calls as (function, regs passed in,
    regs received)."""
    labels = {line[:-1]: i for i, line in enumerate(body) if re.fullmatch(r"[A-Z0-9_]+:", line)}
    tables = {m.group(1): m.group(2).split(", ") for line in body
              if (m := re.match(r"(TABLE_C\d+): \.branchtargets (.*);", line))}
    regs, pt, calls, i, steps = {"%rgid": gid, "%rgend": gend}, False, [], 0, 0
    while i < len(body):
        steps += 1
        assert steps < 100_000, "the entry does not terminate"
        line = body[i]
        if line == "{":
            end = body.index("}", i)
            block = body[i:end]
            call = next(line for line in block if line.startswith("call.uni"))
            name = re.search(r"(\w+_g\d+_c\d+)", call).group(1)
            sent = [m.group(1) for line in block if (m := re.match(r"st\.param\.b32 \[acc_in\+\d+\], (%a\d+);", line))]
            got = [m.group(1) for line in block if (m := re.match(r"ld\.param\.b32 (%a\d+), \[acc_out\+\d+\];", line))]
            calls.append((name, sent, got))
            i = end + 1
        elif m := re.fullmatch(r"mov\.u32 (%\w+), (%\w+);", line):
            regs[m.group(1)] = regs[m.group(2)]
            i += 1
        elif line == "setp.ge.u32 %pt, %rgid, %rgend;":
            pt = regs["%rgid"] >= regs["%rgend"]
            i += 1
        elif m := re.fullmatch(r"@%pt bra (\w+);", line):
            i = labels[m.group(1)] if pt else i + 1
        elif m := re.fullmatch(r"bra\.uni (\w+);", line):
            i = labels[m.group(1)]
        elif m := re.fullmatch(r"brx\.idx %rgid, (\w+);", line):
            i = labels[tables[m.group(1)][regs["%rgid"]]]
        elif line == "add.u32 %rgid, %rgid, 1;":
            regs["%rgid"] += 1
            i += 1
        elif line == "ret;":
            break
        else:
            i += 1
    return calls


@pytest.mark.parametrize("config", [TileConfig(2, 1, 1, 4, 3, 0, 16), TileConfig(3, 2, 2, 8, 4, 9, 40),
                                    TileConfig(1, 1, 4, 8, 2, 0, 7)], ids=lambda c: c.short())
def test_every_group_of_every_run_goes_chunk_by_chunk_in_its_own_registers(config):
    rng = np.random.default_rng(4)
    dense = np.where(rng.random((23, 100)) < 0.15, rng.standard_normal((23, 100)), 0).astype(np.float32)
    dense[5] = 0  # an empty row: its group still starts and stores
    plan = make_plan(SparseMatrix.from_dense(dense), 64, config=config)
    body = _entry_body(render(plan).modules[0])
    chunks = [(k0, min(k0 + config.chunk_k, plan.K)) for k0 in range(0, plan.K, config.chunk_k)]
    run = config.groups_per_block
    for block in range(plan.grid[1]):
        first, last = block * run, min(block * run + run, len(plan.groups))
        calls = _walk(body, first, last)
        by_group: dict[int, list] = {}
        for name, sent, got in calls:
            g, c = (int(v) for v in re.search(r"_g(\d+)_c(\d+)$", name).groups())
            by_group.setdefault(g, []).append((c, sent, got))
        assert sorted(by_group) == list(range(first, last))
        for g, seq in by_group.items():
            group = plan.groups[g]
            used = [c for c, (k0, k1) in enumerate(chunks) if any(k0 <= col.k < k1 for col in group.columns)]
            assert [c for c, _, _ in seq] == sorted({0, len(chunks) - 1, *used})
            for (_, _, got), (_, sent, _) in zip(seq, seq[1:]):
                assert got == sent, f"group {g}: accumulators change registers between chunks"
            own = {r for _, sent, got in seq for r in sent + got}
            slot = (g % run) * max(len(x.rows) for x in plan.groups) * plan.config.vec
            width = len(group.rows) * plan.config.vec
            assert own == {f"%a{slot + j}" for j in range(width)}
