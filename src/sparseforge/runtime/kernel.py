"""The one place kernel source becomes a loaded kernel: one cache-key recipe (kernel_key), one compile
path (compile_source: render on a miss, compile, cache), one loader (load_kernel), and SpmmKernel, the
callable over a plan of any mapping (generated row groups, row per block, split K, and the kernels that read
W as data: CSR, csr-columns, bitmap).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from .._version import __version__
from ..codegen import KernelSource, render
from ..mappings.registry import plan_family
from .cache import KernelCache, cache_key
from .compiler import default_compiler
from .streams import current_stream_handle


class LoadedPlanKernel:
    """What every kernel over a plan holds once loaded: the plan, the loaded module, its compile and load
    times, the chooser's record, and W's device arrays for the kernels that read W as data (kept alive as
    long as the kernel: a CUDA graph that replays it reads them)."""

    _packed = None  # the launch's parameter block (runtime/launch.py PackedLaunch), built at the first launch
    _max_batch = 65535  # batch entries a launch takes (the grid's z dimension, or the plan's workspace)
    _make_full = None  # what makes the whole plan where the kernel was loaded from a sketch

    def __init__(self, plan, built: "Built", device_index: int, full_plan: Callable[[], object] | None = None):
        """plan: what the launch needs (grid, threads, shapes, split rows); a sketch (plan.sketch) serves when
        the cubin came from the cache, and `full_plan` then makes the whole plan if someone reads k.plan or
        k.source (on a cache hit, planning every group's program would cost more than loading the kernel)."""
        import torch

        start = time.perf_counter()
        self._make_full = full_plan
        self.plan, self._source, self.device_index = plan, built.source, device_index
        self._loaded = load_kernel(built.cubin, plan.name, device_index)
        # where W is the code, its size: what a copy of the kernel streams (with_own_weights loads the cubin again)
        self._code_bytes = len(built.cubin) if plan_family(plan).weight_in_code else 0
        self.load_seconds = time.perf_counter() - start
        self.compile_seconds, self.cache_hit = built.seconds, built.hit
        self.tune_seconds = 0.0
        self.tuning: list[dict] = []
        self.choice = None  # the chooser's record (tune/choose.py) when the kernel was picked by timing
        self._dtype = getattr(torch, plan.dtype)
        self._device = torch.device("cuda", device_index)
        self._weight_tensors, self._data, self._workspace = weight_data(plan, self._device)
        # made now, not at the first call, which may be inside a CUDA graph capture (no host copies there)
        partial = getattr(plan, "partial_rows", ())
        self._partial = torch.tensor(partial, dtype=torch.long, device=self._device) if partial else None

    @property
    def plan(self):
        """The kernel's plan (made on first use when the kernel was loaded from the cache by a sketch)."""
        if self._full is None:
            if self._make_full is None:
                return self._launch
            self._full = self._make_full()
        return self._full

    @plan.setter
    def plan(self, plan) -> None:
        """What the launch reads; the whole plan too unless it is a sketch."""
        self._launch = plan
        self._max_batch = min(65535, getattr(plan, "max_batch", 65535))
        self._lean = None  # the fast call's signature, made again for this plan
        self._full = None if getattr(plan, "sketch", False) else plan

    @property
    def launch_plan(self):
        """What a launch reads (grid, threads, shapes, split rows): the plan, or its sketch where the kernel came
        from the cache and nobody asked for the whole plan."""
        return self._launch

    @property
    def mapping(self) -> str:
        """Which mapping of the work this kernel is: see plan.mapping."""
        return self._launch.mapping

    @property
    def config(self):
        """The config the kernel was built from (its plan's, read without making the whole plan)."""
        return self._launch.config

    @property
    def weight_bytes(self) -> int:
        """Device bytes of W the kernel reads as data (0 where W is compiled into the code)."""
        return sum(t.numel() * t.element_size() for t in self._weight_tensors if t is not None)

    @property
    def weight_tensors(self) -> tuple:
        """The device tensors the kernel reads W from (and the bias; None where absent): kernels of one layer
        packed on the device share them, so memory is counted by storage."""
        return tuple(self._weight_tensors)

    def with_own_weights(self, cubin: bytes | None = None):
        """The same loaded kernel over a fresh device copy of W's arrays (the module is shared). A many-layer
        model streams every layer's weight from HBM; timing copies in turn measures that, where one copy
        would sit in the 50-60 MB L2 (bench's rotating-weights protocol). Where W is the code (code_bytes > 0)
        the copy is a second load of the kernel's cubin, which the caller passes (the kernel keeps none: it
        can be megabytes); release() unloads it once no graph replays it."""
        twin = copy.copy(self)
        launch_plan = self._launch
        twin._weight_tensors, twin._data, twin._workspace = weight_data(launch_plan, self._device, fresh=True)
        if self.code_bytes:
            if cubin is None:
                raise ValueError("this kernel's W is its code: a copy is a second load of its cubin; pass "
                                 "with_own_weights(cubin=...) (runtime.compile_plan(kernel.plan).cubin)")
            twin._loaded = load_kernel(cubin, launch_plan.name, self.device_index)
            twin._packed = None  # its launch block names the new module's function
            twin._owns_module = True
        return twin

    def release(self) -> None:
        """Unload the module a with_own_weights copy loaded for itself (nothing for other kernels). Call it
        once no CUDA graph that launches the copy remains."""
        if self.__dict__.pop("_owns_module", False):
            self._packed = None  # its launch block named the unloaded function
            self._loaded.close()

    def densify(self, out):
        """W dense in `out` (M x K, a torch tensor on the kernel's device) from the kernel's own device arrays,
        where its family can (mappings.registry: dense_writer, a kernel writing W over the same arrays; else
        densify, torch ops); None where it cannot (W is its code, or a family without either hook)."""
        launch_plan = self._launch
        family = plan_family(launch_plan)
        if not self._weight_tensors:
            return None
        writer = family.hook("dense_writer")
        shape = (launch_plan.M, launch_plan.K)
        if writer is not None and out.is_contiguous() and out.device == self._device and out.dtype == self._dtype \
                and tuple(out.shape) == shape:  # the kernel writes M x K elements of its dtype: nothing else
            try:
                return self._write_dense(writer(launch_plan), out)
            except ValueError:  # a plan of no single W (a gated kernel's two): nothing to write
                return None
            except RuntimeError:  # CompileError, CudaError: the torch ops below give the same W, slower
                self.__dict__["_dense_writer"] = False
        hook = family.hook("densify")
        return None if hook is None else hook(launch_plan, self._weight_tensors, out)

    def _write_dense(self, plan, out):
        """W dense into `out` by the dense-writer kernel of `plan`, launched over this kernel's own arrays (a
        twin of this kernel with the writer's module, built once)."""
        twin = self.__dict__.get("_dense_writer")
        if twin is False:
            raise RuntimeError("the dense writer failed to build before")
        if twin is None:
            twin = copy.copy(self)
            twin._make_full, twin.plan = None, plan
            twin._loaded, twin._packed = load_kernel(compile_plan(plan).cubin, plan.name, self.device_index), None
            self.__dict__["_dense_writer"] = twin
        out.zero_()
        twin._launch_plan((*plan.grid, 1), plan.threads, current_stream_handle(self.device_index), 0, out.data_ptr())
        return out

    @property
    def code_bytes(self) -> int:
        """The cubin's bytes where W is compiled into the code (0 where W is data): what a copy of such a
        kernel streams besides its input."""
        return getattr(self, "_code_bytes", 0)

    @property
    def source(self) -> str:
        if self._source is None:  # a cache hit skips rendering; render on demand
            self._source = render(self.plan)
        return self._source.text

    @property
    def registers(self) -> int:
        return self._loaded.registers

    def _launch_plan(self, grid: tuple[int, int, int], threads: int, stream: int, input_ptr: int,
                     output_ptr: int, *residual_ptr: int) -> None:
        """The launch of any loaded plan: input, output, W's device arrays where the kernel reads W as data
        (a generated kernel has none: W is its code), then the residual where the plan adds one."""
        args = (input_ptr, output_ptr, *(self._data or ()), *residual_ptr)
        shared = getattr(self._launch, "dynamic_shared_bytes", 0)
        packed = self._packed
        if packed is None or packed.shape != (threads, len(args), shared):
            packed = self._packed = self._loaded.packed(threads, len(args), shared)
        packed(grid, stream, *args)

    def _zero_partial(self, out, dim: int) -> None:
        """Zero the output rows (plan.partial_rows, along dimension `dim`) that split groups add into."""
        if self._partial is not None:
            out.index_fill_(dim, self._partial, 0)


def check_tensor(t, what: str, device, dtype) -> None:
    """Raise, naming the problem and the fix, unless t is a torch tensor on `device` of `dtype`: the first
    checks of every kernel's call (SpmmKernel, ConvKernel, Split24Kernel). `what` names the argument ("out"
    takes other fixes: a moved or cast copy of out would not be written)."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        fix = (f"allocate it there (device='{device}') or omit out" if what == "out" else
               f"move it with {what}.to('{device}')")
        raise ValueError(f"{what} is on {t.device}, the kernel was compiled for {device}: {fix}")
    if t.dtype != dtype:
        if what == "out":
            fix = f"allocate it as {dtype} or omit out"
        elif t.dtype in (torch.float32, torch.float16, torch.bfloat16):
            fix = f"convert with {what}.to({dtype}) or compile a kernel for {t.dtype}"
        else:
            fix = f"convert with {what}.to({dtype}) (kernels take float32, float16 or bfloat16)"
        raise TypeError(f"{what} has dtype {t.dtype}, the kernel was compiled for {dtype}: {fix}")


class SpmmKernel(LoadedPlanKernel):
    """C = W @ B (layout "kn": B [batch,] K x N -> C [batch,] M x N) or Y = X @ W^T (layout "nk":
    X [batch,] N x K -> Y [batch,] N x M), with W, N, dtype and epilogue fixed at compile time.

    k(B) returns a new output; k(B, out=C) writes into C. Inputs: torch tensors on the kernel's CUDA
    device, of the kernel's dtype, contiguous (at any address: a misaligned one goes through a copy).
    Launches on torch's current stream (CUDA-graph safe). Attributes: plan, source (PTX text),
    compile_seconds (generation + compile, 0 when cached), load_seconds, cache_hit.

    Each call checks, in this order, and refuses with an error naming the problem and the fix: B (X) and
    out are torch tensors (TypeError), on the kernel's device (ValueError), of its dtype (TypeError), 2-D
    or 3-D with K and N (M for out) as compiled (ValueError), contiguous (ValueError); a batch of at most
    65535 (the launch grid's z dimension); out of B's batch; out sharing no memory with B (ValueError: the
    kernel would read elements it has already overwritten). A batch of 0 returns an empty output (out
    itself when given) without a launch. The checks are attribute reads and comparisons.

    NaN and inf in B: as in any matmul, except that only W's stored nonzeros are multiplied. A NaN at
    B[k, j] (kn; X[j, k] in nk) makes C[i, j] NaN for exactly the rows i of W with a nonzero in column k;
    an inf makes it +-inf by the sign of W[i, k] (NaN where infinities of both signs meet). Every other
    output is untouched by it, so a NaN in a column W does not use appears nowhere (dense W @ B would
    poison all of column j: 0 * NaN = NaN). The exceptions are the tensor-core mappings ("tc-scatter" and
    "bitmap-tc", half precision at N <= 64 and <= 16): they multiply dense tiles of W, empty ones too, so a
    non-finite B[k, j] makes all of C[:, j] NaN, exactly as dense W @ B (the masked dense model) does. The fused ReLU (relu=True) is PTX max.NaN(x, 0): NaN stays
    NaN, as in torch.relu.

    Keep the kernel object alive as long as a CUDA graph that replays it: the small-N mapping (csr) reads
    W's values and indices from device tensors the kernel owns.
    """

    _lean = None  # the fast call's signature (_lean_signature), False where the plan never takes it

    @property
    def dense_faster(self) -> bool | None:
        """True when the chooser measured dense cuBLAS faster than this (the fastest sparse) kernel; None
        when dense was not timed. choice.sparse_us / choice.dense_us hold both times."""
        return None if self.choice is None or self.choice.dense_us is None else self.choice.dense_faster


    @property
    def in_shape(self) -> tuple[int, int]:
        p = self._launch
        return (p.K, p.N) if p.layout == "kn" else (p.N, p.K)

    @property
    def out_shape(self) -> tuple[int, int]:
        p = self._launch
        return (p.M, p.N) if p.layout == "kn" else (p.N, p.M)

    def _check(self, b, what: str, shape: tuple[int, int]):
        """Raise, naming the problem and the fix, unless b is a contiguous [batch,] `shape` tensor of the
        kernel's dtype on its device. `what`: "B", "X" or "out" (whose fixes differ: a copy of out is no use)."""
        check_tensor(b, what, self._device, self._dtype)
        if b.dim() not in (2, 3) or tuple(b.shape[-2:]) != shape:
            p = self._launch
            if what == "out":
                names = ("M", "N") if p.layout == "kn" else ("N", "M")
            else:
                names = ("K", "N") if p.layout == "kn" else ("N", "K")
            expected = (f"expected 2-D {names[0]} x {names[1]} = {shape[0]} x {shape[1]} or 3-D "
                        f"(batch, {shape[0]}, {shape[1]}) (layout {p.layout!r}, W {p.M} x {p.K})")
            if b.dim() not in (2, 3):
                raise ValueError(f"{what} has shape {tuple(b.shape)}, {b.dim()}-D: {expected}")
            told = {"K": f"W has K = {p.K} columns", "M": f"W has M = {p.M} rows",
                    "N": f"the kernel was compiled for N = {p.N}"}
            problems = [f"{got} along {name} where {told[name]}"
                        for name, got, want in zip(names, b.shape[-2:], shape) if got != want]
            hint = ""
            got_n = b.shape[-2:][names.index("N")]
            if what != "out" and got_n != p.N:
                hint = (f". N is fixed at compile time: compile a kernel for N = {got_n} (compile_spmm(W, {got_n}, "
                        "...)) or call sparseforge.spmm(), which keeps one per N")
            raise ValueError(f"{what} has shape {tuple(b.shape)}: {'; '.join(problems)}; {expected}{hint}")
        if not b.is_contiguous():
            fix = ("pass a contiguous out (torch.empty(...)) or omit out and copy the result where it should go "
                   "(writing into out.contiguous() would fill a copy)" if what == "out" else
                   f"call {what}.contiguous() first")
            raise ValueError(f"{what} is not contiguous (shape {tuple(b.shape)}, strides {b.stride()}): {fix}")

    def _lean_signature(self):
        """What a call must match to skip the checks (a fresh output, no residual, no transposed copy): the
        tensor type, dtype, device and the last two dimensions; None where this plan never takes that path."""
        import torch

        p = self._launch
        if getattr(p, "residual", False):
            return None
        return (torch.Tensor, self._dtype, self._device, torch.Size(self.in_shape), self.out_shape, p.transposes_input,
                self.max_batch)

    @property
    def max_batch(self) -> int:
        """The largest batch one launch takes: the grid's z dimension (65535), or a plan's own limit (a
        workspace sized for one batch entry: bitmap-tc with k_split)."""
        return self._max_batch

    def __call__(self, b, out=None, residual=None):
        # The common call, k(b) with b as compiled, costs attribute reads, one allocation and one launch: the
        # checks below run (and name the problem) only when one of these comparisons fails.
        lean = self._lean
        if lean is None:
            lean = self._lean = self._lean_signature() or False
        if lean and out is None and residual is None and isinstance(b, lean[0]) and b.dtype == lean[1] and \
                b.device == lean[2] and b.shape[-2:] == lean[3] and b.is_contiguous() and b.data_ptr() % 16 == 0:
            dim = b.dim()
            if dim == 2 or (dim == 3 and 0 < b.shape[0] <= lean[6]):
                import torch

                out = torch.empty((*b.shape[:-2], *lean[4]), dtype=lean[1], device=lean[2])
                if self._partial is not None:
                    self.zero_partial_rows(out)
                if lean[5]:
                    b = b.transpose(-1, -2).contiguous()  # X^T, K x N: the kernel reads it like B in kn
                self.launch(b.data_ptr(), out.data_ptr(), b.shape[0] if dim == 3 else 1,
                            current_stream_handle(self.device_index))
                return out
        return self._checked_call(b, out, residual)

    @property
    def takes_rows_unchecked(self) -> bool:
        """Whether launch_rows applies: an nk plan with no residual that reads its input as it lies."""
        if self._lean is None:
            self._lean = self._lean_signature() or False
        return bool(self._lean) and self._launch.layout == "nk" and not self._lean[5]

    def launch_rows(self, b, out) -> None:
        """The launch for a caller that has checked everything (nn.SparseLinear's lean path): b and out
        contiguous tensors of the kernel's dtype and device, b holding the compiled N rows of K (any leading
        shape), b 16-byte aligned, out fresh with N rows of M; only where takes_rows_unchecked."""
        if self._partial is not None:
            self.zero_partial_rows(out)
        self.launch(b.data_ptr(), out.data_ptr(), 1, current_stream_handle(self.device_index))

    def _checked_call(self, b, out, residual):
        import torch

        what = "B" if self._launch.layout == "kn" else "X"
        self._check(b, what, self.in_shape)
        if getattr(self._launch, "residual", False):
            if residual is None:
                raise ValueError("the kernel was compiled with residual=True: pass residual= (laid out as the "
                                 "output), or compile without it")
            self._check(residual, "residual", self.out_shape)
            if tuple(residual.shape[:-2]) != tuple(b.shape[:-2]):
                raise ValueError(f"residual has shape {tuple(residual.shape)}, expected the output's "
                                 f"{(*b.shape[:-2], *self.out_shape)}")
        elif residual is not None:
            raise ValueError("the kernel was compiled without a residual: compile with residual=True to add one")
        batch = b.shape[0] if b.dim() == 3 else 1
        if batch > 65535:  # the batch is the launch grid's z dimension, which CUDA caps at 65535
            raise ValueError(f"{what} has a batch of {batch}; one launch takes at most 65535 (the grid's z "
                             "dimension): split the batch into pieces of at most 65535")
        if batch > self.max_batch:
            raise ValueError(f"{what} has a batch of {batch}; this kernel ({self._launch.name}) keeps a workspace for "
                             f"{self.max_batch} batch entry at a time: call it once per entry, or compile it with a "
                             "config that splits no work across blocks")
        shape = (*b.shape[:-2], *self.out_shape)
        if out is None:
            out = torch.empty(shape, dtype=self._dtype, device=self._device)
        else:
            self._check(out, "out", self.out_shape)
            if tuple(out.shape) != shape:
                raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape} for {what} of shape "
                                 f"{tuple(b.shape)} (the same batch)")
            # both are contiguous (checked): each one's memory is [data_ptr, data_ptr + bytes)
            start, first = out.data_ptr(), b.data_ptr()
            if start < first + b.numel() * b.element_size() and first < start + out.numel() * out.element_size():
                raise ValueError(f"out shares memory with {what} (the same tensor, or overlapping views of one "
                                 f"buffer): the kernel would read {what} elements it has already overwritten. "
                                 "Pass an out of its own, or omit out")
            if residual is not None and residual.data_ptr() != start:  # out = residual itself: an in-place add
                first = residual.data_ptr()
                if start < first + residual.numel() * residual.element_size() and \
                        first < start + out.numel() * out.element_size():
                    raise ValueError("out partly overlaps residual: pass residual itself as out (an in-place add) "
                                     "or a separate tensor")
        if batch == 0:
            return out  # nothing to compute; a launch with a zero grid dimension would be a CUDA error
        if self._launch.transposes_input:
            b = b.transpose(-1, -2).contiguous()  # X^T, K x N: the kernel reads it like B in kn
        elif b.data_ptr() % 16:
            b = b.clone()  # a fresh allocation is 256-byte aligned: staging copies use 16-byte loads
        align = self._launch.output_alignment
        target = out if out.data_ptr() % align == 0 else torch.empty_like(out)
        self.zero_partial_rows(target)
        extra = () if residual is None else (residual.data_ptr(),)
        self.launch(b.data_ptr(), target.data_ptr(), batch, current_stream_handle(self.device_index), *extra)
        if target is not out:
            out.copy_(target)
        return out

    def zero_partial_rows(self, out) -> None:
        """Zero the output rows that split groups add into (plan.partial_rows); nothing when none are split."""
        self._zero_partial(out, out.dim() - 2 if self._launch.layout == "kn" else out.dim() - 1)

    def launch(self, b_ptr: int, c_ptr: int, batch: int, stream: int, *residual_ptr: int) -> None:
        """The raw launch: device pointers and a stream handle, no checks (for graph capture and ops).
        Where the plan splits rows (plan.partial_rows), the caller zeroes those output rows first; with
        config.transpose_x, b_ptr points at X transposed ([batch,] K x N, contiguous); residual_ptr: the
        residual's pointer for a plan compiled with one."""
        if batch > self._max_batch:  # a workspace for fewer entries: their blocks would meet in it
            raise ValueError(f"a launch of {batch} batch entries; {self._launch.name} takes {self._max_batch} at a "
                             "time (its workspace): launch once per entry")
        tiles, blocks = self._launch.grid
        self._launch_plan((tiles, blocks, batch), self._launch.threads, stream, b_ptr, c_ptr, *residual_ptr)

    def __repr__(self) -> str:
        return (f"SpmmKernel({self._launch.name}, compile {self.compile_seconds:.3f}s, "
                f"{'cache hit' if self.cache_hit else 'built'})")


