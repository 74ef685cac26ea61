"""torch.library ops, each with a fake (meta) implementation, so torch.compile can trace models that use
sparseforge modules. Eager calls bypass them: the op dispatcher costs more host time than the kernels.

Ops take tensors and integers, not modules: a module registers itself in LAYERS under an id and passes the
id. The registry lives here, below nn/, so nothing here imports a module class (the flow runs one way)."""
from __future__ import annotations

import weakref

import torch

# layer id -> a module with sparse_forward(x); weak, so a dropped module leaves no entry behind
LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@torch.library.custom_op("sparseforge::linear24", mutates_args=())
def linear24(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer_id: int) -> torch.Tensor:
    """SparseLinear24 `layer_id`'s forward: x (..., K) -> (..., M), 2:4 or dense as that layer decided."""
    import torch.nn.functional as F

    if x.device.type != "cuda":
        return F.linear(x, weight, bias)
    layer = LAYERS.get(layer_id)
    if layer is None:
        raise RuntimeError(f"sparseforge::linear24: layer {layer_id} no longer exists")
    return layer.sparse_forward(x)


@linear24.register_fake
def _(x, weight, bias, layer_id):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
