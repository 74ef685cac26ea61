"""The cost model (tune/cost.py) and the design space (tune/space.py): deterministic, sketches count what
full plans count, and every mapping is proposed where it applies."""
import dataclasses

import numpy as np
import pytest

from sparseforge import SparseMatrix
from sparseforge.plan import TileConfig, make_plan, sketch_plan
from sparseforge.mappings.csr.plan import CsrColumnsConfig, CsrConfig, make_csr_plan
from sparseforge.tune.cost import estimate
from sparseforge.mappings.csr.space import SMALL_N_MAX
from sparseforge.tune.space import search_space


def _weight(m=64, k=256, density=0.1, seed=0):
    rng = np.random.default_rng(seed)
    return SparseMatrix.from_dense(np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0)
                                   .astype(np.float32))


@pytest.mark.parametrize("config", [TileConfig(4, 4, 2), TileConfig(1, 4, 1), TileConfig(4, 2, 1, 16, 1, 0,
                                    cluster_rows=True), TileConfig(2, 4, 1, 8, 2)])
def test_sketch_counts_equal_the_full_plan(config):
    w = _weight()
    full, sketch = make_plan(w, 96, config=config), sketch_plan(w, 96, config=config)
    assert sketch.sketch and not full.sketch
    assert [(g.rows, g.nnz, g.width) for g in sketch.groups] == [(g.rows, g.nnz, g.width) for g in full.groups]
    assert estimate(sketch).us == pytest.approx(estimate(full).us)


@pytest.mark.parametrize("density,segment", [(0.5, 30), (0.1, 7)])
def test_split_sketch_partitions_nonzeros_and_columns_like_the_full_plan(density, segment):
    w = _weight(m=64, k=512, density=density)
    config = TileConfig(4, 4, 1, 8, 1, segment)
    full, sketch = make_plan(w, 64, config=config), sketch_plan(w, 64, config=config)
    assert sketch.mapping == full.mapping == "split-k"
    assert sketch.nnz == full.nnz == w.nnz and sketch.b_loads == full.b_loads
    pieces = [(g.rows, g.nnz, g.width, g.segment, g.segments) for g in sketch.groups]
    assert pieces == [(g.rows, g.nnz, g.width, g.segment, g.segments) for g in full.groups]
    assert (sketch.grid, sketch.partial_rows) == (full.grid, full.partial_rows)  # what a launch from the sketch reads


def test_pieces_never_outnumber_distinct_columns():
    dense = np.zeros((8, 16), np.float32)
    dense[:, :2] = 1.0  # 8 rows sharing 2 columns: 16 nonzeros, 2 distinct k a group
    sketch = sketch_plan(SparseMatrix.from_dense(dense), 32, config=TileConfig(8, 1, 1, 8, 1, 3))
    assert all(g.segments <= 2 for g in sketch.groups)


@pytest.mark.parametrize("seed", range(40))
def test_a_heavy_column_leaves_the_sketch_as_few_pieces_as_the_plan(seed):
    """One column used by most of a group's rows crosses two cut points at once (split_group then makes fewer
    pieces than nnz / segment_nnz, or none): the sketch cuts there too, so a kernel launched from it covers
    the same blocks and zeroes the same rows."""
    rng = np.random.default_rng(seed)
    m, k = int(rng.integers(2, 24)), int(rng.integers(3, 120))
    dense = np.where(rng.random((m, k)) < rng.uniform(0.02, 0.4), rng.standard_normal((m, k)), 0)
    dense[:, rng.integers(0, k)] = 1.0
    w = SparseMatrix.from_dense(dense.astype(np.float32))
    config = TileConfig(int(rng.choice([2, 4, 8])), 2, 1, 8, 1, int(rng.integers(1, 10)))
    full, sketch = make_plan(w, 16, config=config), sketch_plan(w, 16, config=config)
    pieces = [(g.rows, g.nnz, g.width, g.segment, g.segments) for g in sketch.groups]
    assert pieces == [(g.rows, g.nnz, g.width, g.segment, g.segments) for g in full.groups]
    assert (sketch.grid, sketch.partial_rows) == (full.grid, full.partial_rows)


