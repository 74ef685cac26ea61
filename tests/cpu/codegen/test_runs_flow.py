"""The chunked-runs lowering (kn, chunk_k) read back from its PTX: one function per run of
groups_per_block groups; inside it every group starts (bias or zero), then chunk by chunk (chunk-outer,
group-inner) each group reads only its chunk's columns and updates only its own accumulators, and finally
stores its own rows. Catches slot bookkeeping and ordering errors without a GPU."""
import re

import numpy as np
import pytest

from sparseforge import SparseMatrix
from sparseforge.codegen import render
from sparseforge.plan import TileConfig, make_plan


def _functions(text: str) -> dict[int, list[str]]:
    """Run index -> body lines of that run's function."""
    found, current = {}, None
    for line in (raw.strip() for raw in text.splitlines()):
        if m := re.match(r"\.visible \.func \w+_run(\d+)\(", line):
            current = found.setdefault(int(m.group(1)), [])
        elif current is not None:
            if line == "}":
                current = None
            else:
                current.append(line)
    return found


def _sections(body: list[str]) -> list[tuple[int, int, int, list[str]]]:
    """(group, k0, k1, lines) per '// group g: rows ...; k k0..k1' section."""
    out = []
    for line in body:
        if m := re.match(r"// group (\d+): rows .*; k (\d+)\.\.(\d+)$", line):
            out.append((int(m.group(1)), int(m.group(2)), int(m.group(3)) + 1, []))
        elif out and not line.startswith("//"):
            out[-1][3].append(line)
    return out


@pytest.mark.parametrize("config", [TileConfig(2, 1, 1, 4, 3, 0, 16), TileConfig(3, 2, 2, 8, 4, 9, 40),
                                    TileConfig(1, 1, 4, 8, 2, 0, 7)], ids=lambda c: c.short())
def test_every_run_goes_chunk_by_chunk_over_its_groups_in_their_own_registers(config):
    rng = np.random.default_rng(4)
    dense = np.where(rng.random((23, 100)) < 0.15, rng.standard_normal((23, 100)), 0).astype(np.float32)
    dense[5] = 0  # an empty row: its group still starts and stores
    plan = make_plan(SparseMatrix.from_dense(dense), 64, config=config)
    functions = _functions(render(plan).text)
    run, vec = config.groups_per_block, plan.config.vec
    width = max(len(g.rows) for g in plan.groups)
    assert sorted(functions) == list(range(plan.grid[1]))
    for r, body in functions.items():
        members = list(range(r * run, min(r * run + run, len(plan.groups))))
        sections = _sections(body)
        order = [(k0, members.index(g)) for g, k0, _, _ in sections]
        assert order == sorted(order), "not chunk-outer, group-inner"
        for g, k0, k1, lines in sections:
            group, slot = plan.groups[g], members.index(g) * width * vec
            own = {f"%a{slot + j}" for j in range(len(group.rows) * vec)}
            written = {m.group(1) for line in lines if (m := re.match(r"fma\.rn\.f32 (%a\d+),", line))}
            assert written <= own and written
            expected = sum(len(c.uses) for c in group.columns if k0 <= c.k < k1) * vec
            assert sum(line.startswith("fma.rn.f32") for line in lines) == expected
        for g in members:  # every k of every group visited exactly once, in one chunk
            seen = [k0 for h, k0, _, _ in sections if h == g]
            chunks = {c.k // config.chunk_k * config.chunk_k for c in plan.groups[g].columns}
            assert sorted(seen) == sorted(chunks)
        # every accumulator of every member reaches the output (fp32: st / red take %a directly)
        stored = {reg for line in body if re.match(r"@%pv (?:st|red)\.global", line)
                  for reg in re.findall(r"%a\d+", line)}
        assert stored == {f"%a{members.index(g) * width * vec + j}" for g in members
                          for j in range(len(plan.groups[g].rows) * vec)}
