import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import event, given, settings
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
    ([[0, 1]], [0], [1.0], (1, 2), r"indptr must be 1-D, got an array of shape \(1, 2\)"),  # was "found 2"
    ([0, 1], [[0]], [1.0], (1, 2), r"indices must be 1-D, got an array of shape \(1, 1\)"),
    ([0, 1], [0], [[1.0]], (1, 2), r"values must be 1-D"),  # was "nnz = 1 but there are 1 values"
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
    (torch.eye(3).to_sparse(), "torch.sparse_coo layout; pass weight.to_dense()"),  # was a TypeError from torch
    (torch.ones(2, 2, device="meta"), "meta tensor and holds no values"),  # was NotImplementedError
])
def test_from_dense_rejects_bad_input(bad, message):
    with pytest.raises(SparseFormatError, match=message):
        SparseMatrix.from_dense(bad)


def test_from_dense_names_a_ragged_list():
    with pytest.raises(SparseFormatError, match="the dense weight is not a flat sequence of numbers"):
        SparseMatrix.from_dense([[1.0, 2.0], [3.0]])  # was numpy's ValueError about an inhomogeneous shape


@pytest.mark.parametrize("make", [lambda shape: torch.zeros(1).expand(*shape),  # views: no memory behind them
                                  lambda shape: np.broadcast_to(np.float32(0), shape)])
@pytest.mark.parametrize("shape, message", [((1, 2**31), "M and K must be < 2\\*\\*31"),
                                            ((2**31, 1), "M and K must be < 2\\*\\*31"),
                                            ((0, 8), "both dimensions must be >= 1")])
def test_from_dense_checks_the_shape_before_scanning_the_values(monkeypatch, make, shape, message):
    def scanned(*args, **kwargs):
        raise AssertionError("the values were scanned before the shape was checked")

    dense = make(shape)
    # a (1, 2**31) weight was refused only after 20 s and 2 GB of scanning for non-finite values and nonzeros
    monkeypatch.setattr(np, "isfinite", scanned)
    monkeypatch.setattr(np, "nonzero", scanned)
    with pytest.raises(SparseFormatError, match=message):
        SparseMatrix.from_dense(dense)


def _npz(path, **changes):
    w = SparseMatrix.from_dense(np.eye(3, dtype=np.float32))
    fields = dict(format_version=1, indptr=w.indptr, indices=w.indices, values=w.values, shape=np.array(w.shape),
                  dtype=np.array(w.dtype))
    np.savez(path, **{**fields, **changes})
    return path


@pytest.mark.parametrize("changes, message", [
    ({"format_version": np.array([1, 2])}, r"format version \[1 2\], this sparseforge reads 1"),  # was TypeError
    ({"shape": np.array(3)}, "shape 3 and dtype float32 must be a pair"),  # was TypeError from numpy
    ({"shape": np.array([3])}, r"shape \[3\] .* must be a pair"),
    ({"dtype": np.array("int8")}, "dtype int8 is not supported"),
    ({"indices": np.array([0, 1, 7], dtype=np.int32)}, "column index 7 is out of range"),
])
def test_load_names_the_file_and_what_is_wrong_in_it(tmp_path, changes, message):
    path = _npz(tmp_path / "w.npz", **changes)
    with pytest.raises(SparseFormatError, match=f"w.npz: .*{message}"):
        SparseMatrix.load(path)


def test_load_of_a_file_that_is_not_npz_says_which_reader_to_use(tmp_path):
    path = tmp_path / "w.smtx"
    path.write_text("1, 1, 1\n0 1\n0\n")
    with pytest.raises(SparseFormatError, match="not a .npz archive.*SparseMatrix.from_smtx") as info:
        SparseMatrix.load(path)
    assert "allow_pickle" not in str(info.value)  # numpy's advice: the wrong way for this file


def test_constructor_takes_torch_values_of_any_float_dtype():
    w = SparseMatrix(torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([1.5], dtype=torch.bfloat16), (1, 1))
    assert w.dtype == "bfloat16" and w.values.tolist() == [1.5]  # was "unsupported ScalarType BFloat16"


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