def test_plans_over_the_launch_grid_are_refused():
    from sparseforge.mappings.csr.plan import make_csr_plan as csr

    tall = SparseMatrix.from_dense(np.eye(70_000, 4, dtype=np.float32))
    for make in (make_plan, sketch_plan):
        with pytest.raises(ValueError, match="65535"):
            make(tall, 1, config=TileConfig(1, 1, 1, 16))
    assert make_plan(tall, 1, config=TileConfig(4, 1, 1, 16)).grid[1] < 65535
    with pytest.raises(ValueError, match="row blocks"):
        csr(tall, 1, config=CsrConfig(32, 1, 1))


def test_estimates_are_deterministic_and_grow_with_work():
    w, heavy = _weight(density=0.05), _weight(density=0.4)
    for make, cfg in ((make_plan, TileConfig()), (make_csr_plan, CsrConfig())):
        a, b = estimate(make(w, 64, config=cfg)), estimate(make(w, 64, config=cfg))
        assert a == b and a.us > 0 and set(a.terms) == {"issue", "operand", "ifetch", "latency"}
        assert estimate(make(heavy, 64, config=cfg)).us > a.us
        assert estimate(make(w, 64, config=cfg), batch=8).us >= a.us  # one wave either way: the same chain
    big = _weight(m=2048, k=1024, density=0.1)
    for make, cfg in ((make_plan, TileConfig()), (make_csr_plan, CsrConfig())):
        assert estimate(make(big, 64, config=cfg), batch=8).us > estimate(make(big, 64, config=cfg)).us


def test_small_n_kernel_is_predicted_faster_at_n1_on_a_large_layer():
    """The instruction stream is the weight at N = 1: the data-driven kernel must rank first there."""
    w = _weight(m=1000, k=2048, density=0.1)
    generated = estimate(sketch_plan(w, 1, config=TileConfig(4, 1, 1, 16)))
    small = estimate(make_csr_plan(w, 1, config=CsrConfig(32, 1)))
    assert small.us < generated.us


@pytest.mark.parametrize("n", [1, 8, 49, 256, 3136])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_space_proposes_every_mapping_that_applies(n, layout):
    space = search_space(n, layout, m=512, row_nnz=100.0)
    assert len(space) == len(set(space))
    tiles = [c for c in space if isinstance(c, TileConfig)]
    assert any(c.rows_per_group == 1 for c in tiles)  # row per block
    assert any(c.rows_per_group > 1 for c in tiles)   # row groups
    assert any(isinstance(c, CsrConfig) for c in space) == (n <= SMALL_N_MAX)
    if layout == "nk":
        assert any(c.transpose_x for c in tiles) and any(not c.transpose_x for c in tiles)


def test_deterministic_space_has_no_atomics_and_relu_no_splits():
    assert any(getattr(c, "segment_nnz", 0) for c in search_space(49, "kn", 512, 100.0))
    assert not any(getattr(c, "segment_nnz", 0) for c in search_space(49, "kn", 512, 100.0, deterministic=True))
    assert not any(getattr(c, "segment_nnz", 0) for c in search_space(49, "kn", 512, 100.0, relu=True))


def test_row_per_block_includes_the_reference_shape():
    """One row, 128 columns a block at vector width 1 (4 warps): the shape the reference kernel has."""
    space = search_space(3136, "kn", 256, 60.0)
    assert TileConfig(1, 4, 1, 16, 1) in space
    assert dataclasses.replace(TileConfig(1, 4, 1, 16, 1), transpose_x=True) in search_space(256, "nk", 256, 60.0)


def test_inline_candidates_only_for_small_layers():
    small = [c for c in search_space(3136, "kn", 64, 25.0) if getattr(c, "inline", False)]
    assert small and all(c.transpose_x is False for c in small)
    assert TileConfig(1, 4, 1, 16, 1, inline=True) in small  # the reference kernel's shape, inline
    assert not any(getattr(c, "inline", False) for c in search_space(49, "kn", 2048, 100.0))
    nk = [c for c in search_space(256, "nk", 64, 25.0) if getattr(c, "inline", False)]
    assert nk and all(c.transpose_x for c in nk)