def kernel_copies(kernel, count: int, cubin: bytes | None = None) -> list:
    """`count` copies of a loaded kernel over device weights of their own (with_own_weights), for timing with
    weights rotated through HBM; where W is the kernel's code each copy is a load of its cubin (`cubin`, or
    read back from the kernel cache). release_copies unloads them once no graph replays them; a load that
    fails releases those made before it."""
    if count <= 0:
        return []
    if not (isinstance(kernel, LoadedPlanKernel) and kernel.code_bytes):
        return [kernel.with_own_weights() for _ in range(count)]
    cubin = cubin or compile_plan(kernel.plan).cubin
    copies = []
    try:
        for _ in range(count):
            copies.append(kernel.with_own_weights(cubin))
    except BaseException:
        release_copies(copies)
        raise
    return copies


def release_copies(copies) -> None:
    """Unload what kernel_copies loaded (the copies' own modules); their arrays go with the last reference."""
    for kernel in copies:
        release = getattr(kernel, "release", None)
        if release is not None:
            release()


def weight_data(plan, device, fresh: bool = False) -> tuple[tuple, tuple | None, tuple]:
    """(device tensors, the kernel's array pointers, its workspace) of a plan that reads W as data: the tensors
    of plan.weight_arrays() and the bias (None: a null pointer); the pointers of those arrays, then of the
    workspace a plan may ask for (plan.workspace_sizes(): int32 element counts, zeroed, the kernel's own: not W,
    so not in the tensors or their bytes), then of the bias; else ((), None, ()). Host arrays are uploaded;
    arrays a plan packed on the device (registry: device_plan) are taken as they are, unless `fresh` (a copy of
    its own: with_own_weights)."""
    if not hasattr(plan, "weight_arrays"):
        return (), None, ()
    import torch

    owners = []
    for array, kind in plan.weight_arrays():
        dtype = getattr(torch, plan.dtype) if kind == "values" else getattr(torch, kind)
        if isinstance(array, torch.Tensor):  # packed on the device as the kernel reads it (16-bit ints signed)
            if kind in ("uint64", "uint16"):
                dtype = getattr(torch, kind[1:])
            if array.dtype != dtype:
                raise TypeError(f"{plan.name}: a device array of {array.dtype} where the kernel reads {dtype}")
            owners.append(array.to(device=device, copy=fresh))
        elif kind in ("uint64", "uint16"):  # uploaded as the signed type of that width: the same bits
            owners.append(torch.from_numpy(array.view(kind[1:])).to(device))
        else:
            owners.append(torch.from_numpy(array).to(device=device, dtype=dtype))
    workspace = tuple(torch.zeros(size, dtype=torch.int32, device=device)
                      for size in getattr(plan, "workspace_sizes", tuple)())
    bias = None if plan.bias is None else torch.tensor(plan.bias, dtype=torch.float32, device=device)
    pointers = tuple(0 if t is None else t.data_ptr() for t in (*owners, *workspace, bias))
    return (*owners, bias), pointers, workspace


