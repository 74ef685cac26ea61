"""The small-N plan (mappings/csr/plan.py): padded-CSR arrays that the kernel reads at 16-byte steps."""
import numpy as np
import pytest

from sparseforge import SparseMatrix
from sparseforge.mappings.csr.plan import NNZ_PER_STEP, CsrConfig, execute_csr, make_csr_plan


def _weight(seed=0, m=9, k=30, density=0.3):
    rng = np.random.default_rng(seed)
    dense = np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0).astype(np.float32)
    dense[2] = 0
    return SparseMatrix.from_dense(dense), dense


def test_rows_start_aligned_and_hold_exactly_their_nonzeros():
    w, dense = _weight()
    plan = make_csr_plan(w, 5)
    starts, ends = plan.rows[:, 0], plan.rows[:, 1]
    assert (starts % NNZ_PER_STEP == 0).all() and (ends - starts == w.row_nnz).all()
    assert (starts[1:] >= ends[:-1]).all()  # no overlap
    for r in range(w.shape[0]):
        cols, vals = plan.cols[starts[r]:ends[r]], plan.values[starts[r]:ends[r]]
        assert np.array_equal(cols, np.nonzero(dense[r])[0]) and np.array_equal(vals, dense[r, cols])


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_reference_executor_matches_dense(layout):
    w, dense = _weight(1)
    bias = np.arange(9.0)
    plan = make_csr_plan(w, 7, "float32", layout, bias=bias, relu=True)
    b = np.random.default_rng(2).standard_normal((30, 7) if layout == "kn" else (7, 30))
    want = np.maximum(dense.astype(np.float64) @ (b if layout == "kn" else b.T) + bias[:, None], 0)
    assert np.allclose(execute_csr(plan, b), want if layout == "kn" else want.T)


def test_name_depends_on_shape_not_pattern_and_config_validates():
    a, _ = _weight(0)
    b, _ = _weight(5)
    assert make_csr_plan(a, 4).name == make_csr_plan(b, 4).name
    assert make_csr_plan(a, 4).name != make_csr_plan(a, 5).name
    assert make_csr_plan(a, 4, bias=np.ones(9)).name.endswith("_bias")
    for bad in ({"lanes_per_row": 3}, {"columns": 0}, {"warps_per_block": 3}):
        with pytest.raises(ValueError):
            CsrConfig(**bad)


def test_load_width_never_straddles_n():
    w, _ = _weight()
    assert make_csr_plan(w, 8, "float32", "kn", CsrConfig(32, 8)).load_width == 4
    assert make_csr_plan(w, 6, "float32", "kn", CsrConfig(32, 8)).load_width == 2
    assert make_csr_plan(w, 16, "float16", "kn", CsrConfig(32, 8)).load_width == 8
    assert make_csr_plan(w, 16, "float16", "nk", CsrConfig(32, 8)).load_width == 1


# -- csr-columns (CsrColumnsConfig): the same arrays, a warp per row with lanes across N ---------------------
def test_csr_columns_config_validates_and_names_its_plan():
    from sparseforge.mappings.csr.plan import CsrColumnsConfig

    for bad in ({"columns": 3}, {"warps_per_row": 16}, {"rows_per_block": 0}, {"warps_per_row": 8, "rows_per_block": 2},
                {"warps_per_row": 4, "rows_per_block": 4}):
        with pytest.raises(ValueError):
            CsrColumnsConfig(**bad)
    w, _ = _weight()
    plan = make_csr_plan(w, 100, config=CsrColumnsConfig(2, 4, 2))
    assert plan.mapping == "csr-columns" and plan.family == "csr" and plan.threads == 256
    assert plan.grid == (2, 5)  # 64 columns a tile over N = 100; 2 rows a block over M = 9
    assert plan.name != make_csr_plan(w, 100, config=CsrColumnsConfig(2, 2, 2)).name
    assert make_csr_plan(w, 100).mapping == "csr"


def test_rows_of_b_past_4_gib_are_refused():
    w, _ = _weight()
    with pytest.raises(ValueError, match="over the 4 GiB"):
        make_csr_plan(w, 2 ** 30, "float32")


def test_csr_columns_refuses_nk_naming_the_fix():
    from sparseforge.mappings.csr.plan import CsrColumnsConfig

    w, _ = _weight()
    with pytest.raises(ValueError, match="layout 'nk'.*CsrConfig or a TileConfig"):
        make_csr_plan(w, 16, "float32", "nk", CsrColumnsConfig())


def test_csr_columns_vector_only_where_n_allows():
    """A lane's columns are one vector when N is a multiple of them (no vector straddles N or a B row's
    alignment), else single elements 32 apart."""
    from sparseforge.mappings.csr.plan import CsrColumnsConfig

    w, _ = _weight()
    assert make_csr_plan(w, 64, "float32", "kn", CsrColumnsConfig(4)).load_width == 4
    assert make_csr_plan(w, 49, "float32", "kn", CsrColumnsConfig(2)).load_width == 1
    assert make_csr_plan(w, 64, "float16", "kn", CsrColumnsConfig(8)).load_width == 8


def test_small_n_plans_store_16_bit_indices_where_k_allows_and_others_32():
    """Decode is bound by W's bytes: a 16-bit index saves a third of an fp16 nonzero's. csr-columns and the
    convolution (taps packed in the top bits) keep 32-bit indices."""
    from sparseforge.mappings.csr.plan import CsrColumnsConfig, CsrConfig, csr_bytes

    w = SparseMatrix.from_dense(np.eye(8, dtype=np.float32))
    short = make_csr_plan(w, 4, "float16", "kn", CsrConfig(lanes_per_row=4, columns=4))
    wide = make_csr_plan(w, 4, "float16", "kn", CsrColumnsConfig())
    assert short.cols.dtype == np.uint16 and short.index_bytes == 2
    assert wide.cols.dtype == np.int32 and wide.index_bytes == 4
    assert short.weight_arrays()[1][1] == "uint16" and wide.weight_arrays()[1][1] == "int32"
    tiles = short.grid[0]
    assert csr_bytes(short)["fetched"] - short.nnz * tiles * 8 == short.cols.size * (2 + 2) * tiles
