"""Sparse weight formats: the CSR SparseMatrix, DLMC .smtx files, save/load."""
from .csr import MatrixStats, SparseMatrix, validate_csr
from .errors import SparseFormatError
from .smtx import read_smtx, write_smtx

__all__ = ["MatrixStats", "SparseFormatError", "SparseMatrix", "read_smtx", "validate_csr", "write_smtx"]