def test_csr_columns_candidates_for_kn_from_n_8_with_warps_per_row_following_row_length():
    def columns_configs(n, layout="kn", row_nnz=100.0):
        return [c for c in search_space(n, layout, 512, row_nnz) if isinstance(c, CsrColumnsConfig)]

    assert not columns_configs(4) and not columns_configs(256, "nk")
    assert {c.columns for c in columns_configs(49)} == {1, 2}  # 64 columns cover N = 49: no 128
    assert {c.columns for c in columns_configs(3136)} == {1, 2, 4}
    short, long = columns_configs(256, row_nnz=20.0), columns_configs(256, row_nnz=400.0)
    assert min(c.warps_per_row for c in short) == 1 and min(c.warps_per_row for c in long) == 8
    assert all(c.threads <= 512 for c in short + long)


def test_csr_columns_estimate_is_deterministic_and_splitting_long_rows_shortens_the_chain():
    w = _weight(m=64, k=4096, density=0.1)  # ~410 nonzeros a row: 13 chunks of 32
    one = make_csr_plan(w, 49, config=CsrColumnsConfig(1, 1, 4))
    eight = make_csr_plan(w, 49, config=CsrColumnsConfig(1, 8, 1))
    assert estimate(one).us == estimate(make_csr_plan(w, 49, config=CsrColumnsConfig(1, 1, 4))).us
    assert estimate(eight).terms["latency"] < estimate(one).terms["latency"] / 3
    assert one.mapping == eight.mapping == "csr-columns"


def test_inline_plans_rank_as_their_own_mapping_and_compile_superlinearly():
    w = _weight()
    called = sketch_plan(w, 256, config=TileConfig(1, 4, 1, 16))
    inlined = sketch_plan(w, 256, config=TileConfig(1, 4, 1, 16, inline=True))
    assert (called.mapping, inlined.mapping) == ("row-per-block", "inline")
    assert estimate(inlined).terms["latency"] < estimate(called).terms["latency"]
    big = _weight(m=512, k=1024, density=0.1)
    ratio = estimate(sketch_plan(big, 256, config=TileConfig(1, 4, 1, 16, inline=True))).compile_s / \
        estimate(inlined).compile_s
    assert ratio > big.nnz / w.nnz  # superlinear in the kernel's size


def test_bias_that_overflows_fp32_is_refused():
    from sparseforge.plan.plan import fp32_bias

    assert fp32_bias([1.0, -2.5], 2) == (1.0, -2.5)
    with pytest.raises(ValueError, match=r"bias\[0\] = 1e\+39 overflows float32"):
        fp32_bias([1e39, 1.0], 2)
    with pytest.raises(ValueError, match=r"bias\[1\] = nan is not finite"):
        fp32_bias([1.0, float("nan")], 2)


def test_bitmap_candidates_only_when_asked_and_only_at_n_1():
    from sparseforge.mappings.bitmap.plan import BitmapConfig

    def bitmaps(n, layout="kn", unmeasured=True):
        return [c for c in search_space(n, layout, 512, 100.0, unmeasured=unmeasured) if isinstance(c, BitmapConfig)]

    assert not bitmaps(1, unmeasured=False)  # not yet measured on a GPU: designs.py proposes it
    assert bitmaps(1) and bitmaps(1, "nk")
    assert not bitmaps(2) and not bitmaps(16) and not bitmaps(2, "nk")  # a matrix-vector kernel


def test_bitmap_estimate_streams_fewer_bytes_than_dense_and_is_deterministic():
    from sparseforge.mappings.bitmap.plan import make_bitmap_plan
    from sparseforge.tune.cost import H200, dense_estimate

    w = _weight(m=512, k=4096, density=0.1)
    plan = make_bitmap_plan(w, 1, "float16")
    e = estimate(plan)
    assert e.us == estimate(make_bitmap_plan(w, 1, "float16")).us
    dense_bytes_us = 512 * 4096 * 2 / H200.hbm_bytes_per_s * 1e6
    assert e.terms["operand"] < dense_bytes_us / 4  # ~6x fewer bytes of W at 90%
    assert dense_estimate(512, 4096, 1, "float16") > H200.launch_us


