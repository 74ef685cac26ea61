"""Reading and writing DLMC `.smtx` pattern files.

The format (Gale et al., SC 2020) is three text lines:
  1. ``M, K, nnz``
  2. the M+1 CSR row offsets, space separated
  3. the nnz column indices, space separated, sorted within each row
Only the pattern is stored; values come from elsewhere (a seeded normal, see SparseMatrix.from_smtx).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import SparseFormatError


def _parse_ints(text: str, where: str, expected: int) -> np.ndarray:
    fields = text.replace(",", " ").split()
    if len(fields) != expected:
        raise SparseFormatError(f"{where}: expected {expected} integers, found {len(fields)}"
                                + (" (file truncated?)" if len(fields) < expected else ""))
    try:
        return np.array(fields, dtype=np.int64)
    except ValueError:
        bad = next(f for f in fields if not f.lstrip("-").isdigit())
        raise SparseFormatError(f"{where}: {bad!r} is not an integer") from None


def read_smtx(path: str | Path) -> tuple[tuple[int, int], np.ndarray, np.ndarray]:
    """Read a `.smtx` file; returns ((M, K), indptr int64[M+1], indices int32[nnz]).

    Raises SparseFormatError naming the file, the line and what was expected; the caller
    (SparseMatrix) then validates monotone offsets, column range and sorted rows.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise SparseFormatError(f"{path}: not a text file; a .smtx file holds three lines of integers") from None
    lines = text.splitlines()
    if not lines or not lines[0].strip():
        raise SparseFormatError(f"{path}: line 1: expected 'M, K, nnz', found an empty file")
    header = _parse_ints(lines[0], f"{path}: line 1 ('M, K, nnz')", 3)
    m, k, nnz = (int(v) for v in header)
    if m < 1 or k < 1 or nnz < 0:
        raise SparseFormatError(f"{path}: line 1: M and K must be >= 1 and nnz >= 0, found {m}, {k}, {nnz}")
    if len(lines) < 2:
        raise SparseFormatError(f"{path}: line 2: expected {m + 1} row offsets, the file ends after line 1 (truncated?)")
    indptr = _parse_ints(lines[1], f"{path}: line 2 (row offsets)", m + 1)
    indices_line = lines[2] if len(lines) > 2 else ""
    if len(lines) < 3 and nnz > 0:
        raise SparseFormatError(f"{path}: line 3: expected {nnz} column indices, the file ends after line 2 (truncated?)")
    indices = _parse_ints(indices_line, f"{path}: line 3 (column indices)", nnz)
    if any(line.strip() for line in lines[3:]):
        raise SparseFormatError(f"{path}: line 4: unexpected content after the three .smtx lines")
    if indptr[-1] != nnz:
        raise SparseFormatError(f"{path}: line 2: the last row offset is {indptr[-1]} but line 1 says nnz = {nnz}")
    return (m, k), indptr, indices.astype(np.int32)


def write_smtx(path: str | Path, shape: tuple[int, int], indptr: np.ndarray, indices: np.ndarray) -> None:
    m, k = shape
    with open(path, "w") as f:
        f.write(f"{m}, {k}, {len(indices)}\n")
        f.write(" ".join(map(str, np.asarray(indptr).tolist())) + "\n")
        f.write(" ".join(map(str, np.asarray(indices).tolist())) + "\n")
