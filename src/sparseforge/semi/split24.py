"""The split-24 composite (the tensor-core path for large N), its runtime: an unstructured W split as
W24 + R (mappings/split24/plan.py Split24Plan) runs as Y = X W24^T on Sparse Tensor Cores through the one 2:4 runtime
(semi/cusparselt.py: compressed once, the algorithm searched for this width), which leaves D = Y^T (M x N,
row-major: cuSPARSELt runs no column-major output on sm_90); R's product is added into D in place by R's own
SpMM kernel in the "kn" orientation (D += R X^T, X^T one transposed copy of X), and D is copied into X's layout
(semi/transpose.py, as SparseLinear24 does). Layout "nk" (X: N x K -> Y: N x M), float16 / bfloat16, any N
(cuSPARSELt's refusals of a width are padded away, as for 2:4 layers).

Why R runs on D and not on Y: in the "nk" orientation at large N only the small-N CSR kernel adds a residual,
and it read X and wrote Y with a stride per token: 1.5 ms against cuBLAS's 83 us at 4096 x 4096, N = 2048
(H200). On D the csr-columns kernel reads rows of X^T and D whole (coalesced).

A magnitude-pruned W at 90% keeps 99.6% of its 4-groups within 2:4 (about 1% of its nonzeros go to R), so the
composite costs the 2:4 product (1.2-1.5x faster than cuBLAS at N >= 2048, docs/history.md) plus X's transposed
copy and one pass over D. At 70% R holds ~8% of the nonzeros and its CUDA-core product costs more than the
tensor cores save; the chooser measures.
"""
from __future__ import annotations

import time

import torch

from ..runtime.kernel import check_tensor, kernel_copies, release_copies
from .cusparselt import CompressedWeight, MatmulPlan, Sparse24Error
from .runtime import padded_input
from .transpose import transpose_columns