# -- bad input: indices are exact int32, values round only as documented, masked arrays -----------------------

@pytest.mark.parametrize("indices, message", [
    ([2**32 + 2], "entry 0 = 4294967298 does not fit in int32"),  # used to wrap to column 2
    (np.array([2**32 + 2], np.int64), "entry 0 = 4294967298 does not fit in int32"),
    ([2**31], "entry 0 = 2147483648 does not fit in int32"),  # used to show the wrapped -2147483648
    (np.array([2**64 - 1], np.uint64), "entry 0 = 18446744073709551615 does not fit in int32"),
    ([1.7], "entry 0 is 1.7, not an integer"),  # used to truncate to column 1
    (np.array([0.5], np.float32), "entry 0 is 0.5, not an integer"),
    ([np.nan], "entry 0 is nan, not an integer"),
    (np.array([True]), "got an array of bool"),
    ([1, "2"], "got an array of <U21"),
])
def test_indices_that_are_not_exact_int32_are_refused(indices, message):
    with pytest.raises(SparseFormatError, match=message):
        SparseMatrix([0, len(indices)], indices, np.ones(len(indices), np.float32), (1, 4))


@pytest.mark.parametrize("indptr, message", [
    ([0.0, 1.5], "indptr: entry 1 is 1.5, not an integer"),  # used to truncate to [0, 1]
    (np.array([0, 2**64 - 1], np.uint64), "indptr: entry 1 = 18446744073709551615 does not fit in int64"),
    ([0, 10**30], r"indptr: entry 1 = 1000000000000000000000000000000 does not fit in int64"),
])
def test_indptr_that_is_not_exact_int64_is_refused(indptr, message):
    with pytest.raises(SparseFormatError, match=message):
        SparseMatrix(indptr, [0], [1.0], (1, 4))


def test_integral_float_and_wide_integer_indices_are_taken_exactly():
    w = SparseMatrix(np.array([0.0, 2.0]), np.array([0, 3], np.uint64), [1.0, 2.0], (np.uint8(1), 4.0))
    assert (w.shape, w.indptr.tolist(), w.indices.tolist()) == ((1, 4), [0, 2], [0, 3])
    assert w.indptr.dtype == np.int64 and w.indices.dtype == np.int32


@pytest.mark.parametrize("shape, message", [
    ((1, 2**31), r"M and K must be < 2\*\*31"),
    ((2**40, 1), r"M and K must be < 2\*\*31"),
    ((1.7, 4), "shape: entry 0 is 1.7, not an integer"),  # used to become (1, 4)
    ((1, 2**70), "shape: entry 1 = 1180591620717411303424 does not fit in int64"),
])
def test_shape_that_is_not_exact_or_beyond_int32_is_refused(shape, message):
    with pytest.raises(SparseFormatError, match=message):
        SparseMatrix([0, 1], [0], [1.0], shape)


@pytest.mark.parametrize("shape", ["ab", 5, None])
def test_shape_of_the_wrong_python_type_is_a_type_error(shape):
    with pytest.raises(TypeError, match="shape must be a pair of integers"):
        SparseMatrix([0, 1], [0], [1.0], shape)


def test_from_scipy_refuses_columns_beyond_int32():
    # scipy keeps int64 indices for K >= 2**31; a plain astype(int32) read column 2**32 + 2 as column 2
    big = sp.coo_array(([1.0], ([0], [2**32 + 2])), shape=(1, 2**32 + 4))
    with pytest.raises(SparseFormatError, match=r"K must be < 2\*\*31"):
        SparseMatrix.from_scipy(big)


def test_from_scipy_takes_int64_indices_exactly():
    dense = np.array([[0, 1.5, 0, 2], [3, 0, 0, 0]])
    csr = sp.csr_array(dense)
    csr.indices, csr.indptr = csr.indices.astype(np.int64), csr.indptr.astype(np.int64)
    assert SparseMatrix.from_scipy(csr) == SparseMatrix.from_dense(dense)


