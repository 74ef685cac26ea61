"""Y^T (M x ld, row-major, first n columns used) -> Y (n x M, contiguous): the one copy the 2:4 path pays,
since cuSPARSELt 0.8 on Hopper only runs its fast kernels with a row-major output (see cusparselt.py)."""
from __future__ import annotations

import torch

# Below this many output bytes the copy is a few microseconds either way, and torch's copy launches with
# less host time than a Triton kernel; above it, torch's strided copy runs at ~0.6 TB/s (measured on the
# H200: 790 us for 8192 x 14336 fp16), far from the ~3 TB/s a tiled transpose reaches.
TRITON_MIN_BYTES = 1 << 22


def transpose_columns(src: torch.Tensor, n: int) -> torch.Tensor:
    """src[:, :n].T as a new contiguous (n x M) tensor."""
    rows = src.shape[0]
    if rows * n * src.element_size() < TRITON_MIN_BYTES or not _triton_ok():
        # the slice is one more dispatcher op (~1.5 us of host time): only where padding made one needed
        return (src if n == src.shape[1] else src[:, :n]).t().contiguous()
    dst = torch.empty(n, rows, dtype=src.dtype, device=src.device)
    kernel = _kernel()
    grid = (triton_cdiv(rows, 64), triton_cdiv(n, 64))
    kernel[grid](src, dst, rows, n, src.stride(0), BLOCK_M=64, BLOCK_N=64)
    return dst


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


_state: dict = {}


def _triton_ok() -> bool:
    if "ok" not in _state:
        try:
            import triton  # noqa: F401

            _state["ok"] = True
        except ImportError:
            _state["ok"] = False
    return _state["ok"]


def _kernel():
    if "kernel" not in _state:
        import triton
        import triton.language as tl

        @triton.jit
        def transpose_kernel(src, dst, rows, cols, ld, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
            r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
            c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            inside = (r[:, None] < rows) & (c[None, :] < cols)
            tile = tl.load(src + r[:, None] * ld + c[None, :], mask=inside)
            tl.store(dst + c[None, :] * rows + r[:, None], tile, mask=inside)

        _state["kernel"] = transpose_kernel
    return _state["kernel"]
