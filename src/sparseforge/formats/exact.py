"""Exact conversion of index data (CSR offsets, column indices, shapes) to fixed-width integers.

A plain ``astype(np.int32)`` wraps 2**32 + 2 to 2 and truncates 1.7 to 1: a valid-looking matrix with the
wrong pattern. Every index that enters a SparseMatrix, from Python, numpy, scipy or a .smtx file, goes
through `exact_int_array`, which either returns the same integers or raises SparseFormatError naming the
entry, its value and the limit.
"""
from __future__ import annotations

import numbers

import numpy as np

from .errors import SparseFormatError

# Column indices are int32 in every kernel and in the .smtx reader, so M and K must fit too.
INDEX_LIMIT = 2**31


def as_array(data, what: str) -> np.ndarray:
    """np.asarray(data), with numpy's error for ragged nested lists turned into a SparseFormatError."""
    try:
        return np.asarray(data)
    except (ValueError, TypeError) as err:
        raise SparseFormatError(f"{what} is not a flat sequence of numbers ({err})") from None


def shown(x) -> str:
    """repr(x) for an error message, cut short: a 400-digit integer would bury the message."""
    text = repr(x)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def exact_int(x) -> int | None:
    """x as a Python int if it is an integer (2, np.uint64(2), 2.0), else None (1.7, nan, True, '2')."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        return None
    try:
        whole = int(x)
    except (ValueError, OverflowError):  # nan, inf
        return None
    return whole if whole == x else None


def exact_int_array(data, what: str, dtype: type[np.signedinteger], hint: str = "") -> np.ndarray:
    """`data` (array-like, any shape) as a contiguous `dtype` array holding exactly the same integers.

    Accepts integer dtypes, floats with integral values and object arrays of such numbers. Raises
    SparseFormatError naming the first entry that is not an integer (1.7, nan, True, '3') or does not
    fit in `dtype`; `what` names the data in the message, `hint` is appended to a range error.
    """
    array = as_array(data, what)
    if array.dtype.kind not in "iufO":
        mask_hint = "; a boolean mask? pass np.flatnonzero(mask)" if array.dtype.kind == "b" else ""
        raise SparseFormatError(f"{what} must be integers, got an array of {array.dtype}{mask_hint}")
    info = np.iinfo(dtype)
    if array.size == 0:
        return np.zeros(array.shape, dtype)
    if array.dtype.kind in "iuf":  # the fast path: one pass for integrality, min and max
        integral = array.dtype.kind != "f" or bool((np.isfinite(array) & (array == np.trunc(array))).all())
        if integral and info.min <= int(array.min()) and int(array.max()) <= info.max:
            return np.ascontiguousarray(array, dtype=dtype)
    exact = []  # the slow path: find the offending entry, or convert an object array
    for pos, x in enumerate(array.ravel().tolist()):
        value = exact_int(x)
        if value is None:
            raise SparseFormatError(f"{what}: entry {pos} is {shown(x)}, not an integer")
        if not info.min <= value <= info.max:
            raise SparseFormatError(f"{what}: entry {pos} = {shown(value)} does not fit in {info.dtype} "
                                    f"[{info.min}, {info.max}]{hint}")
        exact.append(value)
    return np.array(exact, dtype=dtype).reshape(array.shape)
