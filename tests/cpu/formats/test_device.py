"""DeviceCsr: W in CSR as torch tensors, checked on their device with SparseMatrix's rules and words, and
the same matrix as a SparseMatrix back on the host."""
import numpy as np
import pytest
import torch

from sparseforge.formats import SparseFormatError, SparseMatrix
from sparseforge.formats.device import DeviceCsr


def _csr(dense: torch.Tensor) -> DeviceCsr:
    rows, cols = torch.nonzero(dense, as_tuple=True)
    indptr = torch.zeros(dense.shape[0] + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.bincount(rows, minlength=dense.shape[0]), 0)
    return DeviceCsr(indptr, cols.int(), dense[rows, cols], tuple(dense.shape), str(dense.dtype)[6:])


def _dense(m=6, k=40, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * (torch.rand(m, k, generator=g) < 0.3)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_to_the_host_matrix(dtype):
    dense = _dense(dtype=dtype)
    dense[2] = 0  # an empty row
    w = _csr(dense)
    host = w.to_host()
    assert host == SparseMatrix.from_dense(dense)
    assert (w.nnz, w.shape, w.dtype) == (host.nnz, host.shape, host.dtype)
    assert torch.equal(w.row_nnz(), torch.from_numpy(host.row_nnz))


def test_astype_rounds_on_the_device_and_keeps_the_pattern():
    w = _csr(_dense(dtype=torch.float32))
    half = w.astype(torch.float16)
    assert half.dtype == "float16" and half.values.dtype == torch.float16
    assert half.indices is w.indices and torch.equal(half.values, w.values.half())
    assert w.astype("float32") is w


def _parts(dense):
    w = _csr(dense)
    return w.indptr.clone(), w.indices.clone(), w.values.clone(), w.shape, w.dtype


@pytest.mark.parametrize("edit, words", [
    (lambda p: (p[0], p[1], p[2], p[3], p[4]), None),
    (lambda p: (p[0][:-1], p[1], p[2], p[3], p[4]), r"indptr must have M\+1"),
    (lambda p: (p[0], p[1][:-1], p[2], p[3], p[4]), "values"),
    (lambda p: (p[0].int(), p[1], p[2], p[3], p[4]), "int64"),
    (lambda p: (p[0], p[1].long(), p[2], p[3], p[4]), "int32"),
    (lambda p: (p[0], p[1], p[2].float(), p[3], p[4]), "the matrix says float16"),
    (lambda p: (p[0], p[1], p[2], (p[3][0], 0), p[4]), "shape"),
    (lambda p: (p[0], p[1], p[2], p[3], "float64"), "float16"),
    (lambda p: (p[0].numpy(), p[1], p[2], p[3], p[4]), "torch tensor"),
    (lambda p: (p[0], p[1].view(1, -1), p[2], p[3], p[4]), "1-D"),
])
def test_malformed_parts_are_refused_by_name(edit, words):
    parts = edit(_parts(_dense()))
    if words is None:
        DeviceCsr(*parts)
        return
    with pytest.raises(SparseFormatError, match=words):
        DeviceCsr(*parts)


def test_entries_are_checked_as_sparse_matrix_checks_them():
    dense = _dense(m=4, k=30, seed=3)
    dense[1, 5], dense[1, 9] = 1.0, 2.0
    indptr, indices, values, shape, dtype = _parts(dense)
    row1 = slice(int(indptr[1]), int(indptr[2]))

    out_of_range = indices.clone()
    out_of_range[row1.start] = 30
    with pytest.raises(SparseFormatError, match=r"row 1: column index 30 is out of range \[0, 30\)"):
        DeviceCsr(indptr, out_of_range, values, shape, dtype)

    swapped = indices.clone()
    swapped[row1.start], swapped[row1.start + 1] = indices[row1.start + 1], indices[row1.start]
    with pytest.raises(SparseFormatError, match="row 1: unsorted column indices"):
        DeviceCsr(indptr, swapped, values, shape, dtype)

    repeated = indices.clone()
    repeated[row1.start + 1] = indices[row1.start]
    with pytest.raises(SparseFormatError, match="row 1: duplicate column indices"):
        DeviceCsr(indptr, repeated, values, shape, dtype)

    poisoned = values.clone()
    poisoned[row1.start] = float("inf")
    with pytest.raises(SparseFormatError, match="row 1, column 5: value inf is not finite"):
        DeviceCsr(indptr, indices, poisoned, shape, dtype)

    falling = indptr.clone()
    falling[2] = falling[1] - 1
    with pytest.raises(SparseFormatError, match="not monotone: row 1"):
        DeviceCsr(falling, indices, values, shape, dtype)

    shifted = indptr.clone() + 1
    with pytest.raises(SparseFormatError, match="runs from 1"):
        DeviceCsr(shifted, indices, values, shape, dtype)


def test_a_row_boundary_may_step_down():
    """Column order is per row: the next row may start at a lower column (not 'unsorted')."""
    dense = torch.zeros(2, 8, dtype=torch.float16)
    dense[0, 7], dense[1, 0] = 1.0, 2.0
    assert _csr(dense).nnz == 2


def test_an_empty_matrix():
    w = _csr(torch.zeros(3, 5, dtype=torch.float32))
    assert w.nnz == 0 and w.to_host().nnz == 0
    assert np.array_equal(w.to_host().indptr, np.zeros(4))


def test_the_host_copy_is_made_once():
    w = _csr(_dense())
    assert w.to_host() is w.to_host()
