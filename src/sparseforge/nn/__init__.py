"""torch modules backed by sparseforge kernels, and whole-model conversion."""
from .. import ops  # noqa: F401  (registers the torch.library ops the modules call under torch.compile)
from .dense_epilogue import FusedDenseConv2d
from .convert import (ConversionReport, LayerReport, ModelReport, convert, measure_layer, prebuild_layers, prepare,
                      to_sparse24)
from .fold import fold_batchnorms, fold_conv_bn
from .fuse import FuseReport, fuse_epilogues
from .linear24 import SparseLinear24
from .llm import CausalLMReport, DecodeLinear, GatedDecodeMLP, convert_causal_lm, fuse_gated_mlps
from .sparse import ConvEpilogue, SparseConv2d, SparseLinear, SparseShapeError

__all__ = ["CausalLMReport", "ConvEpilogue", "ConversionReport", "DecodeLinear", "FuseReport", "FusedDenseConv2d", "GatedDecodeMLP", "LayerReport", "ModelReport", "SparseConv2d", "SparseLinear", "SparseLinear24",
           "SparseShapeError", "convert", "convert_causal_lm", "fold_batchnorms", "fold_conv_bn", "fuse_epilogues", "fuse_gated_mlps", "measure_layer", "prebuild_layers", "prepare",
           "to_sparse24"]