@lru_cache(maxsize=1)
def generator_digest() -> str:
    """sha256 of the code that turns a plan into PTX (codegen/, plan/, every kernel family's folder under
    mappings/, and formats/, whose layouts the kernels read): editing the generator invalidates cached kernels."""
    root = Path(__file__).resolve().parent.parent
    files = sorted((root / "codegen").glob("*.py")) + sorted((root / "plan").glob("*.py")) + \
        sorted((root / "mappings").rglob("*.py")) + sorted((root / "formats").glob("*.py"))
    return cache_key(*(f.read_bytes() for f in files))


def kernel_key(kind: str, spec: str, arch: int, compiler_version: str) -> str:
    """The one cache-key recipe for every compiled kernel: its family, everything that fixes its source
    (spec), the arch, the generator's own code, the toolchain and this package's version."""
    return cache_key(kind, spec, str(arch), generator_digest(), compiler_version, __version__)


def plan_spec(plan) -> str:
    """What determines a plan's binary. Generated kernels: the weight (digest of pattern and values), the
    problem (a convolution's geometry too), the tiling, the epilogue. The small-N kernel: only the shape and
    options (W is data). Keying on these rather than on the rendered text lets a cache hit skip rendering
    altogether."""
    if not plan_family(plan).weight_in_code:  # W is data: the binary depends on the shape and options only
        return plan.source_key
    bias = "none" if plan.bias is None else cache_key(repr(plan.bias))
    # the name carries the rest of what fixes the source: a convolution's geometry and residual
    return "|".join([plan.digest, f"{plan.M}x{plan.K}", str(plan.N), plan.layout, plan.dtype, repr(plan.config),
                     bias, str(plan.relu), plan.name])


