"""DeviceCsr: W in CSR as torch tensors on the device that computes, for packing kernels' arrays there.

A SparseMatrix lives in host memory, and building one, then a kernel's padded arrays from it, then uploading
them, costs host work per nonzero: seconds for each of a Llama-3-8B layer's 218 million weights. Where a
kernel family can pack its arrays with torch ops (mappings.registry: device_plan), a layer hands it a
DeviceCsr of the CSR it already holds on the GPU, and no nonzero crosses to the host.

The checks are SparseMatrix's, run as reductions on the device (a few host syncs, no copy of W): a weight
that SparseMatrix refuses is refused here too, with the same words.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..dtypes import dtype_name
from .errors import SparseFormatError
from .exact import INDEX_LIMIT


@dataclass(frozen=True, eq=False)
class DeviceCsr:
    """W (M x K) as CSR on one torch device: indptr int64 [M + 1], indices int32 [nnz] (strictly increasing
    within a row), values [nnz] (finite, in the dtype `dtype` names: float32, float16 or bfloat16)."""
    indptr: object
    indices: object
    values: object
    shape: tuple[int, int]
    dtype: str
    # what families packed from this matrix (packed()): a layer's kernels at several widths share one copy
    _packed: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        import torch

        if len(self.shape) != 2 or any(not isinstance(d, int) or d < 1 or d >= INDEX_LIMIT for d in self.shape):
            raise SparseFormatError(f"shape must be two integers in [1, 2**31), got {self.shape!r}")
        m, k = self.shape
        tensors = {"indptr": self.indptr, "indices": self.indices, "values": self.values}
        for what, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise SparseFormatError(f"{what} must be a 1-D torch tensor, got {type(t).__name__}"
                                        f"{'' if not isinstance(t, torch.Tensor) else f' of shape {tuple(t.shape)}'}")
        if len({t.device for t in tensors.values()}) != 1:
            raise SparseFormatError(f"indptr, indices and values must be on one device, got "
                                    f"{[str(t.device) for t in tensors.values()]}")
        if self.indptr.dtype != torch.int64 or self.indices.dtype != torch.int32:
            raise SparseFormatError(f"indptr must be int64 and indices int32, got {self.indptr.dtype} and "
                                    f"{self.indices.dtype}")
        if dtype_name(self.values.dtype) != self.dtype or self.dtype not in ("float32", "float16", "bfloat16"):
            raise SparseFormatError(f"values are {self.values.dtype}, the matrix says {self.dtype}: float32, "
                                    "float16 or bfloat16 values in the named dtype")
        if self.indptr.numel() != m + 1:
            raise SparseFormatError(f"indptr must have M+1 = {m + 1} entries, found {self.indptr.numel()}")
        nnz = self.indices.numel()
        if self.values.numel() != nnz:
            raise SparseFormatError(f"{nnz} column indices but {self.values.numel()} values")
        first, last = (int(v) for v in self.indptr[[0, -1]].tolist())
        if first != 0 or last != nnz:
            raise SparseFormatError(f"indptr runs from {first} to {last}; a CSR of {nnz} nonzeros runs from 0 "
                                    f"to {nnz}")
        self._check_entries(m, k, nnz)

    def _check_entries(self, m: int, k: int, nnz: int) -> None:
        import torch

        steps = torch.diff(self.indptr)
        if bool((steps < 0).any()):
            row = int(torch.nonzero(steps < 0)[0])
            raise SparseFormatError(f"indptr is not monotone: row {row} ends before it starts")
        if not nnz:
            return
        bad = (self.indices < 0) | (self.indices >= k)
        if bool(bad.any()):
            pos = int(torch.nonzero(bad)[0])
            raise SparseFormatError(f"row {self._row_of(pos)}: column index {int(self.indices[pos])} is out of "
                                    f"range [0, {k})")
        if nnz > 1:
            within_row = torch.ones(nnz - 1, dtype=torch.bool, device=self.indices.device)
            starts = self.indptr[1:-1]
            within_row[starts[(starts > 0) & (starts < nnz)] - 1] = False
            order = torch.diff(self.indices.long())
            bad = within_row & (order <= 0)
            if bool(bad.any()):
                pos = int(torch.nonzero(bad)[0])
                what = "duplicate" if int(order[pos]) == 0 else "unsorted"
                raise SparseFormatError(f"row {self._row_of(pos)}: {what} column indices ({int(self.indices[pos])}"
                                        f" then {int(self.indices[pos + 1])}); columns must be strictly increasing "
                                        "within a row")
        finite = torch.isfinite(self.values)
        if not bool(finite.all()):
            pos = int(torch.nonzero(~finite)[0])
            raise SparseFormatError(f"row {self._row_of(pos)}, column {int(self.indices[pos])}: value "
                                    f"{float(self.values[pos])} is not finite; NaN/inf weights would poison every "
                                    "output that uses them, fix the weights first")

    def _row_of(self, position: int) -> int:
        import torch

        return int(torch.searchsorted(self.indptr, position, right=True)) - 1

    @property
    def device(self):
        return self.values.device

    @property
    def nnz(self) -> int:
        return int(self.indices.numel())

    @property
    def density(self) -> float:
        return self.nnz / (self.shape[0] * self.shape[1])

    def row_nnz(self):
        """Nonzeros per row (int64, on the device)."""
        import torch

        return torch.diff(self.indptr)

    def astype(self, dtype) -> "DeviceCsr":
        """The same pattern with values rounded to `dtype` (on the device); itself where nothing changes."""
        import torch

        name = dtype_name(dtype)
        if name == self.dtype:
            return self
        return DeviceCsr(self.indptr, self.indices, self.values.to(getattr(torch, name)), self.shape, name)

    def packed(self, key: tuple, pack):
        """pack() once per key for this matrix (a family's device arrays, keyed by what shapes them): the
        kernels one layer builds at several widths then read one copy of W, not one each."""
        if key not in self._packed:
            self._packed[key] = pack()
        return self._packed[key]

    def to_host(self):
        """The same matrix as a host SparseMatrix (what every family without a device packer takes), made once
        (its digest with it: spmm() keys its kernels by it)."""
        from .csr import SparseMatrix

        def copy():
            values = self.values.detach().float().cpu().numpy()
            return SparseMatrix(self.indptr.cpu().numpy(), self.indices.cpu().numpy(), values, self.shape,
                                self.dtype, validate=False)  # checked on the device at construction

        return self.packed(("host",), copy)

    def __repr__(self) -> str:
        return (f"DeviceCsr(shape={self.shape}, nnz={self.nnz}, density={self.density:.4f}, dtype={self.dtype}, "
                f"device={self.device})")
