"""The packed 2:4 GEMV (codegen/gemv24.py) as a callable: Y (n x M) = X (n x K) @ W^T [+ bias] for decode
widths n <= 16, one launch and no transpose. Compiled once per (dtype, n, bias) through the kernel cache.

Measured on the H200 at N = 1 (bench24, dfaac08): 1.5-2.2x faster than cuBLAS under graph replay and
1.1-1.6x called eagerly, on BERT and Llama shapes in fp16 and bf16, where cuSPARSELt lost to dense. With W
streamed from HBM (an H100, benchmarks/gemv24_sets.py, the two-set kernel): 1.71-1.81x at N = 1 on the four
Llama-3-8B shapes (the byte bound is 1.78x), 1.40-1.66x at 2, 1.07-1.39x at 4, 0.6-0.96x at 8. So the
2:4 runtime times it next to cuSPARSELt for widths n <= DECISION_MAX_N (USE_IN_DECISIONS). n = 9-16 runs
correctly on the H200 (tests/gpu, n = 12 and 16, e1a6cad) but at n = 16 measured 0.20-0.75x of cuBLAS on
all 14 shape x dtype cases (bench24, 8d1233c: 4096x4096 fp16 42.6 us against 9.7 us, 7.7x its N = 1 time
for the same weight bytes; not profiled: at 130-142 registers a warp per row leaves few warps per SM), so
timing it there would only lengthen each decision.
"""
from __future__ import annotations

import copy

import torch

from ..codegen.gemv24 import (MAX_N, MAX_UNROLL, UNPACK_NAME, UNPACK_THREADS, WARPS, default_unroll, kernel_name,
                              render_gemv24, render_unpack24)
from ..dtypes import dtype_name
from ..runtime.streams import current_stream_handle
from .cusparselt import Sparse24Error
from .packed import Packed24, pack_24

USE_IN_DECISIONS = True
DECISION_MAX_N = 8


class Gemv24:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, unroll: int | None = None):
        """`unroll`: chunks a register set of the kernel (codegen/gemv24.py default_unroll of each width unless
        given: a benchmark's variants)."""
        if unroll is not None and not (isinstance(unroll, int) and 1 <= unroll <= MAX_UNROLL):
            raise Sparse24Error(f"unroll is the chunks a register set of the kernel holds, 1..{MAX_UNROLL} (or None: "
                                f"the default for each width); got {unroll!r}")
        if weight.device.type != "cuda":
            raise Sparse24Error(f"weight is on {weight.device}; the 2:4 GEMV runs on a CUDA device")
        self.packed = pack_24(weight)
        self.bias, self.dtype, self.device, self.unroll = bias, weight.dtype, weight.device, unroll
        self.index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
        self._kernels: dict[int, object] = {}
        self._launches: dict[int, object] = {}  # n -> runtime.launch.PackedLaunch
        self._unpack = None  # the dense writer's launch (densify), its W pointers fixed

    def kernel(self, n: int):
        """The loaded kernel for n inputs (compiled, or taken from the disk cache, on first use)."""
        if n not in self._kernels:
            dtype, bias = dtype_name(self.dtype), self.bias is not None
            unroll = default_unroll(n) if self.unroll is None else self.unroll
            self._kernels[n] = self._load("gemv24", f"{dtype}|{n}|{bias}|{unroll}", kernel_name(dtype, n, bias, unroll),
                                          lambda arch: render_gemv24(dtype, n, bias, arch, unroll))
        return self._kernels[n]

    def _load(self, kind: str, spec: str, name: str, render):
        from ..runtime.compiler import default_compiler
        from ..runtime.kernel import compile_source, kernel_key, load_kernel

        major, minor = torch.cuda.get_device_capability(self.index)
        arch, compiler = major * 10 + minor, default_compiler()
        built = compile_source(kernel_key(kind, spec, arch, compiler.version), arch, lambda: render(arch),
                               compiler=compiler)
        return load_kernel(built.cubin, name, self.index)

    def densify(self, out: torch.Tensor) -> torch.Tensor:
        """W dense into `out` (M x K, contiguous, 16-byte aligned, the weight's dtype and device) from the packed
        arrays: every element written, the kept values bit for bit (codegen/gemv24.py render_unpack24: one launch on
        the current stream, no host sync, reads 0.5625x and writes 1x W's bytes). Returns `out`."""
        m, k = self.packed.rows, self.packed.cols
        if tuple(out.shape) != (m, k) or out.dtype != self.dtype or out.device != self.device or \
                not out.is_contiguous() or out.data_ptr() % 16:  # 16-byte stores
            raise Sparse24Error(f"densify writes a contiguous, 16-byte aligned {m} x {k} {self.dtype} tensor on "
                                f"{self.device}; got {tuple(out.shape)} {out.dtype} on {out.device}"
                                f"{'' if out.is_contiguous() else ', not contiguous'}"
                                f"{', misaligned' if out.data_ptr() % 16 else ''}")
        launch = self._unpack
        if launch is None:
            launch = self._load("unpack24", "b16", UNPACK_NAME, render_unpack24).packed(UNPACK_THREADS, 4)
            for index, value in ((0, self.packed.values.data_ptr()), (1, self.packed.meta.data_ptr()),
                                 (3, m * k // 16)):
                launch.fix(index, value)
            self._unpack = launch
        chunks = m * k // 16
        launch((-(-chunks // UNPACK_THREADS), 1, 1), current_stream_handle(self.index), out.data_ptr(), first=2)
        return out

    def with_copy_of_w(self) -> "Gemv24":
        """The same GEMV reading its own copy of the packed W (the compiled kernels shared): what a timing
        loop rotates through HBM."""
        twin = copy.copy(self)
        twin.packed = Packed24(self.packed.values.clone(), self.packed.meta.clone(), self.packed.rows,
                               self.packed.cols)
        twin._launches, twin._unpack = {}, None  # their fixed parameters point at this copy's arrays
        return twin

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: (n, K) contiguous, n <= MAX_N, the weight's dtype and device, 16-byte aligned."""
        n, k = x.shape
        if not 1 <= n <= MAX_N or k != self.packed.cols:
            raise Sparse24Error(f"the 2:4 GEMV takes (n <= {MAX_N}, {self.packed.cols}) inputs, got {tuple(x.shape)}")
        m = self.packed.rows
        out = torch.empty(n, m, dtype=self.dtype, device=self.device) if out is None else out
        launch = self._launches.get(n)
        if launch is None:
            # parameters (values, meta, x, out, bias, m, k): all but x and out fixed once; the two u32 ones
            # read the low half of their 64-bit slot (x86 and the GPU are little-endian)
            launch = self.kernel(n).packed(WARPS * 32, 7)
            for index, value in ((0, self.packed.values.data_ptr()), (1, self.packed.meta.data_ptr()),
                                 (4, 0 if self.bias is None else self.bias.data_ptr()), (5, m), (6, k)):
                launch.fix(index, value)
            self._launches[n] = launch  # published once whole: another thread never sees it half fixed
        launch((-(-m // WARPS), 1, 1), current_stream_handle(self.index), x.data_ptr(), out.data_ptr(), first=2)
        return out
