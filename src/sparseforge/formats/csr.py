"""SparseMatrix: the host-side sparse weight every later stage reads (CSR, validated, immutable)."""
from __future__ import annotations

import functools
import hashlib
import numbers
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import SparseFormatError
from .exact import INDEX_LIMIT, as_array, exact_int_array, shown
from ..dtypes import dtype_name
from .smtx import read_smtx, write_smtx

# Values are kept in numpy; bfloat16 has no numpy dtype, so its values are held exactly in float32.
_STORAGE = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": np.float32}
_FORMAT_VERSION = 1


def _dtype_name(dtype: Any) -> str:
    name = dtype_name(dtype)
    if name not in _STORAGE:
        raise SparseFormatError(f"dtype {dtype} is not supported; use one of {sorted(_STORAGE)}")
    return name


@dataclass(frozen=True)
class MatrixStats:
    rows: int
    cols: int
    nnz: int
    density: float
    row_nnz_mean: float
    row_nnz_std: float
    row_nnz_max: int
    empty_rows: int
    distinct_cols: int
    column_reuse: float  # nonzeros per distinct column used: how often one loaded B row serves several W rows

    @property
    def sparsity(self) -> float:
        return 1.0 - self.density


def validate_csr(indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, shape: tuple[int, int]) -> None:
    """Raise SparseFormatError naming the first problem found in a CSR triple."""
    if len(shape) != 2:
        raise SparseFormatError(f"a SparseMatrix is 2-D; got shape {tuple(shape)}. Reshape first "
                                "(a Conv2d weight is viewed as Cout x Cin*kh*kw)")
    m, k = shape
    if m < 1 or k < 1:
        raise SparseFormatError(f"shape {shape}: both dimensions must be >= 1")
    if m >= INDEX_LIMIT or k >= INDEX_LIMIT:
        raise SparseFormatError(f"shape {shape}: M and K must be < 2**31 = {INDEX_LIMIT}; indices are int32 "
                                "in every kernel. Split the weight into blocks first")
    for what, array in (("indptr", indptr), ("indices", indices), ("values", values)):
        if array.ndim != 1:  # named as such: "found 2 entries" for a 1 x 2 array would read as a contradiction
            raise SparseFormatError(f"{what} must be 1-D, got an array of shape {array.shape}; flatten it first")
    if len(indptr) != m + 1:
        raise SparseFormatError(f"indptr must have M+1 = {m + 1} entries, found {indptr.size}")
    if indptr[0] != 0:
        raise SparseFormatError(f"indptr must start at 0, starts at {indptr[0]}")
    steps = np.diff(indptr)
    if (steps < 0).any():
        row = int(np.argmax(steps < 0))
        raise SparseFormatError(f"indptr is not monotone: row {row} ends at {indptr[row + 1]} before it starts at {indptr[row]}")
    nnz = int(indptr[-1])
    if indices.ndim != 1 or len(indices) != nnz:
        raise SparseFormatError(f"indptr says nnz = {nnz} but there are {indices.size} column indices")
    if values.ndim != 1 or len(values) != nnz:
        raise SparseFormatError(f"indptr says nnz = {nnz} but there are {values.size} values")
    if nnz and (indices.min() < 0 or indices.max() >= k):
        pos = int(np.argmax((indices < 0) | (indices >= k)))
        row = int(np.searchsorted(indptr, pos, side="right") - 1)
        raise SparseFormatError(f"row {row}: column index {indices[pos]} is out of range [0, {k})")
    _check_sorted_rows(indptr, indices)
    if not np.isfinite(values).all():
        pos = int(np.argmax(~np.isfinite(values)))
        row = int(np.searchsorted(indptr, pos, side="right") - 1)
        raise SparseFormatError(f"row {row}, column {indices[pos]}: value {values[pos]} is not finite; "
                                "NaN/inf weights would poison every output that uses them, fix the weights first")


