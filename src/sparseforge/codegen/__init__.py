"""Lowering: Plan -> kernel source text. One module per target; render() is pure (no I/O, no GPU)."""
from .ptx import PTX_VERSION, KernelSource, render

__all__ = ["PTX_VERSION", "KernelSource", "render"]
