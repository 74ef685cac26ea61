"""Reading and writing DLMC `.smtx` pattern files.

The format (Gale et al., SC 2020) is three text lines:
  1. ``M, K, nnz``
  2. the M+1 CSR row offsets, space separated
  3. the nnz column indices, space separated, sorted within each row
Only the pattern is stored; values come from elsewhere (a seeded normal, see SparseMatrix.from_smtx).

What the reader accepts, exactly: a field is ASCII digits with an optional leading '-' (so a negative
offset or index is reported for what it means, not as a typo); '+3', '1e3', '0x10', '1_000' and
non-ASCII digits such as '٣' are refused. Fields are separated by spaces, tabs or commas; lines end in
\\n or \\r\\n, the last one may end in neither (a UTF-8 byte-order mark is skipped); a carriage return
anywhere else, as in a file with old Mac '\\r' endings, is refused naming its line; blank lines may follow
line 3, not come between.
1 <= M, K < 2**31, because column indices are int32.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .errors import SparseFormatError
from .exact import INDEX_LIMIT, exact_int_array, shown

_FIELD = re.compile(r"[^ \t,]*")
# The first character that cannot be part of a field: not a digit or separator, or a '-' that does not
# start a number ('--2', '5-', a lone '-'). Searched only when a faster byte scan finds a suspect:
# a DLMC line of 5M indices takes 0.6 s with the regex, 0.02 s with bytes.translate.
_NOT_A_FIELD = re.compile(r"[^0-9 \t,-]|-(?![0-9])|(?<=[0-9-])-")
_FIELD_BYTES = b"0123456789 \t,"


def _fields(line: str, where: str) -> list[str]:
    suspect = not line.isascii() or line.encode().translate(None, _FIELD_BYTES)
    if suspect and (bad := _NOT_A_FIELD.search(line)):
        start = max(line.rfind(sep, 0, bad.start()) for sep in " \t,") + 1
        field = _FIELD.match(line, start).group()
        raise SparseFormatError(f"{where}: {shown(field)} is not an integer; a .smtx field is ASCII digits 0-9 "
                                "(with '-' for a negative number), separated by spaces, tabs or commas")
    return line.replace(",", " ").replace("\t", " ").split()


def _parse_ints(line: str, where: str, expected: int, dtype: type[np.signedinteger], hint: str = "") -> np.ndarray:
    fields = _fields(line, where)
    if len(fields) != expected:
        raise SparseFormatError(f"{where}: expected {expected} integers, found {len(fields)}"
                                + (" (an empty line: blank lines may only follow line 3)" if not fields
                                   else " (file truncated?)" if len(fields) < expected else ""))
    try:
        ints = np.array(fields, dtype=np.int64)
    except OverflowError:  # beyond int64: exact_int_array names the value and the limit
        ints = np.array([int(f) for f in fields], dtype=object)
    return exact_int_array(ints, where, dtype, hint)


def _lines(text: str) -> list[str]:
    """The lines of `text`, each without its \\n or \\r\\n ending. split("\\n"), not splitlines(): that
    would also break lines at \\r, \\x0b, \\x1c, \\x85, \\u2028, ... (and so would open()'s universal
    newlines at \\r); a \\r is part of an ending only right before a \\n."""
    pieces = text.split("\n")
    return [piece.removesuffix("\r") for piece in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])


def read_smtx(path: str | Path) -> tuple[tuple[int, int], np.ndarray, np.ndarray]:
    """Read a `.smtx` file; returns ((M, K), indptr int64[M+1], indices int32[nnz]).

    Raises SparseFormatError naming the file, the line and what was expected; the caller
    (SparseMatrix) then validates monotone offsets, column range and sorted rows.
    """
    path = Path(path)
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:  # newline="": every \r as it is in the file
            text = f.read()
    except UnicodeDecodeError:
        raise SparseFormatError(f"{path}: not a text file; a .smtx file holds three lines of integers") from None
    except OSError as err:  # /proc/self/mem says only "[Errno 5] Input/output error", without the path
        raise SparseFormatError(f"{path}: cannot be read ({err.strerror or err}); give a .smtx file") from None
    lines = _lines(text)
    if not text.strip():
        raise SparseFormatError(f"{path}: line 1: expected 'M, K, nnz', found an empty file")
    lone = next((n for n, line in enumerate(lines, start=1) if "\r" in line), None)
    if lone is not None:
        raise SparseFormatError(f"{path}: line {lone}: a carriage return (\\r) that does not end a line; .smtx lines "
                                "end in \\n or \\r\\n (convert old Mac line endings, e.g. tr '\\r' '\\n')")
    m, k, nnz = _parse_ints(lines[0], f"{path}: line 1 ('M, K, nnz')", 3, np.int64,
                            hint="; M and K must be < 2**31").tolist()
    if m < 1 or k < 1 or nnz < 0:
        raise SparseFormatError(f"{path}: line 1: M and K must be >= 1 and nnz >= 0, found {m}, {k}, {nnz}")
    if m >= INDEX_LIMIT or k >= INDEX_LIMIT:
        raise SparseFormatError(f"{path}: line 1: M = {m}, K = {k}; both must be < 2**31 = {INDEX_LIMIT} "
                                "(column indices are int32). Split the matrix into blocks")
    if nnz > m * k:
        raise SparseFormatError(f"{path}: line 1: nnz = {nnz} is more than M*K = {m * k} entries")
    if len(lines) < 2:
        raise SparseFormatError(f"{path}: line 2: expected {m + 1} row offsets, the file ends after line 1 (truncated?)")
    indptr = _parse_ints(lines[1], f"{path}: line 2 (row offsets)", m + 1, np.int64)
    indices_line = lines[2] if len(lines) > 2 else ""
    if len(lines) < 3 and nnz > 0:
        raise SparseFormatError(f"{path}: line 3: expected {nnz} column indices, the file ends after line 2 (truncated?)")
    indices = _parse_ints(indices_line, f"{path}: line 3 (column indices)", nnz, np.int32,
                          hint=f"; column indices must be < K = {k}")
    extra = next((n for n, line in enumerate(lines[3:], start=4) if line.strip(" \t")), None)
    if extra is not None:
        raise SparseFormatError(f"{path}: line {extra}: unexpected content after the three .smtx lines")
    if indptr[-1] != nnz:
        raise SparseFormatError(f"{path}: line 2: the last row offset is {indptr[-1]} but line 1 says nnz = {nnz}")
    return (m, k), indptr, indices


def write_smtx(path: str | Path, shape: tuple[int, int], indptr: np.ndarray, indices: np.ndarray) -> None:
    """Write a pattern as a `.smtx` file; a pattern read_smtx would refuse is refused here, before the file is
    opened (the header's nnz is len(indices): offsets that disagree would make a file no reader can use)."""
    from .csr import validate_csr  # csr imports this module

    indptr = exact_int_array(indptr, "indptr", np.int64)
    indices = exact_int_array(indices, "indices", np.int32, hint="; column indices are int32, K must be < 2**31")
    if isinstance(shape, (str, bytes)) or not np.iterable(shape):
        raise TypeError(f"shape must be a pair of integers (M, K), got {type(shape).__name__} {shape!r}")
    shape = tuple(exact_int_array(list(shape), "shape", np.int64).tolist())
    validate_csr(indptr, indices, np.zeros(indices.shape, dtype=np.float32), shape)
    m, k = shape
    with open(path, "w") as f:
        f.write(f"{m}, {k}, {len(indices)}\n")
        f.write(" ".join(map(str, np.asarray(indptr).tolist())) + "\n")
        f.write(" ".join(map(str, np.asarray(indices).tolist())) + "\n")
