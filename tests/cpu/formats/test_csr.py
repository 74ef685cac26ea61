import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sparseforge import SparseFormatError, SparseMatrix


@st.composite
def sparse_dense(draw, dtype=np.float32):
    m = draw(st.integers(1, 12))
    k = draw(st.integers(1, 12))
    values = draw(hnp.arrays(dtype, (m, k), elements=st.floats(-100, 100, width=32)))
    keep = draw(hnp.arrays(bool, (m, k)))
    return np.where(keep, values, 0).astype(dtype)


@given(sparse_dense())
def test_dense_round_trip_is_exact(dense):
    w = SparseMatrix.from_dense(dense)
    assert np.array_equal(w.to_dense(), dense)
    assert w.nnz == np.count_nonzero(dense)


@given(sparse_dense())
def test_scipy_round_trip_is_exact(dense):
    w = SparseMatrix.from_scipy(sp.csr_matrix(dense))
    assert w == SparseMatrix.from_dense(dense)
    assert np.array_equal(w.to_scipy().toarray(), dense)


@given(sparse_dense())
@settings(max_examples=30)
def test_save_load_round_trip_is_exact(tmp_path_factory, dense):
    path = tmp_path_factory.mktemp("m") / "w.npz"
    w = SparseMatrix.from_dense(dense)
    w.save(path)
    assert SparseMatrix.load(path) == w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_from_torch_keeps_dtype_and_values(dtype):
    t = torch.randn(7, 9, dtype=torch.float64).to(dtype)
    t[t.abs() < 0.8] = 0
    w = SparseMatrix.from_dense(t)
    assert w.dtype == str(dtype).replace("torch.", "")
    assert torch.equal(w.to_torch(), t)


def test_negative_zero_counts_as_zero():
    w = SparseMatrix.from_dense(np.array([[-0.0, 1.0], [0.0, -0.0]], dtype=np.float32))
    assert w.nnz == 1 and w.indices.tolist() == [1]


def test_statistics():
    dense = np.array([[1, 0, 2, 0], [0, 0, 0, 0], [3, 0, 4, 5]], dtype=np.float32)
    s = SparseMatrix.from_dense(dense).stats()
    assert (s.rows, s.cols, s.nnz, s.empty_rows, s.row_nnz_max, s.distinct_cols) == (3, 4, 5, 1, 3, 3)
    assert s.density == pytest.approx(5 / 12)
    assert s.row_nnz_mean == pytest.approx(5 / 3)
    assert s.row_nnz_std == pytest.approx(np.std([2, 0, 3]))
    assert s.column_reuse == pytest.approx(5 / 3)


def test_immutable():
    w = SparseMatrix.from_dense(np.eye(3, dtype=np.float32))
    with pytest.raises(AttributeError):
        w.shape = (1, 1)
    with pytest.raises(ValueError):
        w.values[0] = 2.0


@pytest.mark.parametrize("indptr, indices, values, shape, message", [
    ([0, 1], [0], [1.0], (1, 2, 3), "2-D"),
    ([0, 1, 1], [0], [1.0], (1, 2), r"M\+1 = 2"),
    ([1, 1], [0], [1.0], (1, 2), "start at 0"),
    ([0, 2, 1], [0, 1], [1.0, 1.0], (2, 2), "not monotone"),
    ([0, 1], [0, 1], [1.0, 1.0], (1, 2), "nnz = 1 but there are 2 column"),
    ([0, 1], [5], [1.0], (1, 2), "out of range"),
    ([0, 2], [1, 0], [1.0, 1.0], (1, 2), "unsorted"),
    ([0, 2], [1, 1], [1.0, 1.0], (1, 2), "duplicate"),
    ([0, 1], [0], [np.nan], (1, 2), "not finite"),
    ([0, 1], [0], [np.inf], (1, 2), "not finite"),
    ([0, 1], [0], [1.0, 2.0], (1, 2), "values"),
])
def test_validation_errors_name_the_problem(indptr, indices, values, shape, message):
    with pytest.raises(SparseFormatError, match=message):
        SparseMatrix(indptr, indices, np.array(values, dtype=np.float32), shape)


def test_rows_are_checked_separately_for_order():
    # column 1 then column 0 across a row boundary is fine
    w = SparseMatrix([0, 1, 2], [1, 0], np.ones(2, np.float32), (2, 2))
    assert w.nnz == 2


@pytest.mark.parametrize("bad, message", [
    (np.ones((2, 2, 2), np.float32), "2-D"),
    (np.array([[1, 2]], dtype=np.int32), "floating-point"),
    (np.array([[1.0, np.nan]], dtype=np.float32), "not finite"),
    (torch.tensor([[1, 2]]), "floating-point"),
])
def test_from_dense_rejects_bad_input(bad, message):
    with pytest.raises(SparseFormatError, match=message):
        SparseMatrix.from_dense(bad)


def test_load_rejects_corrupt_file(tmp_path):
    path = tmp_path / "w.npz"
    SparseMatrix.from_dense(np.eye(4, dtype=np.float32)).save(path)
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(SparseFormatError, match="not a readable"):
        SparseMatrix.load(path)


def test_digest_changes_with_values_and_pattern():
    a = SparseMatrix.from_dense(np.array([[1.0, 0.0]], np.float32))
    b = SparseMatrix.from_dense(np.array([[2.0, 0.0]], np.float32))
    c = SparseMatrix.from_dense(np.array([[0.0, 1.0]], np.float32))
    assert len({a.digest(), b.digest(), c.digest()}) == 3
    assert a.digest() == SparseMatrix.from_dense(np.array([[1.0, 0.0]], np.float32)).digest()


def test_astype_bfloat16_rounds_values():
    w = SparseMatrix.from_dense(np.array([[1.0 + 2 ** -12]], np.float32)).astype("bfloat16")
    assert w.dtype == "bfloat16" and w.values[0] == 1.0
