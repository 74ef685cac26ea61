"""The bitmap decode family's part of the design space (tune/space.py gathers every family's)."""
from __future__ import annotations

from .plan import BitmapConfig


def decode(n: int, layout: str) -> list[BitmapConfig]:
    """Bitmap decode configs (N = 1): 4 or 8 warps a block, 2 or 4 rows a warp, 2 or 4 set bits in flight."""
    if n != 1:
        return []
    return [BitmapConfig(warps_per_block=w, rows_per_warp=r, unroll=u) for w, r, u in
            ((4, 2, 2), (4, 4, 2), (4, 2, 4), (8, 2, 2))]


def bitmap_candidates(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str,
                      sms: int) -> list[BitmapConfig]:
    return decode(n, layout)
