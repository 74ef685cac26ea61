"""torch.library ops, each with a fake (meta) implementation, so torch.compile can trace models that use
sparseforge modules. Eager calls bypass them: the op dispatcher costs more host time than the kernels.

Ops take tensors and integers, not modules: a module registers itself in LAYERS under an id and passes the
id. The registry lives here, below nn/, so nothing here imports a module class (the flow runs one way)."""
from __future__ import annotations

import itertools
import weakref

import torch

# layer id -> a module with sparse_forward(x); weak, so a dropped module leaves no entry behind
LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_next_id = itertools.count()


def register(module) -> int:
    """A new id for `module` in LAYERS: one counter for every module kind, so no two layers ever share one."""
    layer_id = next(_next_id)
    LAYERS[layer_id] = module
    return layer_id


def _layer(op: str, layer_id: int):
    """The module an op's call names, or RuntimeError where it has been dropped."""
    layer = LAYERS.get(layer_id)
    if layer is None:
        raise RuntimeError(f"sparseforge::{op}: layer {layer_id} no longer exists")
    return layer


def conv_memory_format(x: torch.Tensor) -> torch.memory_format:
    """The memory format of a sparse convolution's output for input x, in eager calls and in the fake alike:
    channels_last where x is channels_last-contiguous and not NCHW-contiguous (a tensor that is both, C = 1
    or H = W = 1, counts as NCHW), else contiguous (NCHW)."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


@torch.library.custom_op("sparseforge::linear24", mutates_args=())
def linear24(x: torch.Tensor, anchor: torch.Tensor, bias: torch.Tensor | None, layer_id: int,
             out_features: int) -> torch.Tensor:
    """SparseLinear24 `layer_id`'s forward: x (..., K) -> (..., out_features), 2:4 or dense as that layer
    decided. `anchor`: the layer's empty device anchor, standing for W (which may wait in host memory:
    SparseLinear24.release_dense), so that every tensor the op sees is on the device it runs on."""
    import torch.nn.functional as F

    layer = _layer("linear24", layer_id)
    if x.device.type != "cuda":
        return F.linear(x, layer.dense_weight(), bias)
    return layer.sparse_forward(x)


@linear24.register_fake
def _(x, anchor, bias, layer_id, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("sparseforge::sparse_linear", mutates_args=())
def sparse_linear(x: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, layer_id: int,
                  out_features: int) -> torch.Tensor:
    """SparseLinear `layer_id`'s forward: x (..., K) -> (..., out_features), its sparse kernel or dense as
    that layer decided for the token count. `values`: a tensor on the layer's device standing for W (the
    layer's empty device anchor: W's CSR buffers may be held in host memory; the layer checks W's version
    itself at every call), so that every tensor the op sees is on the device it runs on."""
    layer = _layer("sparse_linear", layer_id)
    return layer.sparse_forward(x)


@sparse_linear.register_fake
def _(x, values, bias, layer_id, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("sparseforge::gated_mlp", mutates_args=())
def gated_mlp(x: torch.Tensor, anchor: torch.Tensor, layer_id: int, out_features: int) -> torch.Tensor:
    """GatedDecodeMLP `layer_id`'s silu(gate(x)) * up(x): x (..., K) -> (..., out_features) by its gated kernel
    (anchor: a tensor on the layer's device standing for the two weights)."""
    layer = _layer("gated_mlp", layer_id)
    return layer.gated_forward(x)


@gated_mlp.register_fake
def _(x, anchor, layer_id, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("sparseforge::sparse_conv2d", mutates_args=())
def sparse_conv2d(x: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, layer_id: int,
                  out_channels: int, out_height: int, out_width: int,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """SparseConv2d `layer_id`'s forward: x (batch, Cin, H, W) [+ residual] -> (batch, out_channels, OH, OW)."""
    layer = _layer("sparse_conv2d", layer_id)
    # the fake's strides are what a compiled graph assumes: the output is made to have them (a no-op where
    # the kernel or cuDNN already wrote that layout)
    return layer.sparse_forward(x, residual).contiguous(memory_format=conv_memory_format(x))


@sparse_conv2d.register_fake
def _(x, values, bias, layer_id, out_channels, out_height, out_width, residual=None):
    return torch.empty((x.shape[0], out_channels, out_height, out_width), dtype=x.dtype, device=x.device,
                       memory_format=conv_memory_format(x))