def _check_sorted_rows(indptr: np.ndarray, indices: np.ndarray) -> None:
    if len(indices) < 2:
        return
    within_row = np.ones(len(indices) - 1, dtype=bool)
    row_starts = indptr[1:-1]
    row_starts = row_starts[(row_starts > 0) & (row_starts < len(indices))]
    within_row[row_starts - 1] = False
    steps = np.diff(indices.astype(np.int64))
    bad = within_row & (steps <= 0)
    if bad.any():
        pos = int(np.argmax(bad))
        row = int(np.searchsorted(indptr, pos, side="right") - 1)
        what = "duplicate" if steps[pos] == 0 else "unsorted"
        raise SparseFormatError(f"row {row}: {what} column indices ({indices[pos]} then {indices[pos + 1]}); "
                                "columns must be strictly increasing within a row (scipy: .sum_duplicates())")


class SparseMatrix:
    """A sparse weight matrix W (M x K) in CSR form, immutable and validated on construction.

    indptr: int64[M+1]; indices: int32[nnz], strictly increasing within each row; values: [nnz],
    finite; dtype: "float32" | "float16" | "bfloat16" | "float64" (the dtype kernels will use);
    shape: (M, K) with 1 <= M, K < 2**31.

    indptr and indices are taken exactly or refused: any entry that is not an integer (1.7, nan, True)
    or does not fit (an index >= 2**31) raises SparseFormatError, never wraps or truncates. values are
    read as float64 (exact for float16/32/64 and integers up to 2**53), then rounded to nearest in
    `dtype` (bfloat16 through float32, as torch does); a finite value beyond the dtype's range, a complex
    or a text entry raises SparseFormatError. A shape that is not a sequence raises TypeError.
    """

    __slots__ = ("indptr", "indices", "values", "shape", "dtype", "_digest", "_packed")

    def __init__(self, indptr, indices, values, shape, dtype: Any = None, *, validate: bool = True):
        indptr = exact_int_array(indptr, "indptr", np.int64)
        indices = exact_int_array(indices, "indices", np.int32, hint="; column indices are int32, K must be < 2**31")
        values, name = _rounded_values(values, dtype)
        shape = _exact_shape(shape)
        if validate:
            validate_csr(indptr, indices, values, shape)
        for array in (indptr, indices, values):
            array.setflags(write=False)
        object.__setattr__(self, "indptr", indptr)
        object.__setattr__(self, "indices", indices)
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", name)
        object.__setattr__(self, "_digest", None)
        object.__setattr__(self, "_packed", {})

    def __setattr__(self, name, value):
        raise AttributeError("SparseMatrix is immutable; build a new one")

    def __getstate__(self):  # the memo (packed) is not state: a copy packs again if asked
        return None, {name: getattr(self, name) for name in self.__slots__ if name != "_packed"}

    def __setstate__(self, state):
        for name, value in state[1].items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_packed", {})

    def packed(self, key: tuple, pack):
        """pack() once per key for this matrix: a family's kernel arrays, keyed by what shapes them, shared by
        every candidate config the chooser plans (one csr packing serves them all). Threads may pack alike at
        once (prebuild jobs): each gets a whole packing, the first one kept."""
        held = self._packed.get(key)
        if held is None:
            held = self._packed.setdefault(key, pack())
        return held

    def drop_packed(self) -> None:
        """Forget what packed() holds (host memory the size of W) once the kernels that wanted it are built."""
        self._packed.clear()

    # -- constructors --------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, dense) -> "SparseMatrix":
        """From a 2-D numpy array or torch tensor of any float dtype; exact zeros (and -0.0) are dropped.

        Masked entries of a numpy masked array count as zeros (even a masked NaN), as np.ma.filled(0).
        """
        array, name = _dense_to_numpy(dense)
        if not np.isfinite(array).all():
            r, c = np.argwhere(~np.isfinite(array))[0]
            raise SparseFormatError(f"weight[{r}, {c}] = {array[r, c]} is not finite; fix NaN/inf weights first")
        rows, cols = np.nonzero(array)
        indptr = np.zeros(array.shape[0] + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=array.shape[0]), out=indptr[1:])
        return cls(indptr, cols, array[rows, cols], array.shape, name)

    @classmethod
    def from_scipy(cls, matrix, dtype: Any = None) -> "SparseMatrix":
        """From any scipy.sparse matrix or array; its stored pattern is kept, duplicates are summed."""
        import scipy.sparse as sp

        if not sp.issparse(matrix):
            raise SparseFormatError(f"expected a scipy.sparse matrix, got {type(matrix).__name__}")
        csr = sp.csr_array(matrix, copy=True)
        csr.sum_duplicates()
        return cls(csr.indptr, csr.indices, csr.data, csr.shape, dtype or csr.data.dtype)

    @classmethod
    def from_smtx(cls, path: str | Path, seed: int = 0, dtype: Any = "float32") -> "SparseMatrix":
        """From a DLMC `.smtx` pattern; values are a seeded standard normal (same seed, same values)."""
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            # numpy's own words ("expected non-negative integer", "SeedSequence expects int") name no argument
            raise TypeError(f"seed must be a non-negative integer, got {type(seed).__name__} {seed!r}")
        shape, indptr, indices = read_smtx(path)
        values = np.random.default_rng(seed).standard_normal(len(indices))
        try:
            return cls(indptr, indices, values, shape, dtype)
        except SparseFormatError as err:
            raise SparseFormatError(f"{path}: {err}") from None

    @classmethod
    def load(cls, path: str | Path) -> "SparseMatrix":
        """Load a matrix written by save() (one .npz file, pattern and values)."""
        try:
            with open(path, "rb") as head:
                if head.read(2) != b"PK":  # np.load's word for other files is to try allow_pickle: the wrong way
                    raise SparseFormatError(f"{path}: not a .npz archive, as SparseMatrix.save() writes; a DLMC .smtx "
                                            "pattern is read with SparseMatrix.from_smtx")
            with np.load(path, allow_pickle=False) as f:
                version, shape, dtype = f["format_version"], f["shape"], f["dtype"]
                if version.shape != () or version.dtype.kind not in "iu" or int(version) != _FORMAT_VERSION:
                    raise SparseFormatError(f"{path}: format version {version}, this sparseforge reads "
                                            f"{_FORMAT_VERSION}; write the file again with SparseMatrix.save()")
                if shape.shape != (2,) or dtype.shape != ():
                    raise SparseFormatError(f"{path}: shape {shape.tolist()} and dtype {dtype.tolist()} must be a "
                                            "pair (M, K) and one name; write the file again with SparseMatrix.save()")
                try:
                    return cls(f["indptr"], f["indices"], f["values"], tuple(shape), str(dtype))
                except SparseFormatError as err:  # which file: the matrix's own message cannot say
                    raise SparseFormatError(f"{path}: {err}") from None
        except (KeyError, zipfile.BadZipFile, EOFError, ValueError, OSError) as err:
            if isinstance(err, SparseFormatError):
                raise
            raise SparseFormatError(f"{path}: not a readable sparseforge matrix file ({err}); "
                                    "write one with SparseMatrix.save()") from None

    # -- conversions ---------------------------------------------------------------------------
    def to_dense(self) -> np.ndarray:
        out = np.zeros(self.shape, dtype=self.values.dtype)
        out[np.repeat(np.arange(self.shape[0]), np.diff(self.indptr)), self.indices] = self.values
        return out

    def to_torch(self, device=None):
        import torch

        return torch.from_numpy(self.to_dense()).to(device=device, dtype=getattr(torch, self.dtype))

    def to_scipy(self):
        import scipy.sparse as sp

        return sp.csr_array((self.values.copy(), self.indices.copy(), self.indptr.copy()), shape=self.shape)

    def to_smtx(self, path: str | Path) -> None:
        """Write the pattern only (values are not part of the .smtx format)."""
        write_smtx(path, self.shape, self.indptr, self.indices)

    def save(self, path: str | Path) -> None:
        """Write pattern and values into one .npz file (`path` must end in .npz: the one format it writes)."""
        suffix = Path(path).suffix
        if suffix.lower() != ".npz":
            hint = (": .smtx holds the pattern only, written by to_smtx(path)" if suffix.lower() == ".smtx" else
                    f", not the {suffix} format" if suffix else "")
            raise SparseFormatError(f"{path}: SparseMatrix.save writes a .npz archive (pattern and values){hint}; "
                                    "give a path ending in .npz")
        with open(path, "wb") as f:
            np.savez(f, format_version=_FORMAT_VERSION, indptr=self.indptr, indices=self.indices,
                     values=self.values, shape=np.array(self.shape), dtype=np.array(self.dtype))

    def astype(self, dtype: Any) -> "SparseMatrix":
        """The same pattern with values rounded to dtype (itself where that is its dtype). The pattern was
        checked when this matrix was made; the rounding refuses values beyond the dtype's range."""
        if _dtype_name(dtype) == self.dtype:
            return self
        return SparseMatrix(self.indptr, self.indices, self.values, self.shape, dtype, validate=False)

    # -- properties ----------------------------------------------------------------------------
    @property
    def nnz(self) -> int:
        return int(self.indptr[-1])

    @property
    def density(self) -> float:
        return self.nnz / (self.shape[0] * self.shape[1])

    @property
    def row_nnz(self) -> np.ndarray:
        return np.diff(self.indptr)

    def stats(self) -> MatrixStats:
        counts = self.row_nnz
        distinct = int(np.unique(self.indices).size)
        return MatrixStats(
            rows=self.shape[0], cols=self.shape[1], nnz=self.nnz, density=self.density,
            row_nnz_mean=float(counts.mean()), row_nnz_std=float(counts.std()), row_nnz_max=int(counts.max()),
            empty_rows=int((counts == 0).sum()), distinct_cols=distinct,
            column_reuse=self.nnz / distinct if distinct else 0.0)

    def digest(self) -> str:
        """sha256 over shape, dtype, pattern and values: the identity of this weight for caches."""
        if self._digest is None:  # computed once: the matrix is immutable, and spmm() looks it up per call
            h = hashlib.sha256(f"{self.shape}|{self.dtype}|".encode())
            for array in (self.indptr, self.indices, self.values):
                h.update(array.tobytes())
            object.__setattr__(self, "_digest", h.hexdigest())
        return self._digest

    def __eq__(self, other) -> bool:
        if not isinstance(other, SparseMatrix):
            return NotImplemented
        return (self.shape == other.shape and self.dtype == other.dtype
                and np.array_equal(self.indptr, other.indptr) and np.array_equal(self.indices, other.indices)
                and np.array_equal(self.values, other.values))

    __hash__ = None

    def __repr__(self) -> str:
        return f"SparseMatrix(shape={self.shape}, nnz={self.nnz}, density={self.density:.4f}, dtype={self.dtype})"