@dataclass
class Built:
    """A compiled kernel before loading: the cubin, the source if it was rendered, build seconds
    (0 on a cache hit) and whether the cache had it."""
    cubin: bytes
    source: KernelSource | None
    seconds: float
    hit: bool


def compile_source(key: str, arch: int, render_source: Callable[[], KernelSource], cache: KernelCache | None = None,
                   compiler=None) -> Built:
    """The cubin for `key`: from the disk cache, or rendered, compiled and stored. No CUDA call: safe to run
    in threads (the chooser compiles its candidates side by side)."""
    from .. import env

    start = time.perf_counter()
    compiler = compiler or default_compiler()
    cache = cache or KernelCache()
    dump = env.dump_source_dir()
    source = render_source() if dump else None
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{source.name}.ptx").write_text(source.text)

    def build():
        nonlocal source
        source = source or render_source()
        cubin = compiler.compile(source.modules, arch)
        return cubin, {"name": source.name, "compiler": compiler.version,
                       "compile_seconds": time.perf_counter() - start}

    cubin, _, hit = cache.get_or_build(key, arch, build)
    return Built(cubin, source, 0.0 if hit else time.perf_counter() - start, hit)


def load_kernel(cubin: bytes, name: str, device_index: int):
    """The one loader: a cubin's entry `name` loaded on a device (runtime/driver.py)."""
    from .driver import LoadedKernel

    return LoadedKernel(cubin, name, device_index)


