import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseforge import SparseMatrix
from sparseforge.plan import TileConfig, check_plan, coverage, execute, make_plan


@st.composite
def problems(draw):
    m, k, n = draw(st.integers(1, 24)), draw(st.integers(1, 40)), draw(st.integers(1, 70))
    density = draw(st.sampled_from([0.0, 0.05, 0.1, 0.5, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    dense = np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0).astype(np.float32)
    config = TileConfig(draw(st.integers(1, 9)), draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4])),
                        draw(st.integers(1, 20)), draw(st.integers(1, 4)))
    return SparseMatrix.from_dense(dense), n, config, draw(st.sampled_from(["kn", "nk"])), rng


@given(problems())
@settings(max_examples=150, deadline=None)
def test_plan_covers_every_nonzero_once_and_matches_dense(problem):
    w, n, config, layout, rng = problem
    plan = make_plan(w, n, "float32", layout, config)
    check_plan(plan, w)
    assert all(len(g.rows) <= config.rows_per_group for g in plan.groups)
    _assert_executes_like_dense(plan, w, rng)


def _assert_executes_like_dense(plan, w, rng) -> None:
    n, kn = plan.N, plan.layout == "kn"
    b = rng.standard_normal((w.shape[1], n) if kn else (n, w.shape[1]))
    ref = w.to_dense().astype(np.float64) @ (b if kn else b.T)
    got = execute(plan, b)
    np.testing.assert_allclose(got if kn else got.T, ref, rtol=1e-6, atol=1e-9)


def test_groups_are_balanced_by_nonzeros():
    counts = np.array([50, 1, 1, 1, 1, 1, 1, 1, 50, 50])
    rows = [r for r, c in enumerate(counts) for _ in range(c)]
    dense = np.zeros((10, 64), np.float32)
    for r, c in enumerate(counts):
        dense[r, :c] = 1.0
    plan = make_plan(SparseMatrix.from_dense(dense), 8, config=TileConfig(rows_per_group=8))
    sizes = [g.nnz for g in plan.groups]
    assert max(sizes) <= 57  # the heavy rows sit alone or with light ones, never two heavy rows together
    assert sum(sizes) == len(rows)


