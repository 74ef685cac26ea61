"""sparseforge: make pruned neural networks run faster on NVIDIA GPUs.

Pipeline: prune -> inspect -> plan -> lower (PTX) -> compile and cache -> launch -> nn modules -> model.
"""
from . import prune, suite
from .formats import MatrixStats, SparseFormatError, SparseMatrix
from .spmm import compile_spmm, spmm

__version__ = "0.1.0"

__all__ = ["MatrixStats", "SparseFormatError", "SparseMatrix", "__version__", "compile_spmm", "prune", "spmm", "suite"]
