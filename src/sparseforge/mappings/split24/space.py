"""The split-24 composite's part of the design space (tune/space.py gathers every family's)."""
from __future__ import annotations

from .plan import SPLIT24_DTYPES, Split24Config

SPLIT24_MIN_N = 128  # below this cuSPARSELt measured no faster than cuBLAS (docs/history.md), and the decode
# kernels (tc-scatter, csr, the 2:4 GEMV) are the ones made for those widths


def split24(n: int, layout: str, dtype: str) -> list[Split24Config]:
    """The split-24 composite where it applies: X W^T in 16-bit at large N."""
    return [Split24Config()] if layout == "nk" and dtype in SPLIT24_DTYPES and n >= SPLIT24_MIN_N else []


def split24_candidates(n: int, layout: str, m: int, row_nnz: float, relu: bool, dtype: str,
                       sms: int) -> list[Split24Config]:
    return split24(n, layout, dtype)
