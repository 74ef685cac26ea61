"""The bitmap layout (plan/bitmap.py): bits where W is nonzero, values packed in column order per row, and
the per-step offsets the decode kernel starts each step's values from."""
import numpy as np
import pytest

from sparseforge import SparseMatrix
from sparseforge.plan.bitmap import (STEP_COLUMNS, VALUE_ALIGN, BitmapConfig, execute_bitmap,
                                     make_bitmap_plan)


def _weight(m=7, k=300, density=0.2, seed=0):
    rng = np.random.default_rng(seed)
    dense = np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0).astype(np.float32)
    dense[1] = 0  # an empty row
    return SparseMatrix.from_dense(dense), dense


def _bits(plan, r):
    return np.unpackbits(plan.masks[r].view(np.uint8), bitorder="little")[:plan.K].astype(bool)


def test_bits_values_and_offsets_say_exactly_what_w_holds():
    w, dense = _weight(k=4500, density=0.05)  # three steps of 2048 columns
    plan = make_bitmap_plan(w, 4)
    assert plan.masks.shape == (7, -(-4500 // 64)) and plan.offsets.shape == (7, 3)
    for r in range(7):
        cols = np.flatnonzero(dense[r])
        assert np.array_equal(np.flatnonzero(_bits(plan, r)), cols)
        start = plan.offsets[r, 0]
        assert start % VALUE_ALIGN == 0
        assert np.array_equal(plan.values[start:start + cols.size], dense[r, cols])
        for s in range(3):  # step s starts after the row's nonzeros in earlier steps
            assert plan.offsets[r, s] == start + np.count_nonzero(cols < s * STEP_COLUMNS)
    assert all(int(word) >> (4500 % 64) == 0 for word in plan.masks[:, -1])  # no bit past K


@pytest.mark.parametrize("layout,n", [("kn", 5), ("nk", 1)])
def test_reference_executor_reads_the_layout_back(layout, n):
    w, dense = _weight(seed=1)
    bias = np.arange(7.0)
    plan = make_bitmap_plan(w, n, "float32", layout, bias=bias, relu=True)
    b = np.random.default_rng(2).standard_normal((300, n) if layout == "kn" else (n, 300))
    want = np.maximum(dense.astype(np.float64) @ (b if layout == "kn" else b.T) + bias[:, None], 0)
    assert np.allclose(execute_bitmap(plan, b), want if layout == "kn" else want.T)


def test_refusals_name_the_limit_and_the_way_out():
    w, _ = _weight()
    with pytest.raises(ValueError, match="N <= 16"):
        make_bitmap_plan(w, 17)
    with pytest.raises(ValueError, match="layout 'nk'.*N = 1 only"):
        make_bitmap_plan(w, 2, layout="nk")
    wide = SparseMatrix.from_dense(np.eye(2, 70000, dtype=np.float32))
    with pytest.raises(ValueError, match="K <= 65536"):
        make_bitmap_plan(wide, 1)
    for bad in ({"warps_per_block": 3}, {"warps_per_block": 16}, {"unroll": 3}):
        with pytest.raises(ValueError):
            BitmapConfig(**bad)


def test_name_depends_on_shape_and_options_not_pattern():
    a, _ = _weight(seed=3)
    b, _ = _weight(seed=4)
    assert make_bitmap_plan(a, 2).name == make_bitmap_plan(b, 2).name
    assert make_bitmap_plan(a, 2).name != make_bitmap_plan(a, 2, config=BitmapConfig(4, 4)).name
    assert make_bitmap_plan(a, 2, bias=np.ones(7)).name.endswith("_bias")


def test_bytes_of_w_against_dense_fp16_follow_the_bitmap_bound():
    """1/8 byte a position + 2 bytes a nonzero: ~6x fewer than dense fp16 at 90%, ~1.8x at 50%."""
    for density, low, high in ((0.1, 5.0, 6.3), (0.5, 1.6, 1.8)):
        w, _ = _weight(m=64, k=4096, density=density, seed=5)
        plan = make_bitmap_plan(w, 1, "float16")
        ratio = 64 * 4096 * 2 / plan.bytes_read()
        assert low <= ratio <= high, (density, ratio)


def test_configs_refuse_fields_that_are_not_ints():
    """A float that equals an allowed value (2.0) would pass the membership checks and break the PTX."""
    from sparseforge.plan.csr import CsrColumnsConfig, CsrConfig

    for make in (lambda: BitmapConfig(4, 2.0), lambda: CsrConfig(8.0), lambda: CsrColumnsConfig(1, True)):
        with pytest.raises(TypeError, match="must be an int"):
            make()
