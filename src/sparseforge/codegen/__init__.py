"""Lowering: plan -> kernel source text; render() is pure (no I/O, no GPU) and asks the plan's kernel family
(mappings/registry.py) for its renderer.

Here, shared by every family: ptx.py (KernelSource, the PTX emitter's kernel frames, and the generated
row-group kernels: every nonzero an FMA immediate, row groups, row per block, split K, staged or transposed
X, a convolution over its zero-bordered input through operands.py), emitter.py, operands.py, conv.py (the
direct convolution's csr-columns kernel over an implicit im2col), gemv24.py (the packed 2:4 GEMV). Each
family's own renderer lives in its folder: mappings/csr/render.py (small-N, csr-staged, csr-columns),
mappings/bitmap/render.py, mappings/tc_scatter/render.py; they are re-exported here.
"""
from ..mappings.bitmap.render import render_bitmap
from ..mappings.csr.render import render_csr, render_csr_columns
from ..mappings.registry import plan_family
from ..mappings.tc_scatter.render import render_tc_scatter
from .conv import render_conv
from .ptx import PTX_VERSION, KernelSource
from .ptx import render as render_groups


def render(plan) -> KernelSource:
    """PTX of any plan of a kernel family that generates its own (every family but the split-24 composite)."""
    renderer = plan_family(plan).hook("render")
    if renderer is None:
        raise TypeError(f"a {type(plan).__name__} generates no kernel of its own: it is built from its parts")
    return renderer(plan)


__all__ = ["PTX_VERSION", "KernelSource", "render", "render_bitmap", "render_conv", "render_csr", "render_csr_columns", "render_groups",
           "render_tc_scatter"]
