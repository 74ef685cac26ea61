"""Lowering: plan -> kernel source text. One module per target; render() is pure (no I/O, no GPU).

ptx.py: the generated row-group kernels (every nonzero an FMA immediate: row groups, row per block, split
K, staged or transposed X; a convolution over its zero-bordered input through operands.py); csr.py: the kernels over padded CSR (W as data: the small-N kernel, lanes over
nonzeros, and csr-columns, lanes across N); bitmap.py: the decode kernel over a bitmap + packed values; tc_scatter.py: the tensor-core kernel over
entries scattered into dense tiles (half precision, small N); conv.py: the direct sparse convolution
(csr-columns over an implicit im2col);
gemv24.py: the packed
2:4 GEMV. render(plan) asks the plan's kernel family (mappings/registry.py) for its renderer.
"""
from ..mappings.registry import plan_family
from ..mappings.bitmap.render import render_bitmap
from .conv import render_conv
from ..mappings.csr.render import render_csr, render_csr_columns
from .ptx import PTX_VERSION, KernelSource
from .ptx import render as render_groups
from ..mappings.tc_scatter.render import render_tc_scatter


def render(plan) -> KernelSource:
    """PTX of any plan of a kernel family that generates its own (every family but the split-24 composite)."""
    renderer = plan_family(plan).hook("render")
    if renderer is None:
        raise TypeError(f"a {type(plan).__name__} generates no kernel of its own: it is built from its parts")
    return renderer(plan)


__all__ = ["PTX_VERSION", "KernelSource", "render", "render_bitmap", "render_conv", "render_csr", "render_csr_columns", "render_groups",
           "render_tc_scatter"]
