"""The kernels over padded CSR (mappings/csr/render.py): they assemble for sm_90 and sm_80 without spills at every
config the design space proposes, and csr-columns' source has the shape its docstring claims."""
import re

import numpy as np
import pytest

from sparseforge import SparseMatrix
from sparseforge.codegen import render
from sparseforge.mappings.csr.plan import CsrColumnsConfig, CsrConfig, make_csr_plan
from sparseforge.mappings.csr.space import csr_columns, csr_staged, prefetched, small_n

from .test_ptx import _assemble_without_spills_and_link


def _weight(m=64, k=1024, density=0.1, seed=0):
    rng = np.random.default_rng(seed)
    return SparseMatrix.from_dense(np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0)
                                   .astype(np.float32))


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n", [49, 256])
def test_every_proposed_csr_columns_config_assembles_without_spills(arch, dtype, n):
    w = _weight()
    configs = csr_columns(n, 400.0) + csr_columns(n, 20.0)
    if dtype != "float32" and n % 8 == 0:
        configs.append(CsrColumnsConfig(8, 2, 2))  # one 16-byte vector a lane
    built = 0
    for config in dict.fromkeys(configs):
        try:
            plan = make_csr_plan(w, n, dtype, "kn", config, bias=np.ones(64), relu=True, arch=arch)
        except ValueError as exc:  # refused up front (the space drops it): only what would spill
            assert arch < 90 and config.columns >= 4 and "spills on sm_80" in str(exc)
            continue
        _assemble_without_spills_and_link(render(plan), arch)
        built += 1
    assert built >= 4


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_proposed_small_n_config_assembles_without_spills(arch, dtype):
    w = _weight()
    for n, layout in ((1, "kn"), (8, "kn"), (33, "nk")):
        for config in small_n(n, 100.0) + prefetched(small_n(n, 100.0)):
            plan = make_csr_plan(w, n, dtype, layout, config, bias=np.ones(64), arch=arch)
            _assemble_without_spills_and_link(render(plan), arch)


def test_csr_columns_source_broadcasts_by_shuffle_and_sums_warps_in_shared_memory_only_when_split():
    w = _weight()
    one = render(make_csr_plan(w, 64, "float32", "kn", CsrColumnsConfig(2, 1, 4))).text
    four = render(make_csr_plan(w, 64, "float32", "kn", CsrColumnsConfig(2, 4, 2))).text
    for text in (one, four):
        assert text.count("shfl.sync.idx.b32") == 64  # index and value of each of a chunk's 32 nonzeros
        assert not re.search(r"^\s*(@%\w+ )?(atom|red)\.", text, re.M)  # deterministic: no atomics
        assert "ld.global.nc.v2.b32" in text  # N = 64 at 2 columns a lane: one vector load a nonzero
    assert ".shared" not in one and "bar.sync" not in one
    assert re.search(r"\.shared \.align 16 \.b8 partials\[\d+\];", four) and four.count("bar.sync") == 1


def test_csr_columns_refuses_eight_single_loads_a_lane():
    with pytest.raises(ValueError, match="one 16-byte load"):
        make_csr_plan(_weight(), 49, "float16", "kn", CsrColumnsConfig(8))
    with pytest.raises(ValueError, match="columns <= 4"):
        make_csr_plan(_weight(), 64, "float32", "kn", CsrColumnsConfig(8))


def test_csr_columns_name_depends_on_shape_and_config_not_pattern():
    a, b = _weight(seed=1), _weight(seed=2)
    config = CsrColumnsConfig(1, 2, 2)
    assert make_csr_plan(a, 49, config=config).name == make_csr_plan(b, 49, config=config).name
    assert make_csr_plan(a, 49, config=config).name != make_csr_plan(a, 49, config=CsrConfig()).name


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_every_proposed_staged_config_assembles_without_spills(arch, layout):
    """csr-staged at decode widths over a Llama-sized K (B's copy: up to 128 KB of dynamic shared memory)."""
    w = _weight(m=64, k=4096, density=0.05)
    for n in (1, 8, 16):
        for dtype in ("float32", "bfloat16"):
            for config in csr_staged(n, 200.0) + prefetched(csr_staged(n, 200.0)):
                try:
                    plan = make_csr_plan(w, n, dtype, layout, config, bias=np.ones(64), relu=True, arch=arch)
                except ValueError as exc:  # fp32 at N = 16: 256 KB, over what a block may have; sm_80's spills
                    assert ("shared memory" in str(exc) and 4096 * n * 4 > 160 * 1024) or \
                        ("spills on sm_80" in str(exc) and arch == 80 and dtype == "float32")
                    continue
                source = render(plan)
                assert ".extern .shared .align 16 .b8 staged[];" in source.text and "ld.shared" in source.text
                _assemble_without_spills_and_link(source, arch)


def test_staged_configs_refuse_what_they_cannot_hold():
    w = _weight(m=8, k=64)
    with pytest.raises(ValueError, match="one column tile"):
        make_csr_plan(w, 9, "float16", "kn", CsrConfig(8, 8, 2, stage_b=True, ctas=4))
    with pytest.raises(ValueError, match="shared memory"):  # 16384 x 16 fp32: 1 MB
        make_csr_plan(_weight(m=4, k=16384, density=0.01), 16, "float32", "kn", CsrConfig(8, 16, 2, stage_b=True, ctas=4))
    with pytest.raises(ValueError, match="ctas"):
        CsrConfig(8, 8, 2, stage_b=True)
    with pytest.raises(ValueError, match="ctas applies"):
        CsrConfig(8, 8, 2, ctas=4)
    with pytest.raises(TypeError, match="stage_b must be a bool"):
        CsrConfig(8, 8, 2, stage_b=1, ctas=4)
    with pytest.raises(TypeError, match="prefetch must be a bool"):
        CsrConfig(8, 8, 2, prefetch=1)
    plan = make_csr_plan(w, 5, "float16", "nk", CsrConfig(32, 8, 2, stage_b=True, ctas=100))
    assert plan.mapping == "csr-staged" and plan.grid == (1, 4)  # never more blocks than row blocks (2 rows each)
    assert plan.dynamic_shared_bytes == 640 and plan.load_width == 1  # N = 5: no vector divides it
    assert plan.config.short().endswith("s100") and "staged in shared memory" in plan.describe()
    assert make_csr_plan(w, 5, "float16", "nk", CsrConfig(8, 8, 2)).dynamic_shared_bytes == 0


def test_staged_and_prefetching_candidates_are_proposed_at_decode_widths_only():
    """Measured on the H200: csr-staged and prefetch are in the default space for
    N <= 16 (csr-staged) and N <= 64 (prefetch), blocks a multiple of the SM count given."""
    from sparseforge.tune.space import search_space

    space = search_space(16, "kn", 4096, 400.0, dtype="float16", sms=100)
    staged = [c for c in space if getattr(c, "stage_b", False)]
    assert staged and {c.ctas for c in staged} == {100, 200} and all(c.columns == 16 for c in staged)
    assert {c.prefetch for c in staged} == {False, True}
    assert any(isinstance(c, CsrConfig) and c.prefetch and not c.stage_b for c in space)
    wide = search_space(17, "kn", 4096, 400.0)
    assert not any(getattr(c, "stage_b", False) for c in wide) and any(getattr(c, "prefetch", False) for c in wide)
    assert not any(getattr(c, "prefetch", False) for c in search_space(65, "kn", 4096, 400.0))
