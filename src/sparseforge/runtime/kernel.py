"""SpmmKernel: a compiled, loaded kernel for one plan, callable on torch CUDA tensors."""
from __future__ import annotations

import time
from functools import lru_cache
from pathlib import Path

from ..codegen import KernelSource, render
from ..plan import Plan
from .cache import KernelCache, cache_key
from .compiler import default_compiler

_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
_VERSION = "0.1.0"


class SpmmKernel:
    """C = W @ B (layout "kn": B [batch,] K x N -> C [batch,] M x N) or Y = X @ W^T (layout "nk":
    X [batch,] N x K -> Y [batch,] N x M), with W, N, dtype and epilogue fixed at compile time.

    k(B) returns a new output; k(B, out=C) writes into C. Inputs: torch tensors on the kernel's CUDA
    device, of the kernel's dtype, contiguous. Launches on torch's current stream (CUDA-graph safe).
    Attributes: plan, source (PTX text), compile_seconds (generation + compile, 0 when cached),
    load_seconds, cache_hit.
    """

    def __init__(self, plan: Plan, source: KernelSource | None, cubin: bytes, device_index: int,
                 compile_seconds: float, cache_hit: bool):
        from .driver import LoadedKernel

        start = time.perf_counter()
        self.plan, self._source, self.device_index = plan, source, device_index
        self._loaded = LoadedKernel(cubin, plan.name, device_index)
        self.load_seconds = time.perf_counter() - start
        self.compile_seconds, self.cache_hit = compile_seconds, cache_hit
        self.tune_seconds = 0.0
        self.tuning: list[dict] = []
        import torch

        self._dtype = getattr(torch, plan.dtype)
        self._device = torch.device("cuda", device_index)
        # made now, not at the first call, which may be inside a CUDA graph capture (no host copies there)
        self._partial = (torch.tensor(plan.partial_rows, dtype=torch.long, device=self._device)
                         if plan.partial_rows else None)

    @property
    def source(self) -> str:
        if self._source is None:  # a cache hit skips rendering; render on demand
            self._source = render(self.plan)
        return self._source.text

    @property
    def in_shape(self) -> tuple[int, int]:
        p = self.plan
        return (p.K, p.N) if p.layout == "kn" else (p.N, p.K)

    @property
    def out_shape(self) -> tuple[int, int]:
        p = self.plan
        return (p.M, p.N) if p.layout == "kn" else (p.N, p.M)

    def _check(self, b, what: str, shape: tuple[int, int]):
        import torch

        if not isinstance(b, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(b).__name__}")
        if b.device != self._device:
            raise ValueError(f"{what} is on {b.device}, the kernel was compiled for {self._device}; "
                             f"move it with .to('{self._device}')")
        if b.dtype != self._dtype:
            raise TypeError(f"{what} has dtype {b.dtype}, the kernel was compiled for {self._dtype}; "
                            f"convert with .to({self._dtype}) or compile for {b.dtype}")
        if b.dim() not in (2, 3) or tuple(b.shape[-2:]) != shape:
            raise ValueError(f"{what} has shape {tuple(b.shape)}, expected {shape} or (batch, *{shape}) "
                             f"(layout {self.plan.layout!r}, W {self.plan.M}x{self.plan.K}, N {self.plan.N})")
        if not b.is_contiguous():
            raise ValueError(f"{what} is not contiguous; call .contiguous() first")

    def __call__(self, b, out=None):
        import torch

        self._check(b, "B" if self.plan.layout == "kn" else "X", self.in_shape)
        batch = b.shape[0] if b.dim() == 3 else 1
        shape = (*b.shape[:-2], *self.out_shape)
        if out is None:
            out = torch.empty(shape, dtype=self._dtype, device=self._device)
        else:
            self._check(out, "out", self.out_shape)
            if tuple(out.shape) != shape:
                raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
        if self.plan.config.transpose_x:
            b = b.transpose(-1, -2).contiguous()  # X^T, K x N: the kernel reads it like B in kn
        elif b.data_ptr() % 16:
            b = b.clone()  # a fresh allocation is 256-byte aligned: staging copies use 16-byte loads
        align = self.plan.config.vec * self.plan.element_bytes
        target = out if out.data_ptr() % align == 0 else torch.empty_like(out)
        self.zero_partial_rows(target)
        self.launch(b.data_ptr(), target.data_ptr(), batch, torch.cuda.current_stream(self._device).cuda_stream)
        if target is not out:
            out.copy_(target)
        return out

    def zero_partial_rows(self, out) -> None:
        """Zero the output rows that split groups add into (plan.partial_rows); nothing when none are split."""
        if self._partial is not None:
            out.index_fill_(out.dim() - 2 if self.plan.layout == "kn" else out.dim() - 1, self._partial, 0)

    def launch(self, b_ptr: int, c_ptr: int, batch: int, stream: int) -> None:
        """The raw launch: device pointers and a stream handle, no checks (for graph capture and ops).
        Where the plan splits rows (plan.partial_rows), the caller zeroes those output rows first; with
        config.transpose_x, b_ptr points at X transposed ([batch,] K x N, contiguous)."""
        tiles, blocks = self.plan.grid
        self._loaded.launch((tiles, blocks, batch), self.plan.config.threads, stream, b_ptr, c_ptr)

    @property
    def registers(self) -> int:
        return self._loaded.registers

    def __repr__(self) -> str:
        return (f"SpmmKernel({self.plan.name}, compile {self.compile_seconds:.3f}s, "
                f"{'cache hit' if self.cache_hit else 'built'})")


@lru_cache(maxsize=1)
def generator_digest() -> str:
    """sha256 of the code that turns a plan into PTX: editing the generator invalidates cached kernels."""
    root = Path(__file__).resolve().parent.parent
    files = sorted((root / "codegen").glob("*.py")) + sorted((root / "plan").glob("*.py"))
    return cache_key(*(f.read_bytes() for f in files))


def plan_key(plan: Plan, compiler_version: str) -> str:
    """Everything that determines the binary: the weight (digest of its pattern and values), the problem,
    the tiling, the epilogue, the arch, the generator's own code, the toolchain and this package's version.
    Keying on these rather than on the rendered text lets a cache hit skip rendering altogether."""
    bias = "none" if plan.bias is None else cache_key(repr(plan.bias))
    return cache_key(plan.digest, f"{plan.M}x{plan.K}", str(plan.N), plan.layout, plan.dtype, repr(plan.config),
                     bias, str(plan.relu), str(plan.arch), generator_digest(), compiler_version, _VERSION)


def build_kernel(plan: Plan, device_index: int, cache: KernelCache | None = None, compiler=None) -> SpmmKernel:
    """Compile (or fetch from the disk cache) and load the kernel of `plan`."""
    from .. import env

    start = time.perf_counter()
    compiler = compiler or default_compiler()
    cache = cache or KernelCache()
    key = plan_key(plan, compiler.version)
    dump = env.dump_source_dir()
    source = render(plan) if dump else None
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{plan.name}.ptx").write_text(source.text)

    def build():
        nonlocal source
        source = source or render(plan)
        cubin = compiler.compile(source.modules, plan.arch)
        return cubin, {"name": plan.name, "compiler": compiler.version,
                       "compile_seconds": time.perf_counter() - start}

    cubin, meta, hit = cache.get_or_build(key, plan.arch, build)
    seconds = 0.0 if hit else time.perf_counter() - start
    return SpmmKernel(plan, source, cubin, device_index, seconds, hit)
