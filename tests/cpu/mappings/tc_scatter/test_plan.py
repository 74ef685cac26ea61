"""The tc-scatter layout (mappings/tc_scatter/plan.py): W's nonzeros as (position byte, value) entries in 16 x 16 tiles,
chunks of 4 tiles, rounds of 32 quads with their records; what the kernel reads back must be exactly W."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseforge import SparseMatrix
from sparseforge.mappings.tc_scatter.plan import (CHUNK_COLUMNS, QUAD, TILE, WARP, TcScatterConfig, _build, column_layout,
                                         decode_dense, execute_tc_scatter, make_tc_scatter_plan, position,
                                         scatter_format)


def _weight(m, k, density, seed=0):
    rng = np.random.default_rng(seed)
    dense = np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0).astype(np.float32)
    return SparseMatrix.from_dense(dense), dense


def test_every_column_of_a_chunk_has_one_place_and_b_windows_are_contiguous():
    """The k permutation: each of a chunk's 64 columns is one (tile, logical column); lane (g, tq) finds the
    B values of tiles 2w and 2w + 1 at columns 32 w + 8 tq .. + 7 in the order b0, b1 of tile 2w, then 2w + 1."""
    chunk, tile, logical = column_layout(np.arange(2 * CHUNK_COLUMNS))
    assert np.array_equal(chunk, np.repeat([0, 1], CHUNK_COLUMNS))
    assert len({(c, t, L) for c, t, L in zip(chunk, tile, logical)}) == 2 * CHUNK_COLUMNS
    for w in range(2):
        for tq in range(4):
            cols = 32 * w + 8 * tq + np.arange(8)
            _, t, L = column_layout(cols)
            assert list(t) == [2 * w] * 4 + [2 * w + 1] * 4
            assert list(L) == [2 * tq, 2 * tq + 1, 2 * tq + 8, 2 * tq + 9] * 2  # b0 = (L, L+1), b1 = (L+8, L+9)


def test_positions_are_a_bank_conflict_free_swizzle_of_the_tile():
    r, L = np.divmod(np.arange(256), TILE)
    pos = position(r, L)
    assert sorted(pos) == list(range(256))
    # ldmatrix reads 8 rows of 16 bytes of one 8-column half: they must fall in 8 different 4-bank groups
    for rows in (range(0, 8), range(8, 16)):
        for half in (0, 1):
            groups = {(position(row, 8 * half) * 2 // 16) % 8 for row in rows}
            assert len(groups) == 8


@st.composite
def weights(draw):
    m, k = draw(st.integers(1, 40)), draw(st.integers(1, 300))
    density = draw(st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0]))
    return _weight(m, k, density, draw(st.integers(0, 2 ** 16)))


@given(weights())
@settings(max_examples=40, deadline=None)
def test_the_format_read_back_is_exactly_w(problem):
    w, dense = problem
    fmt = _build(w)
    assert np.array_equal(decode_dense(fmt), dense.astype(np.float64))
    per_chunk = np.diff(fmt.chunks[:, 0].astype(np.int64))
    assert per_chunk.min() >= 1  # every chunk has a round: a warp's chunks come one after another
    hi = fmt.records[: fmt.rounds, 1].astype(np.int64)
    assert ((hi >> 14) & 1).sum() == fmt.strips * fmt.chunks_per_strip  # one last round a chunk
    assert ((hi & 63) <= WARP).all() and fmt.entries % QUAD == 0
    assert fmt.entries <= w.nnz + 3 * fmt.strips * fmt.chunks_per_strip * 4  # at most 3 repeats a tile
    assert not fmt.records[fmt.rounds:].any() and len(fmt.records) - fmt.rounds >= 8  # padding for read-ahead


def test_padding_repeats_a_real_entry_of_its_tile():
    w, dense = _weight(16, 16, 0.0)
    dense[3, 5] = 2.5
    fmt = _build(SparseMatrix.from_dense(dense))
    assert fmt.entries == QUAD and set(fmt.values[:QUAD]) == {2.5} and len(set(fmt.pos[:QUAD])) == 1


def test_plans_of_one_weight_share_one_format_and_name_their_config():
    w, _ = _weight(64, 512, 0.3)
    a = make_tc_scatter_plan(w, 8, "float16", "nk", TcScatterConfig(8, 2))
    b = make_tc_scatter_plan(w, 1, "bfloat16", "kn", TcScatterConfig(4, 4))
    assert a.format is b.format is scatter_format(w)
    assert a.name != b.name and "tcs_w8a2" in a.name and a.mapping == b.mapping == "tc-scatter"
    assert a.grid == (1, 4) and make_tc_scatter_plan(w, 40, "float16", "nk", TcScatterConfig(8, 2)).grid == (2, 4)
    assert a.bytes_read() < 64 * 512 * 2 * 0.6  # 3 bytes an entry at 30% density, against 2 a position dense


def test_the_reference_executor_computes_w_times_b_with_the_epilogue():
    w, dense = _weight(20, 70, 0.3)
    bias = np.linspace(-1, 1, 20)
    plan = make_tc_scatter_plan(w, 3, "float16", "nk", TcScatterConfig(2, 1), bias=bias, relu=True)
    x = np.random.default_rng(1).standard_normal((3, 70))
    want = np.maximum(x @ dense.T.astype(np.float64) + np.asarray(plan.bias)[None, :], 0)
    assert np.allclose(execute_tc_scatter(plan, x), want)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype="float32"), "tensor cores in float16 or bfloat16"),
    (dict(arch=75), "sm_80 or newer"),
    (dict(n=17, config=TcScatterConfig(16, 4)), "registers a thread"),
])
def test_refusals_name_the_reason(kwargs, message):
    w, _ = _weight(32, 64, 0.3)
    args = dict(n=1, dtype="float16", layout="nk", config=TcScatterConfig())
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        make_tc_scatter_plan(w, **args)


@pytest.mark.parametrize("fields, error", [(dict(warps_per_block=3), ValueError), (dict(ahead=3), ValueError),
                                           (dict(warps_per_block=8.0), TypeError)])
def test_configs_validate_themselves(fields, error):
    with pytest.raises(error):
        dataclasses.replace(TcScatterConfig(), **fields)
