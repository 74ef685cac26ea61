"""sparseforge: make pruned neural networks run faster on NVIDIA GPUs.

Pipeline: prune -> inspect -> plan -> lower (PTX) -> compile and cache -> launch -> nn modules -> model.
"""
from . import nn, prune, semi, suite
from ._version import __version__
from .formats import MatrixStats, SparseFormatError, SparseMatrix
from .nn import SparseLinear24, prepare, to_sparse24
from .semi import Sparse24Error, sparsify_24
from .spmm import compile_spmm, spmm

__all__ = ["MatrixStats", "Sparse24Error", "SparseFormatError", "SparseLinear24", "SparseMatrix", "__version__",
           "compile_spmm", "nn", "prepare", "prune", "semi", "sparsify_24", "spmm", "suite", "to_sparse24"]
