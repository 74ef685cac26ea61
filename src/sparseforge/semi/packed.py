"""sparseforge's own 2:4 storage for the CUDA-core GEMV (decode widths): the two kept values of every group
of 4 input columns, and their positions in 2 bits each. 0.5625x the bytes of the dense 16-bit weight.

values: (M, K/2), the weight's dtype; group g's kept values at [2g, 2g+1], in position order.
meta:   (M, K/16) int16; chunk c (16 columns = groups 4c..4c+3) holds group 4c+j's positions in bits
        4j..4j+1 (first) and 4j+2..4j+3 (second). Groups with fewer than 2 nonzeros keep zeros.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cusparselt import check_weight


@dataclass(frozen=True)
class Packed24:
    values: torch.Tensor
    meta: torch.Tensor
    rows: int
    cols: int

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.meta.numel() * 2


def pack_24(weight: torch.Tensor) -> Packed24:
    """Pack a 2:4 weight (M x K, float16/bfloat16, K a multiple of 16) on its own device."""
    check_weight(weight, rows_multiple=1)
    rows, cols = weight.shape
    groups = weight.detach().reshape(rows, cols // 4, 4)
    order = torch.arange(4, device=weight.device)
    # nonzeros first, lower positions first among equals: groups with < 2 nonzeros still get 2 slots
    key = (groups != 0).to(torch.int32) * 8 - order
    positions = key.topk(2, dim=2).indices.sort(dim=2).values
    values = groups.gather(2, positions).reshape(rows, cols // 2).contiguous()
    codes = (positions[..., 0] | (positions[..., 1] << 2)).to(torch.int32).reshape(rows, cols // 16, 4)
    shifts = torch.tensor([0, 4, 8, 12], dtype=torch.int32, device=weight.device)
    meta = (codes << shifts).sum(dim=2)
    meta = torch.where(meta >= 1 << 15, meta - (1 << 16), meta).to(torch.int16).contiguous()
    return Packed24(values, meta, rows, cols)


def unpack_24(packed: Packed24) -> torch.Tensor:
    """The dense weight back (the reference for the kernel: what it must compute with)."""
    rows, cols = packed.rows, packed.cols
    meta = packed.meta.to(torch.int32) & 0xFFFF
    shifts = torch.tensor([0, 4, 8, 12], dtype=torch.int32, device=meta.device)
    codes = (meta.unsqueeze(-1) >> shifts) & 0xF                       # (M, K/16, 4)
    positions = torch.stack([codes & 3, codes >> 2], dim=-1).reshape(rows, cols // 4, 2).long()
    dense = torch.zeros(rows, cols // 4, 4, dtype=packed.values.dtype, device=packed.values.device)
    dense.scatter_(2, positions, packed.values.reshape(rows, cols // 4, 2))
    return dense.reshape(rows, cols)