def plan_key(plan, compiler_version: str) -> str:
    return kernel_key("spmm", plan_spec(plan), plan.arch, compiler_version)


def compile_plan(plan, cache: KernelCache | None = None, compiler=None) -> Built:
    compiler = compiler or default_compiler()
    key = plan_key(plan, compiler.version)
    return compile_source(key, plan.arch, lambda: render(plan), cache, compiler)


def compile_sketch(plan, full_plan: Callable[[], object] | None, cache: KernelCache | None = None, compiler=None
                   ) -> tuple[Built, Callable[[], object] | None]:
    """(the cubin of `plan`, what makes its whole plan, once). plan may be a sketch (plan.sketch) where full_plan
    makes the whole plan: it is looked up by the sketch's key (the whole plan's), and the whole plan is made only
    on a miss (to render it) or when asked for later. No CUDA call: the chooser runs it in threads."""
    if not getattr(plan, "sketch", False):
        return compile_plan(plan, cache, compiler), full_plan
    if full_plan is None:
        raise ValueError("a sketch plan cannot be rendered: pass full_plan (it makes the whole plan)")
    made: list = []

    def full():
        if not made:
            made.append(full_plan())
        return made[0]

    compiler = compiler or default_compiler()
    return compile_source(plan_key(plan, compiler.version), plan.arch, lambda: render(full()), cache, compiler), full


def build_kernel(plan, device_index: int, cache: KernelCache | None = None, compiler=None,
                 built: Built | None = None, full_plan: Callable[[], object] | None = None) -> SpmmKernel:
    """Compile (or fetch from the disk cache) and load the kernel of `plan` (built: already compiled).
    plan may be a sketch (plan.sketch) when full_plan makes the whole plan: it is made only if the cache
    misses (to render it) or someone reads k.plan / k.source (compile_sketch)."""
    if built is None:
        built, full_plan = compile_sketch(plan, full_plan, cache, compiler)
    return SpmmKernel(plan, built, device_index, full_plan)
