"""The bitmap layout (mappings/bitmap/plan.py): bits where W is nonzero, values packed in column order per row, and
the per-step offsets the decode kernel starts each step's values from."""
import numpy as np
import pytest

from sparseforge import SparseMatrix
from sparseforge.mappings.bitmap.plan import (VALUE_ALIGN, WORD_COLUMNS, BitmapConfig, execute_bitmap, make_bitmap_plan,
                                     row_columns)


def _weight(m=7, k=300, density=0.2, seed=0):
    rng = np.random.default_rng(seed)
    dense = np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0).astype(np.float32)
    dense[1] = 0  # an empty row
    return SparseMatrix.from_dense(dense), dense


def test_bits_and_values_say_exactly_what_w_holds_in_the_kernels_order():
    """Bit b of lane l's word t is column 1024 t + 32 b + l; each (row, word) block holds its lanes' values
    lane after lane, each lane's from its highest bit down, padded to 8; rows start at their first block."""
    w, dense = _weight(k=2500, density=0.05)  # three words a lane, the last one partly past K
    plan = make_bitmap_plan(w, 1)
    assert plan.masks.shape == (7, 3, 32) and plan.masks.dtype == np.uint32
    for r in range(7):
        cols, word = row_columns(plan, r)
        assert np.array_equal(np.sort(cols), np.flatnonzero(dense[r]))
        assert plan.row_starts[r] % VALUE_ALIGN == 0
        start = plan.row_starts[r]
        for t in range(3):
            mine = cols[word == t]
            lanes, bits = mine % 32, (mine % WORD_COLUMNS) // 32
            assert np.all(np.diff(lanes) >= 0)  # lane after lane
            assert all(np.all(np.diff(bits[lanes == lane]) < 0) for lane in range(32))  # highest bit first
            assert np.array_equal(plan.values[start:start + mine.size], dense[r, mine])
            padded = -(-mine.size // VALUE_ALIGN) * VALUE_ALIGN
            assert not plan.values[start + mine.size:start + padded].any()
            start += padded
    past = np.arange(3 * WORD_COLUMNS).reshape(3, 32, 32).transpose(0, 2, 1) >= 2500  # [t, l, b]: column >= K
    bits = np.unpackbits(plan.masks.view(np.uint8), bitorder="little").reshape(7, 3, 32, 32)
    assert not bits[:, past].any()  # no bit past K


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_reference_executor_reads_the_layout_back(layout):
    w, dense = _weight(seed=1, k=1500)
    bias = np.arange(7.0)
    plan = make_bitmap_plan(w, 1, "float32", layout, bias=bias, relu=True)
    b = np.random.default_rng(2).standard_normal((1500, 1) if layout == "kn" else (1, 1500))
    want = np.maximum(dense.astype(np.float64) @ b.reshape(-1, 1) + bias[:, None], 0)
    assert np.allclose(execute_bitmap(plan, b), want if layout == "kn" else want.T)


def test_refusals_name_the_limit_and_the_way_out():
    w, _ = _weight()
    with pytest.raises(ValueError, match="N = 1 .*got N = 2.*another mapping"):
        make_bitmap_plan(w, 2)
    wide = SparseMatrix.from_dense(np.eye(2, 16385, dtype=np.float32))
    with pytest.raises(ValueError, match="K <= 16384"):
        make_bitmap_plan(wide, 1)
    big = SparseMatrix.from_dense(np.eye(2, 12000, dtype=np.float32))
    with pytest.raises(ValueError, match="shared memory.*fewer warps_per_block, a 16-bit dtype"):
        make_bitmap_plan(big, 1, "float32")
    for bad in ({"warps_per_block": 3}, {"warps_per_block": 16}, {"unroll": 3}, {"rows_per_warp": 3}):
        with pytest.raises(ValueError):
            BitmapConfig(**bad)


def test_name_depends_on_shape_and_options_not_pattern():
    a, _ = _weight(seed=3)
    b, _ = _weight(seed=4)
    assert make_bitmap_plan(a, 1).name == make_bitmap_plan(b, 1).name
    assert make_bitmap_plan(a, 1).name != make_bitmap_plan(a, 1, config=BitmapConfig(unroll=4)).name
    assert make_bitmap_plan(a, 1, bias=np.ones(7)).name.endswith("_bias")


def test_bytes_of_w_against_dense_fp16_follow_the_bitmap_bound():
    """1/8 byte a position + 2 bytes a nonzero (+ the blocks' padding): ~6x fewer than dense fp16 at 90%,
    ~1.8x at 50%."""
    for density, low, high in ((0.1, 5.0, 6.3), (0.5, 1.7, 1.8)):
        w, _ = _weight(m=64, k=4096, density=density, seed=5)
        plan = make_bitmap_plan(w, 1, "float16")
        ratio = 64 * 4096 * 2 / plan.bytes_read()
        assert low <= ratio <= high, (density, ratio)


def test_configs_refuse_fields_that_are_not_ints():
    """A float that equals an allowed value (2.0) would pass the membership checks and break the PTX."""
    from sparseforge.mappings.csr.plan import CsrColumnsConfig, CsrConfig

    for make in (lambda: BitmapConfig(4, 2.0), lambda: CsrConfig(8.0), lambda: CsrColumnsConfig(1, True)):
        with pytest.raises(TypeError, match="must be an int"):
            make()
