import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sparseforge import SparseFormatError, SparseMatrix
from sparseforge.suite import SAMPLE_DIR


@given(hnp.arrays(bool, st.tuples(st.integers(1, 10), st.integers(1, 10))))
def test_smtx_pattern_round_trip(tmp_path_factory, keep):
    path = tmp_path_factory.mktemp("s") / "w.smtx"
    w = SparseMatrix.from_dense(keep.astype(np.float32))
    w.to_smtx(path)
    back = SparseMatrix.from_smtx(path)
    assert back.shape == w.shape
    assert np.array_equal(back.indptr, w.indptr) and np.array_equal(back.indices, w.indices)


def test_values_are_seeded():
    path = next(SAMPLE_DIR.rglob("*.smtx"))
    a, b = SparseMatrix.from_smtx(path, seed=3), SparseMatrix.from_smtx(path, seed=3)
    c = SparseMatrix.from_smtx(path, seed=4)
    assert a == b
    assert not np.array_equal(a.values, c.values)
    assert abs(a.values.std() - 1.0) < 0.1


def test_reads_dlmc_sample_file():
    path = SAMPLE_DIR / "rn50/magnitude_pruning/0.9/bottleneck_1_block_group1_1_1.smtx"
    w = SparseMatrix.from_smtx(path)
    assert (w.shape, w.nnz) == ((64, 256), 1638)


@pytest.mark.parametrize("text, message", [
    ("", "line 1: expected 'M, K, nnz'"),
    ("2, 2\n", r"line 1 \('M, K, nnz'\): expected 3 integers, found 2"),
    ("2, x, 1\n0 1 1\n0\n", "'x' is not an integer"),
    ("2, 2, 1\n", "line 2: expected 3 row offsets, the file ends after line 1"),
    ("2, 2, 1\n0 1\n0\n", r"line 2 \(row offsets\): expected 3 integers, found 2 \(file truncated\?\)"),
    ("2, 2, 2\n0 1 2\n0\n", r"line 3 \(column indices\): expected 2 integers, found 1"),
    ("2, 2, 1\n0 1 1\n", "line 3: expected 1 column indices"),
    ("2, 2, 1\n0 1 2\n0\n", "last row offset is 2 but line 1 says nnz = 1"),
    ("2, 2, 2\n0 2 1\n0 1\n", "last row offset is 1"),
    ("2, 2, 2\n0 2 2\n1 0\n", "unsorted"),
    ("2, 2, 2\n0 2 2\n1 1\n", "duplicate"),
    ("2, 2, 1\n0 1 1\n7\n", "out of range"),
    ("2, 2, 2\n0 2 1\n0 1\n", "last row offset"),
    ("2, 2, 1\n0 1 1\n0\nextra\n", "line 4: unexpected content"),
    ("0, 2, 0\n0\n\n", "M and K must be >= 1"),
])
def test_malformed_smtx_errors_name_line(tmp_path, text, message):
    path = tmp_path / "bad.smtx"
    path.write_text(text)
    with pytest.raises(SparseFormatError, match=message):
        SparseMatrix.from_smtx(path)


def test_non_monotone_offsets_in_file(tmp_path):
    path = tmp_path / "bad.smtx"
    path.write_text("3, 2, 2\n0 2 1 2\n0 1\n")
    with pytest.raises(SparseFormatError, match="not monotone"):
        SparseMatrix.from_smtx(path)


def test_binary_file_is_rejected(tmp_path):
    path = tmp_path / "bad.smtx"
    path.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(SparseFormatError, match="not a text file"):
        SparseMatrix.from_smtx(path)


def test_empty_matrix_file(tmp_path):
    path = tmp_path / "empty.smtx"
    path.write_text("3, 4, 0\n0 0 0 0\n\n")
    w = SparseMatrix.from_smtx(path)
    assert w.nnz == 0 and w.to_dense().shape == (3, 4) and not w.to_dense().any()
