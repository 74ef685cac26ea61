"""cuSPARSELt through NVIDIA's nvmath-python bindings, kept lean for the per-call path.

A 2:4 weight W (M x K, row-major, float16/bfloat16) is compressed once. For each input width N a
`MatmulPlan` is built once (descriptors, algorithm chosen by cusparseLtMatmulSearch, workspace), after which a
call is one cusparseLtMatmul on torch's current stream: no descriptor, plan or allocation per call, which
is what costs torch's semi-structured path 450-800 us a call on Hopper.

Operand layout, the one PyTorch's own cuSPARSELt path uses: A = W (row-major M x K), B = X^T (X is N x K
row-major, i.e. K x N column-major, read in place), D = Y^T (M x N row-major); `runtime` transposes D into
Y. Measured on an H200 with cuSPARSELt 0.8.0 (benchmarks/probe_cusparselt.py): with D column-major (Y in
place) or with the sparse operand as B, every algorithm but the default one dies with an illegal instruction
and cusparseLtMatmulSearch fails (status 7), and the default one runs 2x slower than the searched
row-major kernels; with D row-major all 27 algorithms run and the search works.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from ..runtime.streams import current_stream_handle

# cuSPARSELt wants 16-byte aligned operands, and a 16-bit structured operand whose rows and columns are
# multiples of 16 (the constraint PyTorch's own cuSPARSELt wrapper enforces for float16/bfloat16).
ALIGN_BYTES = 16
DIM_MULTIPLE = 16
# N is tried as is first; where cuSPARSELt refuses it, the input is padded to a multiple of these.
N_PAD_CANDIDATES = (8, 16, 32)
SEARCH_ITERATIONS = 10
SEARCH_WORKSPACE_BYTES = 64 << 20

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


class Sparse24Error(ValueError):
    """A weight, input or device that the 2:4 Sparse Tensor Core path cannot take; the message says why."""


def bindings():
    """nvmath.bindings.cusparseLt, with an error naming the fix when it (or the library) is missing."""
    try:
        from nvmath.bindings import cusparseLt
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise Sparse24Error("2:4 on Sparse Tensor Cores needs NVIDIA's cuSPARSELt bindings: "
                            "pip install nvmath-python nvidia-cusparselt-cu13 (cu12 for CUDA 12)") from exc
    return cusparseLt


def _value_type(dtype: torch.dtype) -> int:
    import nvmath

    return int({torch.float16: nvmath.CudaDataType.CUDA_R_16F,
                torch.bfloat16: nvmath.CudaDataType.CUDA_R_16BF}[dtype])


def check_weight(weight: torch.Tensor, name: str = "weight", rows_multiple: int = DIM_MULTIPLE) -> None:
    """Raise Sparse24Error unless `weight` (M x K) can be compressed for Sparse Tensor Cores (or, with
    rows_multiple=1, packed for the 2:4 GEMV, which takes any M). Pure torch: runs on any device."""
    from ..prune.nm import check_nm

    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise Sparse24Error(f"{name}: need a 2-D (out_features x in_features) tensor, got "
                            f"{getattr(weight, 'shape', type(weight).__name__)}")
    if weight.dtype not in SUPPORTED_DTYPES:
        raise Sparse24Error(f"{name}: dtype {weight.dtype}; Sparse Tensor Cores take float16 or bfloat16 here: "
                            "convert the layer first (model.half() or model.to(torch.bfloat16))")
    rows, cols = weight.shape
    if rows % rows_multiple or cols % DIM_MULTIPLE:
        need = "both dimensions" if rows_multiple == DIM_MULTIPLE else "in_features"
        raise Sparse24Error(f"{name}: shape {rows} x {cols}; 2:4 on 16-bit types needs {need} to be multiples "
                            f"of {DIM_MULTIPLE}. The layer stays dense")
    if not torch.isfinite(weight).all():
        raise Sparse24Error(f"{name}: holds NaN or inf values; fix the weights before compressing them")
    try:
        check_nm(weight, 2, 4, name=name)
    except ValueError as exc:
        raise Sparse24Error(f"{exc}. Prune it first: sparseforge.semi.sparsify_24(model)") from exc


class Library:
    """One cuSPARSELt handle per CUDA device (the handle is tied to the device current at init)."""

    _handles: dict[int, "Library"] = {}
    _lock = threading.Lock()

    def __init__(self, device_index: int):
        L = bindings()
        with torch.cuda.device(device_index):
            self.handle = L.init()
        self.device_index = device_index
        self.version = L.get_version(self.handle)
        weakref.finalize(self, L.destroy, self.handle)

    @classmethod
    def on(cls, device: torch.device) -> "Library":
        index = device.index if device.index is not None else torch.cuda.current_device()
        with cls._lock:
            if index not in cls._handles:
                major, minor = torch.cuda.get_device_capability(index)
                if major < 8:
                    raise Sparse24Error(f"GPU {torch.cuda.get_device_name(index)} is sm_{major}{minor}; Sparse "
                                        "Tensor Cores need sm_80 or newer (A100, H100, H200, ...)")
                cls._handles[index] = cls(index)
            return cls._handles[index]


class CompressedWeight:
    """A 2:4 weight in cuSPARSELt's compressed form (values + metadata), built once on the weight's device."""

    def __init__(self, weight: torch.Tensor):
        check_weight(weight)
        if weight.device.type != "cuda":
            raise Sparse24Error(f"weight is on {weight.device}; compress it on a CUDA device")
        L = bindings()
        from nvmath.bindings import cusparse

        self.library = Library.on(weight.device)
        self.rows, self.cols = weight.shape
        self.dtype, self.device = weight.dtype, weight.device
        self.value_type = _value_type(weight.dtype)
        handle = self.library.handle
        self.descriptor = L.structured_descriptor_init(
            handle, self.rows, self.cols, self.cols, ALIGN_BYTES, self.value_type, cusparse.Order.ROW,
            L.Sparsity.SPARSITY_50_PERCENT)
        weakref.finalize(self, L.mat_descriptor_destroy, self.descriptor)
        size, scratch_size = L.sp_mma_compressed_size2(handle, self.descriptor)
        dense = weight.detach().contiguous()
        self.data = torch.empty(size, dtype=torch.uint8, device=weight.device)
        scratch = torch.empty(max(scratch_size, 1), dtype=torch.uint8, device=weight.device)
        stream = torch.cuda.current_stream(weight.device).cuda_stream
        # Freed tensors go back to torch's allocator for this same stream, so the asynchronous compression
        # finishes before `dense` or `scratch` memory can be handed out again.
        L.sp_mma_compress2(handle, self.descriptor, 1, cusparse.Operation.NON_TRANSPOSE, dense.data_ptr(),
                           self.data.data_ptr(), scratch.data_ptr(), stream)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


class MatmulPlan:
    """Y^T (M x n) = W @ X^T [+ bias] for X (n x K) and one n: cuSPARSELt descriptors, searched algorithm
    and workspace, built once. `run` is the per-call path."""

    def __init__(self, weight: CompressedWeight, n: int, bias: torch.Tensor | None = None):
        if n < 1:
            raise Sparse24Error(f"n = {n}: a plan needs at least one input row")
        self.weight, self.n, self.bias = weight, n, bias
        self._alpha = np.ones(1, dtype=np.float32)
        self._beta = np.zeros(1, dtype=np.float32)
        self._streams = np.zeros(1, dtype=np.intp)
        self._bias_ptr = np.zeros(1, dtype=np.int64)
        # Host addresses read on every call, computed once: the call path is a handful of integer arguments.
        self._scalars = (self._alpha.ctypes.data, self._beta.ctypes.data, self._streams.ctypes.data)
        self._matmul = bindings().matmul
        self._handle, self._a_ptr = weight.library.handle, weight.data.data_ptr()  # fixed for the plan's life
        self._device_index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
        self._owned: list = []
        self.padded_n, self.refusals = self._build(n)
        self.workspace = self._workspace()
        self.config_id: int | None = None

    # -- construction ---------------------------------------------------------------------------------
    def _build(self, n: int) -> tuple[int, list[str]]:
        L = bindings()
        refusals = []
        for padded in dict.fromkeys([n, *(-(-n // m) * m for m in N_PAD_CANDIDATES)]):
            try:
                self._describe(padded)
                return padded, refusals
            except L.cuSPARSELtError as exc:
                self._destroy_owned()
                refusals.append(f"n={padded}: {exc}")
        raise Sparse24Error(f"cuSPARSELt refused every width tried for a {self.weight.rows} x {self.weight.cols} "
                            f"{self.weight.dtype} weight at n={n}: {'; '.join(refusals)}")

    def _describe(self, padded: int) -> None:
        L = bindings()
        from nvmath.bindings import cusparse

        w, handle = self.weight, self.weight.library.handle
        self.b_desc = self._own(L.dense_descriptor_init(handle, w.cols, padded, w.cols, ALIGN_BYTES, w.value_type,
                                                        cusparse.Order.COL), L.mat_descriptor_destroy)
        self.d_desc = self._own(L.dense_descriptor_init(handle, w.rows, padded, padded, ALIGN_BYTES, w.value_type,
                                                        cusparse.Order.ROW), L.mat_descriptor_destroy)
        op = cusparse.Operation.NON_TRANSPOSE
        self.matmul_desc = self._own(L.matmul_descriptor_init(handle, op, op, w.descriptor, self.b_desc,
                                                              self.d_desc, self.d_desc, L.ComputeType.COMPUTE_32F),
                                     L.matmul_descriptor_destroy)
        if self.bias is not None:
            self._bias_ptr[0] = self.bias.data_ptr()
            L.matmul_desc_set_attribute(handle, self.matmul_desc, L.MatmulDescAttribute.BIAS_POINTER,
                                        self._bias_ptr.ctypes.data, self._bias_ptr.nbytes)
        self.alg = self._own(L.matmul_alg_selection_init(handle, self.matmul_desc, L.MatmulAlg.DEFAULT),
                             L.matmul_alg_selection_destroy)
        iterations = np.array([SEARCH_ITERATIONS], dtype=np.int32)
        L.matmul_alg_set_attribute(handle, self.alg, L.MatmulAlgAttribute.SEARCH_ITERATIONS,
                                   iterations.ctypes.data, iterations.nbytes)
        self.plan = L.matmul_plan_init(handle, self.matmul_desc, self.alg)
        self._plan_finalizer = weakref.finalize(self, L.matmul_plan_destroy, self.plan)

    def _own(self, pointer: int, destroy) -> int:
        self._owned.append(weakref.finalize(self, destroy, pointer))
        return pointer

    def _destroy_owned(self) -> None:
        for finalizer in reversed(self._owned):
            finalizer()
        self._owned.clear()

    def _workspace(self) -> torch.Tensor:
        size = bindings().matmul_get_workspace(self.weight.library.handle, self.plan)
        return torch.empty(max(size, 1), dtype=torch.uint8, device=self.weight.device)

    # -- search and run ---------------------------------------------------------------------------------
    def search(self, x: torch.Tensor, out: torch.Tensor) -> int:
        """Let cusparseLtMatmulSearch time every algorithm on (x, out); it updates this plan in place with the
        fastest. Not allowed during CUDA graph capture (it synchronizes)."""
        L = bindings()
        handle = self.weight.library.handle
        # Some algorithms (split-K) want far more workspace than the default one: measured up to 23 MB for
        # 14336 x 4096 x 8192. Search with room to spare, then keep only what the winner needs.
        self.workspace = torch.empty(max(self.workspace.numel(), SEARCH_WORKSPACE_BYTES), dtype=torch.uint8,
                                     device=self.weight.device)
        self._call(L.matmul_search, x, out)
        config = np.zeros(1, dtype=np.int32)
        L.matmul_alg_get_attribute(handle, self.alg, L.MatmulAlgAttribute.CONFIG_ID, config.ctypes.data,
                                   config.nbytes)
        self.config_id = int(config[0])
        # Re-initialising the plan after a search crashes cuSPARSELt 0.8 (measured); the searched plan is kept.
        self.workspace = self._workspace()
        return self.config_id

    def run(self, x: torch.Tensor, out: torch.Tensor, compressed: torch.Tensor | None = None) -> None:
        """out = W @ x^T (+ bias) on torch's current stream. x is a contiguous (padded_n x K) and out a
        contiguous (M x padded_n) tensor of the weight's dtype and device, both 16-byte aligned. `compressed`:
        another copy of the plan's compressed bytes (`weight.data.clone()`) to read W from instead, so that
        a timing loop can rotate copies of W through HBM with one plan."""
        if compressed is not None and (compressed.numel() != self.weight.data.numel() or
                                       compressed.device != self.weight.data.device or
                                       compressed.dtype != torch.uint8 or compressed.data_ptr() % ALIGN_BYTES):
            raise Sparse24Error(f"compressed must be a {ALIGN_BYTES}-byte aligned uint8 copy of the plan's "
                                f"{self.weight.data.numel()} compressed bytes on {self.weight.data.device}")
        self._call(self._matmul, x, out, None if compressed is None else compressed.data_ptr())

    def _call(self, fn, x: torch.Tensor, out: torch.Tensor, a_ptr: int | None = None) -> None:
        if torch.cuda.current_device() != self._device_index:  # the library runs on the current device
            with torch.cuda.device(self._device_index):
                return self._call(fn, x, out, a_ptr)
        alpha, beta, streams = self._scalars
        self._streams[0] = current_stream_handle(self._device_index)
        d = out.data_ptr()
        fn(self._handle, self.plan, alpha, self._a_ptr if a_ptr is None else a_ptr, x.data_ptr(), beta, d, d,
           self.workspace.data_ptr(), streams, 1)


