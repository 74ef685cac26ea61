"""BitmapTiles (formats/bitmap_tiles.py): W comes back exactly from the tiles (shapes not a multiple of a
tile or chunk, empty, one-nonzero, fully dense), the torch builder gives the numpy builder's bits, the bit
order is the mma A fragment's, both column orders are permutations of a chunk, and the bytes are the values,
bitmaps and starts plus at most 0.01 a weight."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseforge import SparseMatrix
from sparseforge.formats.bitmap_tiles import (CHUNK_COLUMNS, HEADER_BYTES, bitmap_tiles, bitmap_tiles_on_device,
                                              cell_of, chunk_column, decode_dense, slot_of, tile_column)
from sparseforge.formats.device import DeviceCsr


def _rounded(w: SparseMatrix, dtype: str) -> np.ndarray:
    return torch.from_numpy(w.to_dense().astype(np.float32)).to(getattr(torch, dtype)).double().numpy()


def _device_csr(w: SparseMatrix) -> DeviceCsr:
    return DeviceCsr(torch.from_numpy(w.indptr.astype(np.int64)), torch.from_numpy(w.indices.astype(np.int32)),
                     torch.from_numpy(np.array(w.values, dtype=np.float32)), w.shape, "float32")


@st.composite
def weights(draw):
    m, k = draw(st.integers(1, 40)), draw(st.sampled_from([1, 15, 16, 17, 127, 128, 129, 300]))
    kind = draw(st.sampled_from(["random", "empty", "one", "dense"]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    dense = rng.standard_normal((m, k)).astype(np.float32)
    if kind == "random":
        dense *= rng.random((m, k)) < draw(st.sampled_from([0.01, 0.3, 0.9]))
    elif kind == "empty":
        dense[:] = 0
    elif kind == "one":
        dense[:] = 0
        dense[rng.integers(m), rng.integers(k)] = 2.5
    return SparseMatrix.from_dense(dense)


@given(weights(), st.sampled_from(["float16", "bfloat16"]), st.booleans())
@settings(max_examples=40, deadline=None)
def test_w_comes_back_from_its_tiles_and_both_builders_agree(w, dtype, grouped):
    tiles = bitmap_tiles(w, dtype, grouped)
    assert tiles.grouped == grouped and np.array_equal(decode_dense(tiles), _rounded(w, dtype))
    on_device = bitmap_tiles_on_device(_device_csr(w), dtype, grouped)
    assert isinstance(on_device.data, torch.Tensor) and on_device.data.dtype == torch.int32
    assert np.array_equal(on_device.on_host().data, tiles.data) and np.array_equal(on_device.offsets, tiles.offsets)
    assert tiles.offsets[0] == 0 and np.all(np.diff(tiles.offsets.astype(np.int64)) >= HEADER_BYTES // 16)


@pytest.mark.parametrize("grouped", [False, True])
def test_the_column_orders_are_permutations_of_a_chunk(grouped):
    cols = np.arange(CHUNK_COLUMNS)
    tile, kk = tile_column(cols, grouped)
    assert len(set(zip(tile.tolist(), kk.tolist()))) == CHUNK_COLUMNS and tile.max() == 7 and kk.max() == 15
    assert np.array_equal(chunk_column(tile, kk, grouped), cols)
    if grouped:  # a lane's B of a tile group: 8 consecutive columns from 8 tq, and 8 from 32 + 8 tq
        lane_tq = (kk >> 1) & 3
        assert np.array_equal(cols[(lane_tq == 1) & (tile < 4)], np.r_[8:16, 40:48])


def test_a_lanes_byte_holds_its_a_fragment_positions():
    # lane l = 4 g + t, register r, half h: row g + 8 (r & 1), column 2 t + h + 8 (r >> 1) (PTX ISA m16n8k16)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for r in range(4):
            for h in range(2):
                row, col = g + 8 * (r & 1), 2 * t + h + 8 * (r >> 1)
                assert slot_of(row, col) == 8 * lane + 2 * r + h
                assert cell_of(8 * lane + 2 * r + h) == (row, col)


@pytest.mark.parametrize("sparsity", [0.5, 0.7, 0.9])
def test_bytes_per_weight_are_values_bitmaps_and_starts_plus_under_a_hundredth(sparsity):
    rng = np.random.default_rng(1)
    dense = (rng.standard_normal((256, 4096)) * (rng.random((256, 4096)) >= sparsity)).astype(np.float32)
    tiles = bitmap_tiles(SparseMatrix.from_dense(dense))
    bound = 2 * (1 - sparsity) + 1 / 8 + 1 / 16
    assert bound < tiles.bytes_per_weight() <= bound + 0.01
    assert tiles.max_chunk_units * 16 <= HEADER_BYTES + 2 * 16 * CHUNK_COLUMNS


def test_other_dtypes_are_refused():
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        bitmap_tiles(SparseMatrix.from_dense(np.eye(4, dtype=np.float32)), "float32")
