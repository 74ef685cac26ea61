"""torch modules backed by sparseforge kernels, and whole-model conversion."""
from .. import ops  # noqa: F401  (registers the torch.library ops the modules call under torch.compile)
from .convert import ConversionReport, prepare, to_sparse24
from .linear24 import SparseLinear24

__all__ = ["ConversionReport", "SparseLinear24", "prepare", "to_sparse24"]