def test_bias_and_relu_in_reference():
    w = SparseMatrix.from_dense(np.array([[1.0, -2.0], [0.0, 0.0]], np.float32))
    plan = make_plan(w, 3, bias=[0.5, -1.0], relu=True)
    b = np.array([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
    np.testing.assert_allclose(execute(plan, b), np.maximum([[-0.5, 0.5, 1.5], [-1.0, -1.0, -1.0]], 0))


def test_column_sharing_counts_loads_once():
    dense = np.zeros((4, 8), np.float32)
    dense[:, 3] = 1.0
    plan = make_plan(SparseMatrix.from_dense(dense), 4, config=TileConfig(rows_per_group=4))
    assert plan.b_loads == 1 and plan.nnz == 4 and len(plan.groups) == 1


def test_vec_divides_n_and_describe():
    w = SparseMatrix.from_dense(np.eye(8, dtype=np.float32))
    assert make_plan(w, 6, config=TileConfig(vec=4)).config.vec == 2
    assert make_plan(w, 7, config=TileConfig(vec=4)).config.vec == 1
    assert make_plan(w, 64, layout="nk", config=TileConfig(vec=4)).config.vec == 1
    text = make_plan(w, 64).describe()
    assert "W 8x8, nnz 8" in text and "row groups" in text


def test_coverage_detects_a_missing_nonzero():
    w = SparseMatrix.from_dense(np.eye(3, dtype=np.float32))
    plan = make_plan(w, 2)
    counts = coverage(plan)
    assert counts.sum() == 3 and counts.trace() == 3


@pytest.mark.parametrize("kwargs, message", [
    ({"layout": "mk"}, "layout"), ({"dtype": "int8"}, "dtype"), ({"n": 0}, "N must be"),
    ({"bias": [1.0]}, "bias must have"), ({"bias": [np.nan, 1.0]}, "NaN"),
])
def test_bad_plan_arguments(kwargs, message):
    w = SparseMatrix.from_dense(np.eye(2, dtype=np.float32))
    args = {"n": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        make_plan(w, **args)


@pytest.mark.parametrize("kwargs", [{"rows_per_group": 0}, {"warps_per_block": 3}, {"vec": 3}, {"load_batch": 0},
                                    {"groups_per_block": 0}, {"cluster_rows": "yes"}, {"transpose_x": 1}])
def test_bad_tile_config(kwargs):
    with pytest.raises(ValueError):
        TileConfig(**kwargs)


@given(problems(), st.integers(1, 12))
@settings(max_examples=120, deadline=None)
def test_split_groups_cover_every_nonzero_once_and_match_dense(problem, segment_nnz):
    w, n, config, layout, rng = problem
    config = TileConfig(config.rows_per_group, config.warps_per_block, config.vec, config.load_batch,
                        config.groups_per_block, segment_nnz)
    bias = rng.standard_normal(w.shape[0]).astype(np.float32).astype(np.float64)  # the plan keeps fp32 bias
    plan = make_plan(w, n, "float32", layout, config, bias=bias)
    check_plan(plan, w)
    for g in plan.groups:  # a piece ends at the first column boundary past its share of the nonzeros
        assert not g.partial or g.nnz <= segment_nnz + max(len(c.uses) for c in g.columns) - 1
    b = rng.standard_normal((w.shape[1], n) if layout == "kn" else (n, w.shape[1]))
    ref = w.to_dense().astype(np.float64) @ (b if layout == "kn" else b.T) + bias[:, None]
    got = execute(plan, b)
    np.testing.assert_allclose(got if layout == "kn" else got.T, ref, rtol=1e-6, atol=1e-9)


def test_long_row_is_split_into_balanced_pieces():
    dense = np.zeros((8, 400), np.float32)
    dense[3, ::2] = 1.0          # one row with 200 nonzeros, the others with 2
    dense[[0, 1, 2, 4, 5, 6, 7], 0] = 1.0
    dense[[0, 1, 2, 4, 5, 6, 7], 1] = 1.0
    w = SparseMatrix.from_dense(dense)
    plan = make_plan(w, 64, config=TileConfig(rows_per_group=4, segment_nnz=50))
    pieces = [g for g in plan.groups if g.partial]
    assert [g.rows for g in pieces] == [(3,)] * 4 and [g.segment for g in pieces] == [0, 1, 2, 3]
    assert [g.nnz for g in pieces] == [50, 50, 50, 50]
    assert plan.partial_rows == (3,)
    assert "1 rows split" in plan.describe() and "s50" in plan.name
    check_plan(plan, w)


def test_check_plan_catches_a_missing_piece():
    dense = np.ones((1, 40), np.float32)
    w = SparseMatrix.from_dense(dense)
    plan = make_plan(w, 8, config=TileConfig(segment_nnz=10))
    broken = dataclasses.replace(plan, groups=plan.groups[:-1])
    with pytest.raises(AssertionError, match="rows written other than once"):
        check_plan(broken, w)


def test_split_refuses_relu_and_bf16_before_sm90():
    w = SparseMatrix.from_dense(np.ones((2, 40), np.float32))
    with pytest.raises(ValueError, match="cannot be rectified"):
        make_plan(w, 8, config=TileConfig(segment_nnz=10), relu=True)
    with pytest.raises(ValueError, match="sm_90"):
        make_plan(w, 8, "bfloat16", config=TileConfig(segment_nnz=10), arch=80)
    make_plan(w, 8, "bfloat16", config=TileConfig(segment_nnz=10), arch=90)
    with pytest.raises(ValueError, match="segment_nnz"):
        TileConfig(segment_nnz=-1)


@given(problems(), st.booleans())
@settings(max_examples=120, deadline=None)
def test_clustered_rows_cover_every_nonzero_once_and_match_dense(problem, split):
    w, n, config, layout, rng = problem
    config = dataclasses.replace(config, cluster_rows=True, segment_nnz=5 if split else 0)
    plan = make_plan(w, n, "float32", layout, config)
    check_plan(plan, w)
    assert sorted(r for g in plan.groups if g.segment == 0 for r in g.rows) == list(range(w.shape[0]))
    assert all(len(g.rows) <= config.rows_per_group for g in plan.groups)
    _assert_executes_like_dense(plan, w, rng)


def test_clustering_groups_rows_that_share_columns():
    # even rows use columns 0-9, odd rows 10-19: consecutive pairs load 20 columns, clustered pairs 10
    dense = np.zeros((8, 20), np.float32)
    dense[0::2, :10] = 1.0
    dense[1::2, 10:] = 1.0
    w = SparseMatrix.from_dense(dense)
    consecutive = make_plan(w, 8, config=TileConfig(rows_per_group=2))
    clustered = make_plan(w, 8, config=TileConfig(rows_per_group=2, cluster_rows=True))
    assert sum(len(g.columns) for g in consecutive.groups) == 4 * 20
    assert sum(len(g.columns) for g in clustered.groups) == 4 * 10
    assert all(len({r % 2 for r in g.rows}) == 1 for g in clustered.groups)
    assert clustered.config.short().endswith("c")


def test_recorded_clusters_seed_the_memo_and_bad_records_are_ignored(monkeypatch):
    """A cached choice carries its winner's row clustering (clusters_of): a later process seeds the memo
    with it (remember_clusters) and plans without clustering again; a record that does not partition W's
    rows is ignored."""
    from sparseforge.plan import plan as plan_module
    from sparseforge.plan import sketch_plan

    rng = np.random.default_rng(7)
    w = SparseMatrix.from_dense(np.where(rng.random((40, 120)) < 0.2, rng.standard_normal((40, 120)), 0)
                                .astype(np.float32))
    config = TileConfig(4, 2, 1, 8, cluster_rows=True)
    first = sketch_plan(w, 32, config=config)
    records = plan_module.clusters_of(w)
    assert records and json.loads(json.dumps(records)) == records
    plan_module._CLUSTERS.clear()

    def no_clustering(*args):
        raise AssertionError("clustered again")

    monkeypatch.setattr(plan_module, "_cluster", no_clustering)
    plan_module.remember_clusters(w, [[4, 1, [[0, 1]]], "junk", [4, "x", []]] + records)
    again = sketch_plan(w, 32, config=config)
    assert [g.rows for g in again.groups] == [g.rows for g in first.groups]