def test_tc_scatter_is_proposed_for_half_precision_from_n_17_to_64_and_bitmap_tc_below():
    from sparseforge.mappings.bitmap_tc.plan import BitmapTcConfig
    from sparseforge.mappings.tc_scatter.plan import TcScatterConfig

    def proposed(n, dtype, kind=TcScatterConfig, unmeasured=False, layout="nk"):
        return [c for c in search_space(n, layout, 4096, 1200.0, dtype=dtype, unmeasured=unmeasured)
                if isinstance(c, kind)]

    assert proposed(17, "float16", layout="kn") and proposed(64, "bfloat16")
    assert not proposed(65, "float16") and not proposed(1, "float32") and not proposed(16, "float32")
    # X as K x N: measured behind bitmap-tc below 17 columns, so timed side by side only; X as N x K: not yet
    assert not proposed(16, "float16", layout="kn") and proposed(16, "float16", unmeasured=True, layout="kn")
    assert proposed(8, "float16")
    assert proposed(2, "bfloat16", BitmapTcConfig) and proposed(16, "float16", BitmapTcConfig)
    assert not proposed(1, "float16", BitmapTcConfig) and not proposed(17, "float16", BitmapTcConfig)
    assert not proposed(8, "float32", BitmapTcConfig) and proposed(1, "float16", BitmapTcConfig, unmeasured=True)


def test_tc_scatter_estimates_fall_with_sparsity_and_stay_finite():
    from sparseforge.mappings.tc_scatter.plan import TcScatterConfig, make_tc_scatter_plan
    from sparseforge.suite.llm import magnitude_prune, seeded_weight

    dense = seeded_weight(1024, 4096, seed=0)
    times = []
    for sparsity in (0.5, 0.9):
        plan = make_tc_scatter_plan(magnitude_prune(dense, sparsity), 8, "float16", "nk", TcScatterConfig(8, 2))
        e = estimate(plan)
        assert np.isfinite(e.us) and e.us > 0 and set(e.terms) == {"issue", "operand", "ifetch", "latency"}
        times.append(e.us)
    assert times[1] < times[0]


def test_sm_count_comes_from_the_arch_alone_so_prebuild_and_compile_agree(monkeypatch):
    """csr-staged's block count is in its kernel's name: it must not depend on which GPU (if any) is visible."""
    import torch

    from sparseforge.tune.space import SMS_BY_ARCH, sm_count

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # were it asked, a GPU would be claimed
    assert sm_count(90) == 132 and sm_count(80) == 108 and sm_count(89) == SMS_BY_ARCH[89]
    assert sm_count(75) == 132  # an arch not in the table: the default, not an error
    staged = {c.ctas for c in search_space(8, "kn", 4096, 400.0, dtype="float16", sms=sm_count(80))
              if getattr(c, "stage_b", False)}
    assert staged == {108, 216}


def test_prefetch_shortens_the_predicted_chain_of_rows_longer_than_a_step():
    """Gpu.prefetch_step_fraction: a row's first step whole, the later ones shortened; empty warps cost nothing."""
    from sparseforge.mappings.csr.cost import step_chain
    from sparseforge.tune.cost import H200

    steps = np.array([0, 1, 4])
    plain, ahead = step_chain(steps, 1000.0, False, H200), step_chain(steps, 1000.0, True, H200)
    assert list(plain) == [0, 1000, 4000] and ahead[0] == 0 and ahead[1] == 1000 and 1000 < ahead[2] < 4000
    w = _weight(m=256, k=4096, density=0.3)  # ~1200 nonzeros a row: several steps a warp
    long_rows = [estimate(make_csr_plan(w, 8, "float16", "kn", CsrConfig(32, 8, 16, 1, stage_b=True, ctas=4,
                                                                         prefetch=p)), 1).terms["latency"]
                 for p in (False, True)]
    assert long_rows[1] < long_rows[0]