class Split24Kernel:
    """k(X) -> Y = X W^T (+ bias) for X (N x K) of the plan's dtype on the kernel's device; k(X, out=Y) writes
    into Y (N x M, contiguous). Attributes as an SpmmKernel's: plan, mapping ("split-24"), choice,
    compile_seconds (R's kernel's build), load_seconds (compression, the cuSPARSELt search), weight_bytes.
    Keep the kernel alive as long as a CUDA graph that replays it (it owns the compressed W and R's kernel)."""

    mapping = "split-24"
    layout = "nk"

    @property
    def config(self):
        """The split-24 config the kernel was built from (as an SpmmKernel's config)."""
        return self.plan.config
    takes_rows_unchecked = False  # nn.SparseLinear's lean path hands rows to SpmmKernels only

    def __init__(self, plan, device_index: int, tune_budget: float | None = 1.0, residual_kernel=None,
                 compile_residual=None):
        """residual_kernel: R's kernel, where one is already built (with_own_weights shares the choice);
        compile_residual: else how to build it (compile_spmm's signature: the SpMM API passes itself, so this
        2:4 stage imports nothing from the API above it)."""
        start = time.perf_counter()
        self.plan, self.device_index = plan, device_index
        self._device = torch.device("cuda", device_index)
        self._dtype = getattr(torch, plan.dtype)
        self.choice, self.tuning, self.tune_seconds = None, [], 0.0
        part = torch.from_numpy(plan.split.part24.to_dense()).to(self._device, self._dtype)
        self.compressed = CompressedWeight(part)  # checks the 2:4 structure and the shape once more
        del part
        self._bias = None if plan.bias is None else torch.tensor(plan.bias, dtype=self._dtype, device=self._device)
        self.matmul = MatmulPlan(self.compressed, plan.N, self._bias)
        generator = torch.Generator(device=self._device).manual_seed(0)
        probe = torch.randn(self.matmul.padded_n, plan.K, device=self._device, generator=generator).to(self._dtype)
        self.matmul.search(probe, torch.empty(plan.M, self.matmul.padded_n, dtype=self._dtype, device=self._device))
        if residual_kernel is None and plan.split.residual.nnz:
            if compile_residual is None:
                raise ValueError("a split-24 plan with a residual needs compile_residual (or residual_kernel) to "
                                 "build R's kernel: build it through compile_spmm(..., config=Split24Config())")
            # D (M x padded N) += R X^T: R's kernel in the "kn" orientation over X^T (K x padded N)
            residual_kernel = compile_residual(plan.split.residual, self.matmul.padded_n, plan.dtype, "kn",
                                           device=self._device, tune_budget=tune_budget, time_dense=False,
                                           residual=True)
        self.residual_kernel = residual_kernel
        self.compile_seconds = 0.0 if residual_kernel is None else residual_kernel.compile_seconds
        self.cache_hit = residual_kernel is None or residual_kernel.cache_hit
        self.load_seconds = time.perf_counter() - start - self.compile_seconds

    # -- what callers of SpmmKernel read ----------------------------------------------------------------
    @property
    def in_shape(self) -> tuple[int, int]:
        return self.plan.N, self.plan.K

    @property
    def out_shape(self) -> tuple[int, int]:
        return self.plan.N, self.plan.M

    @property
    def dense_faster(self) -> bool | None:
        return None if self.choice is None or self.choice.dense_us is None else self.choice.dense_faster

    @property
    def weight_bytes(self) -> int:
        return self.compressed.nbytes + (0 if self.residual_kernel is None else self.residual_kernel.weight_bytes)

    @property
    def registers(self) -> int:
        """R's kernel's registers (cuSPARSELt's kernels are the library's): 0 where R is empty."""
        return 0 if self.residual_kernel is None else self.residual_kernel.registers

    @property
    def source(self) -> str:
        head = (f"// split-24: {self.plan.split.part24.nnz} nonzeros on Sparse Tensor Cores (cuSPARSELt), "
                f"{self.plan.split.residual.nnz} in R")
        return head if self.residual_kernel is None else head + "\n" + self.residual_kernel.source

    def with_own_weights(self, cubin: bytes | None = None) -> "Split24Kernel":
        """The same composite over fresh device copies of its weights (bench's rotating-weights protocol); R's
        kernel copied as runtime.kernel.kernel_copies copies one (a load of its cubin where W is its code;
        `cubin` is the composite's caller's and not R's, so it is not used)."""
        residual = None if self.residual_kernel is None else kernel_copies(self.residual_kernel, 1)[0]
        twin = Split24Kernel(self.plan, self.device_index, residual_kernel=residual)
        twin.choice, twin.tuning = self.choice, self.tuning
        return twin

    def release(self) -> None:
        """Unload what with_own_weights loaded for R's copy (runtime.kernel.release_copies)."""
        if self.residual_kernel is not None:
            release_copies([self.residual_kernel])

    @property
    def code_bytes(self) -> int:
        """R's kernel's code where W is its code (what a copy streams besides the arrays)."""
        return 0 if self.residual_kernel is None else self.residual_kernel.code_bytes

    # -- the call ---------------------------------------------------------------------------------------
    def __call__(self, b, out=None, residual=None):
        if residual is not None:
            raise ValueError("the split-24 kernel adds no residual: add it after the call, or compile with "
                             "residual=True (the chooser then takes a kernel that adds one)")
        self._check(b, "X", self.in_shape)
        if out is not None:
            self._check(out, "out", self.out_shape)
            start, first = out.data_ptr(), b.data_ptr()
            if start < first + b.numel() * b.element_size() and first < start + out.numel() * out.element_size():
                raise ValueError("out shares memory with X: pass an out of its own, or omit out")
        x = b if b.data_ptr() % 16 == 0 else b.clone()  # cuSPARSELt wants 16-byte aligned operands
        padded = padded_input(self.matmul, x)
        product = torch.empty(self.plan.M, self.matmul.padded_n, dtype=self._dtype, device=self._device)
        self.matmul.run(padded, product)
        if self.residual_kernel is not None:  # D += R X^T in place, on cuSPARSELt's M x N output
            self.residual_kernel(transpose_columns(padded, self.plan.K), out=product, residual=product)
        y = transpose_columns(product, self.plan.N)
        if out is None:
            return y
        out.copy_(y)
        return out

    def _check(self, t, what: str, shape: tuple[int, int]) -> None:
        check_tensor(t, what, self._device, self._dtype)
        if t.dim() != 2 or tuple(t.shape) != shape:
            names = "N x K" if what == "X" else "N x M"
            raise ValueError(f"{what} has shape {tuple(t.shape)}; the split-24 kernel takes a 2-D {names} = "
                             f"{shape[0]} x {shape[1]} tensor (N is fixed when the kernel is built)")
        if not t.is_contiguous():
            raise ValueError(f"{what} is not contiguous (strides {t.stride()}): call {what}.contiguous() first")

    def __repr__(self) -> str:
        return (f"Split24Kernel({self.plan.name}, {self.plan.split.part24.nnz} nonzeros 2:4, "
                f"{self.plan.split.residual.nnz} in R)")


def build_split24_kernel(plan, device_index: int, tune_budget: float | None = 1.0,
                         compile_residual=None) -> Split24Kernel:
    """The composite for a Split24Plan; cuSPARSELt's refusals come as Sparse24Error (a ValueError).
    compile_residual: builds R's SpMM kernel (compile_spmm)."""
    return Split24Kernel(plan, device_index, tune_budget, compile_residual=compile_residual)


__all__ = ["Split24Kernel", "Sparse24Error", "build_split24_kernel"]
