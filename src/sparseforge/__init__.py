"""sparseforge: make pruned neural networks run faster on NVIDIA GPUs.

Pipeline: prune -> inspect -> plan -> lower (PTX) -> compile and cache -> launch -> nn modules -> model.

The stages up to lowering (formats, plan, codegen) and the kernels' API need numpy only until a kernel is
built: the names that need torch (pruning, 2:4, nn modules) are imported on first use, so
`import sparseforge.formats` works on a machine without torch.
"""
from importlib import import_module

from ._version import __version__
from .formats import MatrixStats, SparseFormatError, SparseMatrix
from .spmm import compile_gated_mlp, compile_spmm, prebuild_spmm, spmm  # imports torch inside its functions only
from .conv import compile_conv1d, compile_conv2d, prebuild_conv2d  # likewise

# name -> module that defines it (imported when first asked for: these need torch)
_LAZY = {"SparseLinear24": ".nn", "SparseLinear": ".nn", "SparseConv2d": ".nn", "convert": ".nn", "prepare": ".nn",
         "to_sparse24": ".nn", "Sparse24Error": ".semi", "sparsify_24": ".semi", "DecodeLinear": ".nn",
         "save": ".saving", "load": ".saving"}
_SUBMODULES = ("nn", "prune", "semi", "suite")

__all__ = ["DecodeLinear", "MatrixStats", "Sparse24Error", "SparseConv2d", "SparseFormatError", "SparseLinear", "SparseLinear24",
           "SparseMatrix", "__version__", "compile_conv1d", "compile_conv2d", "compile_gated_mlp", "compile_spmm", "convert", "load", "nn", "prebuild_conv2d",
           "prebuild_spmm", "prepare", "prune", "save", "semi", "sparsify_24", "spmm", "suite", "to_sparse24"]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return import_module(f".{name}", __name__)
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'sparseforge' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