@pytest.mark.parametrize("values, dtype, message", [
    ([1 + 2j], "float32", "values must be real numbers, got an array of complex128"),  # dropped the 2j
    (["1.5"], "float32", "values must be real numbers, got an array of <U3"),  # parsed the text
    (np.array([1.5, "x"], dtype=object), "float32", "values: entry 1 is 'x', not a real number"),
    ([1e300], "float16", r"values: entry 0 = 1e\+300 overflows float16"),  # said 'value inf is not finite'
    ([3.5e38], "bfloat16", r"values: entry 0 = 3.5e\+38 overflows bfloat16"),
    (np.array([10**400], dtype=object), "float64", r"values: entry 0 = 10000000000000000000\.\.\.\(401 characters\) overflows"),
])
def test_values_a_cast_would_change_are_refused(values, dtype, message):
    with pytest.raises(SparseFormatError, match=message):
        SparseMatrix([0, 1], [0], values, (1, 2), dtype)


def test_constructor_rounds_values_to_bfloat16():
    w = SparseMatrix([0, 1], [0], [1.0 + 2**-12], (1, 2), "bfloat16")
    assert w.values.tolist() == [1.0]


@pytest.mark.parametrize("masked", [2.0, np.nan])
def test_from_dense_masked_entries_count_as_zero(masked):
    dense = np.ma.masked_array([[1.0, masked], [0.0, 3.0]], mask=[[False, True], [False, False]])
    w = SparseMatrix.from_dense(dense)
    assert w.to_dense().tolist() == [[1.0, 0.0], [0.0, 3.0]] and w.nnz == 2


# -- fuzz: constructor arguments give a matrix equal to what they say, or SparseFormatError --------------------

_CONTAINERS = ["list", np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
               np.float16, np.float32, np.float64, object, bool]
_NASTY_INDICES = [2**31 - 1, 2**31, 2**32, 2**32 + 2, 2**63, 2**64 + 1, -1, -2**63 - 1, 1.7, 2.0, -0.0, 0.5,
                  float("nan"), float("inf"), True, 10**30, 1e30, np.float16(3), np.uint64(2**64 - 1)]
_NASTY_VALUES = [1e300, -1e39, 65505.0, 3.4e38, float("nan"), float("inf"), 10**400, 2**64, True, 1 + 2j, "1.5",
                 None, -0.0, 2**53 + 1, np.float16(-2), np.int64(-2**63)]
_NASTY_SHAPES = [(2**31, 1), (1, 2**32 + 1), (2**64, 1), (1.5, 1), (True, 1), "ab", 5, None, (1,), (1, 1, 1),
                 (np.uint64(1), np.int8(1)), (-1, 1), (0, 1), ("1", "1"), ((1, 1), 1), np.array([1.0, 1.0])]
_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.float32, "float64": np.float64}


@st.composite
def _container(draw, items: list, nasty: list):
    """`items`, maybe with an entry replaced by or extended with a nasty one, as a list or a numpy array."""
    items = list(items)
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):  # mostly clean: a clean list, a wide dtype
        new = draw(st.sampled_from(nasty) | st.integers(-2**70, 2**70) | st.floats(allow_nan=True))
        at = draw(st.integers(0, len(items)))
        items[at:at + draw(st.integers(0, 1))] = [new]
    kind = draw(st.sampled_from(_CONTAINERS))
    if kind == "list":
        return items
    try:  # numpy's own cast may wrap or fail here; what it makes is then the input the matrix must match
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return np.array(items, dtype=object).astype(kind)
    except (OverflowError, ValueError, TypeError):
        return items


