"""The public SpMM API: compile_spmm() and spmm()."""
from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np

from .formats import SparseMatrix
from .plan import LAYOUTS, TileConfig, make_plan
from .runtime import KernelCache, build_kernel, cache_key
from .tune import candidates, default_config, tune

_DTYPE_NAMES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
                "float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_LOADED: dict = {}


def _dtype_name(dtype) -> str:
    name = _DTYPE_NAMES.get(str(dtype))
    if name is None:
        raise TypeError(f"dtype {dtype} is not supported; use torch.float32, torch.float16 or torch.bfloat16")
    return name


def _device_index(device) -> tuple[int, int]:
    """(ordinal, arch) of a CUDA device, with clear errors for no GPU or a GPU older than sm_80."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}; sparseforge kernels run on NVIDIA GPUs")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU is available: compile_spmm needs an NVIDIA GPU (sm_80 or newer); "
                           "on a CPU use sparseforge.plan.execute() as the reference")
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 0):
        raise RuntimeError(f"GPU {torch.cuda.get_device_name(index)} is sm_{major}{minor}; sparseforge needs "
                           "sm_80 (Ampere) or newer")
    return index, major * 10 + minor


def _as_sparse(w) -> SparseMatrix:
    return w if isinstance(w, SparseMatrix) else SparseMatrix.from_dense(w)


def _bias_values(bias):
    if bias is None:
        return None
    if hasattr(bias, "detach"):
        bias = bias.detach().float().cpu().numpy()
    return np.asarray(bias, dtype=np.float64)


def compile_spmm(W, n: int, dtype="float32", layout: str = "kn", bias=None, relu: bool = False,
                 device="cuda", config: TileConfig | None = None, tune_budget: float | None = 5.0):
    """Generate, compile (or fetch from cache) and load a kernel specialised to W.

    W: SparseMatrix, or a dense 2-D torch tensor / numpy array (M x K). n: N, the columns of B (layout
    "kn": B is K x N, C = W @ B is M x N) or the tokens of X (layout "nk": X is N x K, Y = X @ W^T is
    N x M). dtype: torch.float32 / float16 / bfloat16 (inputs and outputs; fp32 accumulation; W's values
    are rounded to dtype). bias: M values added before relu. config: a fixed TileConfig, else the
    autotuner measures a few within tune_budget seconds (None: no tuning, the heuristic pick) and stores
    the winner in the cache. Returns an SpmmKernel: k(B) -> C, k(B, out=C); k.plan, k.source,
    k.compile_seconds.
    """
    w = _as_sparse(W)
    name = _dtype_name(dtype)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'kn' or 'nk', got {layout!r}")
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    index, arch = _device_index(device)
    w = w.astype(name)
    bias_values = _bias_values(bias)

    def build(cfg: TileConfig):
        plan = make_plan(w, int(n), name, layout, cfg, bias_values, relu, arch)
        return build_kernel(plan, index)

    if config is not None or tune_budget is None:
        return build(config or default_config(int(n), layout, w.nnz / max(w.shape[0], 1), relu, w.shape[0]))
    cache = KernelCache()
    bias_tag = "none" if bias_values is None else cache_key(bias_values.astype(np.float32).tobytes())
    key = cache_key(w.digest(), str(n), name, layout, bias_tag, str(relu), "tune-v2")
    known = cache.get_tuned(key, arch)
    if known:
        kernel = build(TileConfig(**known["config"]))
        kernel.tuning = known["records"]
        return kernel
    import torch

    shape = (w.shape[1], n) if layout == "kn" else (n, w.shape[1])
    make_input = lambda: torch.randn(shape, device=f"cuda:{index}").to(getattr(torch, name))  # noqa: E731
    start = time.perf_counter()
    configs = candidates(int(n), layout, w.nnz / max(w.shape[0], 1), relu, w.shape[0])
    kernel, records = tune(build, int(n), layout, make_input, tune_budget, configs)
    kernel.tune_seconds, kernel.tuning = time.perf_counter() - start, records
    cache.put_tuned(key, arch, {"config": asdict(kernel.plan.config), "records": records})
    return kernel


def spmm(W, B, layout: str = "kn", bias=None, relu: bool = False, out=None, tune_budget: float | None = None):
    """C = W @ B (layout "kn", B: [batch,] K x N) or Y = B @ W^T (layout "nk", B: [batch,] N x K) in one
    call; the kernel for (W, N, dtype, layout, epilogue, device) is compiled once and kept in-process."""
    import torch

    if not isinstance(B, torch.Tensor):
        raise TypeError(f"B must be a torch.Tensor, got {type(B).__name__}")
    if B.dim() not in (2, 3):
        raise ValueError(f"B must be 2-D or 3-D (batched), got shape {tuple(B.shape)}")
    w = _as_sparse(W)
    n = B.shape[-1] if layout == "kn" else B.shape[-2]
    bias_tag = None if bias is None else _bias_values(bias).tobytes()
    key = (w.digest(), n, str(B.dtype), layout, bias_tag, relu, str(B.device))
    kernel = _LOADED.get(key)
    if kernel is None:
        kernel = compile_spmm(w, n, B.dtype, layout, bias, relu, B.device, tune_budget=tune_budget)
        _LOADED[key] = kernel
    return kernel(B, out=out)
