"""The epilogue of a convolution the conversion kept dense: cuDNN's fused convolution + bias (+ residual) + ReLU.

A converted model keeps some convolutions dense (cuDNN's tensor cores win on ResNet-50's fp16 1x1 layers), and
each of those still launches its ReLU, and its shortcut add, as kernels of their own: at batch 1 in fp16 these
launches, ~2-3 us each, are a sixth of the whole converted ResNet-50. cuDNN computes relu(conv(x) + z + bias) in
one call (torch.cudnn_convolution_relu / torch.cudnn_convolution_add_relu, inference only); whether that is
faster than the separate ops depends on the layer and the cuDNN engines it finds, so fuse_epilogues measures
both under CUDA-graph replay (measure_fused_dense) and keeps the fused call only where it won.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedDenseConv2d(nn.Module):
    """A dense nn.Conv2d with the ReLU (and residual add) that followed it in the model:
    y = relu(conv(x) + residual) (residual=True: forward(x, residual=r)) or relu(conv(x)).
    cudnn_fused: on CUDA, outside autograd and torch.compile, one cuDNN call computes it (fuse_epilogues sets
    this where the call measured faster); otherwise, and always on the CPU, the separate ops run."""

    def __init__(self, conv: nn.Conv2d, residual: bool, cudnn_fused: bool = False):
        super().__init__()
        if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ValueError(f"cuDNN's fused convolution takes explicit zero padding; this Conv2d has "
                             f"padding={conv.padding!r}, padding_mode={conv.padding_mode!r}")
        self.conv, self.residual, self.cudnn_fused = conv, bool(residual), bool(cudnn_fused)

    def extra_repr(self) -> str:
        return f"residual={self.residual}, relu=True, cudnn_fused={self.cudnn_fused}"

    def _fused_call(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """cuDNN's call: inference only (it has no backward), not under autocast (which would cast the
        separate ops), and not while torch.compile traces (Inductor fuses the separate ops itself)."""
        w, b = self.conv.weight, self.conv.bias
        grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, b, residual))
        return (self.cudnn_fused and x.is_cuda and x.dtype == w.dtype and not grads
                and not torch.is_autocast_enabled("cuda") and not torch.compiler.is_compiling()
                and (residual is None or (residual.dtype == x.dtype and residual.is_cuda)))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.residual != (residual is not None):
            raise ValueError("this convolution adds a residual: call it as layer(x, residual=r)" if self.residual
                             else "this convolution adds no residual: call it as layer(x)")
        if self._fused_call(x, residual):
            c = self.conv  # (the ops pick the memory format from the input and weight, as F.conv2d does)
            args = (list(c.stride), list(c.padding), list(c.dilation), c.groups)
            if residual is None:
                return torch.cudnn_convolution_relu(x, c.weight, c.bias, *args)
            return torch.cudnn_convolution_add_relu(x, c.weight, residual, 1.0, c.bias, *args)
        y = self.conv(x)
        return F.relu(y + residual if residual is not None else y)


def measure_fused_dense(layer: FusedDenseConv2d, input_shape: tuple, output_shape: tuple) -> tuple[float, float]:
    """(microseconds of the separate ops, of cuDNN's fused call) for `layer` on fresh random inputs of these
    shapes, by CUDA-graph replay; the fused call's output is checked against the separate ops' first (a
    RuntimeError names a mismatch). Raises RuntimeError where cuDNN has no fused engine for the layer."""
    from ..runtime.timing import graph_time_us

    w = layer.conv.weight
    generator = torch.Generator(device="cpu").manual_seed(0)
    draws = [(torch.randn(input_shape, generator=generator).to(w.device, w.dtype),
              torch.randn(output_shape, generator=generator).to(w.device, w.dtype) if layer.residual else None)
             for _ in range(3)]
    saved = layer.cudnn_fused
    try:
        with torch.no_grad():
            layer.cudnn_fused = False
            want = layer(*draws[0])
            separate = graph_time_us(lambda d: layer(*d), draws)
            layer.cudnn_fused = True
            got = layer(*draws[0])
            error = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
            if not error <= (1e-2 if w.element_size() <= 2 else 1e-4):
                raise RuntimeError(f"cuDNN's fused convolution differs from the separate ops by {error:.1e}")
            fused = graph_time_us(lambda d: layer(*d), draws)
    finally:
        layer.cudnn_fused = saved
    return separate, fused