@st.composite
def constructor_args(draw):
    keep = draw(hnp.arrays(bool, st.tuples(st.integers(1, 4), st.integers(1, 4))))
    w = SparseMatrix.from_dense(keep * np.arange(1, keep.size + 1, dtype=np.float64).reshape(keep.shape))
    indptr = draw(_container(w.indptr.tolist(), _NASTY_INDICES))
    indices = draw(_container(w.indices.tolist(), _NASTY_INDICES))
    values = draw(_container(w.values.tolist(), _NASTY_VALUES))
    shape = draw(st.just(w.shape) | st.sampled_from(_NASTY_SHAPES))
    dtype = draw(st.sampled_from([None, "float32", "float16", "bfloat16", "float64", torch.float16, "int8"]))
    return indptr, indices, values, shape, dtype


def _as_written(x) -> list:
    return x.tolist() if isinstance(x, np.ndarray) else list(x)


def _rounded_as_documented(values, name: str) -> np.ndarray:
    """SparseMatrix's rule: read as float64, round to nearest in the dtype (bfloat16 through float32)."""
    exact = np.array([float(v) for v in _as_written(values)], dtype=np.float64)
    if name == "bfloat16":
        return torch.tensor(exact.astype(np.float32)).bfloat16().float().numpy()
    return exact.astype(_STORAGE[name])


@given(constructor_args())
@settings(max_examples=600, deadline=None)
def test_fuzzed_constructor_builds_what_it_is_given_or_raises(args):
    indptr, indices, values, shape, dtype = args
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a ComplexWarning or an overflow warning is a silent change
            w = SparseMatrix(indptr, indices, values, shape, dtype)
    except SparseFormatError:
        event("refused")
        return
    except TypeError:
        assert isinstance(shape, str) or not np.iterable(shape), "TypeError for something else than shape's type"
        event("TypeError for shape")
        return
    event("built")
    assert w.indptr.tolist() == _as_written(indptr)  # == between Python numbers: 2 == 2.0, 1 != 1.7
    assert w.indices.tolist() == _as_written(indices)
    assert list(w.shape) == _as_written(shape)
    assert np.array_equal(w.values, _rounded_as_documented(values, w.dtype))


def test_astype_keeps_the_checked_pattern_and_still_refuses_overflow():
    w = SparseMatrix.from_dense(np.array([[0.0, 70000.0], [1.5, 0.0]], dtype=np.float32))
    assert w.astype("float32") is w  # nothing to round: the same matrix, its digest and packings kept
    with pytest.raises(SparseFormatError):
        w.astype("float16")  # 70000 is past float16's range
    half = SparseMatrix.from_dense(np.array([[0.0, 2.0], [1.5, 0.0]], dtype=np.float32)).astype("float16")
    assert half.dtype == "float16" and half == SparseMatrix.from_dense(np.array([[0, 2], [1.5, 0]], np.float16))


def test_packed_is_made_once_a_key_and_not_pickled():
    import pickle

    w = SparseMatrix.from_dense(np.eye(3, dtype=np.float32))
    made = []
    first = w.packed(("k",), lambda: made.append(1) or np.arange(3))
    assert w.packed(("k",), lambda: made.append(1) or np.arange(5)) is first and made == [1]
    copy = pickle.loads(pickle.dumps(w))
    assert copy == w and copy.digest() == w.digest()
    assert copy.packed(("k",), lambda: "again") == "again"  # the memo did not travel
    w.drop_packed()
    assert w.packed(("k",), lambda: "anew") == "anew"


@pytest.mark.parametrize("name, hint", [("W.safetensors", "not the .safetensors format"),
                                        ("W.smtx", "written by to_smtx"), ("W", "")])
def test_save_refuses_a_suffix_it_does_not_write_naming_the_one_it_does(tmp_path, name, hint):
    w = SparseMatrix.from_dense(np.eye(4, dtype=np.float32))
    with pytest.raises(SparseFormatError, match=f"writes a .npz archive.*{hint}.*give a path ending in .npz"):
        w.save(tmp_path / name)
    assert not (tmp_path / name).exists()
    w.save(tmp_path / "W.NPZ")
    assert SparseMatrix.load(tmp_path / "W.NPZ") == w