def forgets_packings(function):
    """Decorate an entry point whose first argument is W: after the call a host SparseMatrix W forgets the
    kernel arrays planning packed from it (SparseMatrix.packed): they serve the candidates of one call, not the
    caller's lifetime. Anything else passed as W (a dense array, a DeviceCsr, whose packings the kernels
    read and a layer's widths share) is left as it is."""
    @functools.wraps(function)
    def wrapper(W, *args, **kwargs):
        try:
            return function(W, *args, **kwargs)
        finally:
            if isinstance(W, SparseMatrix):
                W.drop_packed()
    return wrapper


def _round_to(values: np.ndarray, name: str) -> np.ndarray:
    """Round values to dtype `name` (bfloat16 through torch: numpy has no bfloat16)."""
    if name == "bfloat16":
        import torch

        return torch.tensor(np.asarray(values, dtype=np.float32)).bfloat16().float().numpy()
    return np.asarray(values).astype(_STORAGE[name])


def _exact_shape(shape) -> tuple[int, ...]:
    """shape as a tuple of Python ints, exactly (1.7 or 2**64 raise SparseFormatError, not int() them)."""
    if isinstance(shape, (str, bytes)) or not np.iterable(shape):
        raise TypeError(f"shape must be a pair of integers (M, K), got {type(shape).__name__} {shape!r}")
    dims = exact_int_array(list(shape), "shape", np.int64)
    if dims.ndim != 1:
        raise SparseFormatError(f"shape must be a pair of integers (M, K), got {shape!r}")
    return tuple(dims.tolist())


def _rounded_values(values, dtype: Any) -> tuple[np.ndarray, str]:
    """(values rounded to the matrix dtype, its name); the rules are in SparseMatrix's docstring."""
    if type(values).__module__.startswith("torch") and hasattr(values, "dtype"):
        if dtype is None:  # the tensor's own dtype, as from_dense keeps it
            dtype = values.dtype
        values = values.detach().cpu()
        values = values.float() if values.is_floating_point() and values.itemsize < 4 else values  # bfloat16: no numpy
    array = as_array(values, "values")
    name = _dtype_name(dtype if dtype is not None else array.dtype)
    if array.dtype.kind == "O":
        for pos, x in enumerate(array.flat):
            if not isinstance(x, (numbers.Real, np.bool_)):
                raise SparseFormatError(f"values: entry {pos} is {shown(x)}, not a real number")
            try:
                float(x)
            except OverflowError:  # a Python int beyond float64
                raise SparseFormatError(f"values: entry {pos} = {shown(x)} overflows float64") from None
        array = array.astype(np.float64)
    elif array.dtype.kind not in "biuf":  # complex would lose its imaginary part, text would be parsed
        raise SparseFormatError(f"values must be real numbers, got an array of {array.dtype}")
    elif array.dtype.kind != "f" or array.dtype.itemsize > 8:
        array = array.astype(np.float64)
    with np.errstate(over="ignore"):
        rounded = np.ascontiguousarray(_round_to(array, name))
    overflow = np.isfinite(array) & ~np.isfinite(rounded)  # NaN and inf given as such are validate_csr's
    if overflow.any():
        pos = int(np.argmax(overflow.ravel()))
        raise SparseFormatError(f"values: entry {pos} = {array.flat[pos]} overflows {name}; "
                                "scale the weights or use a wider dtype")
    return rounded, name


def _check_dense_shape(shape: tuple[int, ...]) -> None:
    """The shape rules of validate_csr, applied before a dense weight is converted or scanned: a (1, 2**31)
    weight was refused only after 20 s and 2 GB of copying and finding its nonzeros."""
    if len(shape) != 2:
        raise SparseFormatError(f"expected a 2-D weight, got shape {shape}; "
                                "view a Conv2d weight as weight.flatten(1) first")
    if min(shape) < 1:
        raise SparseFormatError(f"shape {shape}: both dimensions must be >= 1")
    if max(shape) >= INDEX_LIMIT:
        raise SparseFormatError(f"shape {shape}: M and K must be < 2**31 = {INDEX_LIMIT}; indices are int32 "
                                "in every kernel. Split the weight into blocks first")


def _dense_to_numpy(dense) -> tuple[np.ndarray, str]:
    """The weight as a 2-D numpy array of its float dtype (bfloat16 held in float32), its shape checked first."""
    if type(dense).__module__.startswith("torch"):
        import torch

        if dense.layout != torch.strided:
            raise SparseFormatError(f"expected a dense weight, got a torch tensor in {dense.layout} layout; pass "
                                    "weight.to_dense(), or its scipy form to SparseMatrix.from_scipy")
        if dense.is_meta:
            raise SparseFormatError("the weight is a meta tensor and holds no values; load or materialise the "
                                    "weights first (e.g. model.to_empty(device='cpu') and load_state_dict)")
        if not torch.is_floating_point(dense):
            raise SparseFormatError(f"expected a floating-point weight, got {dense.dtype}")
        _check_dense_shape(tuple(dense.shape))
        name = _dtype_name(dense.dtype)
        tensor = dense.detach().cpu()
        return (tensor.float() if name == "bfloat16" else tensor).numpy(), name
    # as_array: a ragged nested list is named here, not in numpy's words
    array = np.ma.filled(dense, 0) if np.ma.isMaskedArray(dense) else as_array(dense, "the dense weight")
    if not np.issubdtype(array.dtype, np.floating):
        raise SparseFormatError(f"expected a floating-point weight, got {array.dtype}")
    _check_dense_shape(array.shape)
    return array, _dtype_name(array.dtype)
