"""The public SpMM API: compile_spmm() and spmm(): plan every mapping, let the chooser pick, build and load."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from .dtypes import dtype_name, kernel_dtype_name
from .formats import SparseMatrix
from .formats.csr import forgets_packings
from .formats.device import DeviceCsr
from .mappings.registry import SPMM, families, family, family_of
from .plan import DEFAULT_LAYOUT, LAYOUTS, TileConfig
from .plan.plan import clusters_of, remember_clusters
from .mappings.bitmap.plan import BitmapConfig
from .mappings.csr.plan import CsrColumnsConfig, CsrConfig
from .mappings.delta_runs.plan import DeltaRunsConfig
from .mappings.split24.plan import Split24Config
from .mappings.tc_scatter.plan import TcScatterConfig
from .runtime import KernelCache, build_kernel, cache_key, default_compiler, kernel_key
from .runtime.kernel import kernel_copies, release_copies
from .tune.choose import TUNE_BUDGET_S, choose, chooser_digest, tuning_budget
from .tune.pipeline import (bias_values, checked_bias, choice_from_record, is_composite,
                            compile_candidate, config_from_record, config_record, describe, device_index,
                            plans_of, prebuild_plans, predicted_best,
                            within_compile_limit)
from .tune.space import search_space, sm_count


_LOADED: dict = {}  # spmm(): kernels kept in-process per (weight, N, dtype, layout, epilogue, device)


def _as_sparse(w) -> SparseMatrix:
    if isinstance(w, DeviceCsr):
        return w.to_host()
    return w if isinstance(w, SparseMatrix) else SparseMatrix.from_dense(w)


def _placed(w, config) -> SparseMatrix | DeviceCsr:
    """W as the plan maker takes it: a DeviceCsr stays on its device where the given config's family packs
    its arrays there (registry: device_plan; nothing is chosen or timed then, so no digest of W is needed);
    anything else becomes a host SparseMatrix."""
    if isinstance(w, DeviceCsr) and config is not None and family_of(config).device_plan is not None:
        return w
    return _as_sparse(w)


# the config families whose kernels add a residual (C = W B + bias + R) in their epilogue so far
RESIDUAL_CONFIGS = tuple(f.config_class for f in families(SPMM) if f.residual)


def _check_config(config, residual: bool, deterministic: bool) -> None:
    """A fixed config's refusals, alike for compile_spmm and prebuild_spmm."""
    if config is None:
        return
    family_of(config)  # TypeError naming the config classes
    if residual:
        _refuse_residual(config)
    if deterministic and getattr(config, "segment_nnz", 0):
        raise ValueError("deterministic=True excludes split rows (segment_nnz > 0 adds partial sums with "
                         "atomics, in no fixed order): use segment_nnz=0 or deterministic=False")


def _refuse_residual(config) -> None:
    if not family_of(config).residual:
        takes = ", ".join(f.config_class.__name__ for f in families(SPMM) if f.residual)
        raise ValueError(f"a {type(config).__name__} kernel does not add a residual yet: with residual=True "
                         f"use a {takes} (or no config: the chooser takes those)")


def _make_plan(w: SparseMatrix, n: int, dtype: str, layout: str, config, bias, relu: bool, arch: int,
               sketch: bool = False, residual: bool = False):
    """The plan of any config; sketch=True: a generated-kernel plan as counts only (for ranking)."""
    kind = family("tile") if config is None else family_of(config)
    if residual:
        _refuse_residual(config)
    if isinstance(w, DeviceCsr):  # _placed kept it on its device: the family packs there
        make = kind.hook("device_plan")
    else:
        make = kind.hook("sketch") if sketch and kind.sketch else kind.hook("plan")
    return make(w, n, dtype, layout, config, bias, relu, arch, **({"residual": True} if residual else {}))


@forgets_packings
def compile_spmm(W, n: int, dtype="float32", layout: str = DEFAULT_LAYOUT, bias=None, relu: bool = False,
                 device="cuda",
                 config: TileConfig | CsrConfig | CsrColumnsConfig | BitmapConfig | TcScatterConfig | DeltaRunsConfig
                 | Split24Config | None = None,
                 tune_budget: float | None = TUNE_BUDGET_S,
                 deterministic: bool = False, time_dense: bool = True, residual: bool = False):
    """Generate, compile (or fetch from cache) and load the fastest kernel for W among every mapping.

    W: SparseMatrix, formats.DeviceCsr (CSR tensors on the GPU: with a config whose family packs on the
    device, the kernel's arrays are made there, no nonzero crossing to the host), or a dense 2-D torch
    tensor / numpy array (M x K). n: N, the columns of B (layout
    "kn": B is K x N, C = W @ B is M x N) or the tokens of X (layout "nk": X is N x K, Y = X @ W^T is
    N x M). dtype: torch.float32 / float16 / bfloat16 (inputs and outputs; fp32 accumulation; W's values
    are rounded to dtype). bias: M values added before relu.

    The choice (tune/choose.py): the cost model ranks every candidate of tune/space.py (row groups, row
    per block, split K, the small-N kernel for n <= 64, the tensor-core tc-scatter kernel for float16 /
    bfloat16 at n <= 64, the delta-runs decode kernel for float16 / bfloat16 at n = 1); with tune_budget seconds (default TUNE_BUDGET_S, 5) the top few
    are compiled side by side and timed by CUDA-graph replay, and, with time_dense, dense cuBLAS beside
    them; the winner is cached with the kernel. tune_budget=None or 0: the cost model's pick, nothing timed.
    config: a fixed TileConfig / CsrConfig / CsrColumnsConfig / BitmapConfig / TcScatterConfig / DeltaRunsConfig
    (n <= 8) instead, or
    Split24Config (layout "nk", 16-bit: W's 2:4 part on Sparse Tensor Cores, the rest by an SpMM kernel; an
    Split24Kernel comes back; not yet in the default space: benchmarks/designs.py measures it first).
    deterministic: no atomics (bitwise-reproducible runs). residual=True: the kernel takes k(B, residual=R)
    and adds R (laid out as the output) before relu; only the kernels that read W as data (csr, csr-columns,
    bitmap, tc-scatter, delta-runs) add one so far, so the chooser picks among those.

    Returns an SpmmKernel: k(B) -> C, k(B, out=C); k.plan (k.mapping names the winner's mapping),
    k.source, k.compile_seconds (the winner's build; 0 when cached), k.tune_seconds, k.choice (every
    candidate predicted and measured; k.choice.explain()), k.dense_faster (True when cuBLAS measured faster
    than the fastest sparse kernel; both times in k.choice).
    """
    _check_config(config, residual, deterministic)
    tune_budget = tuning_budget(tune_budget)  # 0 and None: the cost model's pick
    problem = _Problem.of(_placed(W, config), n, dtype, layout, bias, relu, deterministic, residual, arch=0)  # refusals first
    index, arch = device_index(device)
    problem = dataclasses.replace(problem, arch=arch)
    w, n, name, make = problem.w, problem.n, problem.name, problem.make
    if config is not None:
        plan = make(config)
        return load_candidate(plan, None, None, index, tune_budget) if is_composite(plan) else \
            build_kernel(plan, index)
    started = time.perf_counter()
    cache = KernelCache()
    compiler = default_compiler()
    key = problem.choice_key(tune_budget, time_dense, compiler)
    known = cache.get_tuned(key, arch)
    winner = config_from_record(known) if known else None
    cached_choice = choice_from_record(known) if winner is not None else None
    if cached_choice is not None:
        remember_clusters(w, known.get("clusters"))  # the winner's row clustering, as it was computed
        if family_of(winner).render is None:  # a composite: nothing of its own compiled, R's choice cached
            kernel = load_candidate(make(winner), None, None, index, tune_budget)
        else:
            # the launch needs only the plan's counts (a sketch): the whole plan is made if the cubin is gone
            kernel = build_kernel(make(winner, sketch=True), index, full_plan=lambda: make(winner))
        kernel.choice, kernel.tuning = cached_choice, cached_choice.records
        return kernel
    space = problem.space()
    if tune_budget is None:
        plan, choice = predicted_best(make, space, started)
        kernel = build_kernel(plan, index)
        kernel.tune_seconds = choice.seconds
    else:
        kernel, choice = _measure(make, space, w, n, name, layout, index, tune_budget, time_dense, compiler)
        kernel.tune_seconds = time.perf_counter() - started - kernel.compile_seconds
    kernel.choice, kernel.tuning = choice, choice.records
    winner = kernel.config
    clusters = clusters_of(w) if getattr(winner, "cluster_rows", False) else []
    cache.put_tuned(key, arch, {**config_record(winner), "records": choice.records, "choice": choice.as_dict(),
                                "clusters": clusters})
    return kernel


def _space(w: SparseMatrix, n: int, name: str, layout: str, relu: bool, deterministic: bool,
           residual: bool = False, arch: int = 90) -> list:
    """The configs the chooser weighs for this problem on sm_<arch>: the design space (tune/space.py) within
    the compile limit; with a residual, only the kernels that add one."""
    space = within_compile_limit(search_space(n, layout, w.shape[0], w.nnz / max(w.shape[0], 1), relu,
                                              deterministic, dtype=name, sms=sm_count(arch)), w.nnz)
    if residual:
        space = [c for c in space if family_of(c).residual] or \
            [CsrConfig() if n <= 64 or layout == "nk" else CsrColumnsConfig()]
    return space


@forgets_packings
def prebuild_spmm(W, n: int, dtype="float32", layout: str = DEFAULT_LAYOUT, bias=None, relu: bool = False,
                  arch: int = 90, tune_budget: float | None = TUNE_BUDGET_S, deterministic: bool = False,
                  residual: bool = False, time_dense: bool = True, config=None) -> int:
    """Compile into the disk cache the kernels that compile_spmm with the same arguments, on a GPU of compute
    capability `arch` (90: sm_90), would compile (the shortlist its tune_budget allows; the cost model's pick
    where None), without a GPU: no timing, nothing loaded; nothing where compile_spmm would find its choice
    cached. nn.convert prebuilds all of a model's layers side by side before it measures them one by one, so the
    compiles spread over every core (one layer's shortlist keeps a few busy). Returns how many candidates were
    compiled now (0 where the toolkit's ptxas is missing: the driver's JIT compiles on the GPU, one kernel at a
    time). config: that one kernel, as compile_spmm(config=...) builds it. Refusals are compile_spmm's."""
    tune_budget = tuning_budget(tune_budget)
    problem = _Problem.of(_placed(W, config), n, dtype, layout, bias, relu, deterministic, residual, arch)
    if config is not None:  # the one kernel compile_spmm(config=...) builds
        _check_config(config, residual, deterministic)
        return prebuild_plans(problem.make, plans_of(problem.make, [config]), None)
    if KernelCache().get_tuned(problem.choice_key(tune_budget, time_dense, default_compiler()), arch) is not None:
        return 0  # compile_spmm loads the cached winner without ranking or compiling candidates
    return prebuild_plans(problem.make, plans_of(problem.make, problem.space()), tune_budget)


@dataclass(frozen=True)
class _Problem:
    """One SpMM problem as compile_spmm and prebuild_spmm both see it: W in the dtype, the checked bias, the
    candidates' space, the plan maker and the key of the cached choice."""
    w: SparseMatrix | DeviceCsr
    n: int
    name: str
    layout: str
    bias_values: object
    relu: bool
    deterministic: bool
    residual: bool
    arch: int

    @classmethod
    def of(cls, W, n, dtype, layout, bias, relu, deterministic, residual, arch) -> "_Problem":
        w = W if isinstance(W, DeviceCsr) else _as_sparse(W)  # a DeviceCsr comes through _placed
        name = kernel_dtype_name(dtype)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be 'kn' or 'nk', got {layout!r}")
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        bias_values = checked_bias(bias, w.shape[0])
        return cls(w.astype(name), int(n), name, layout, bias_values, bool(relu), bool(deterministic), bool(residual),
                   arch)

    def make(self, cfg, sketch: bool = False):
        return _make_plan(self.w, self.n, self.name, self.layout, cfg, self.bias_values, self.relu, self.arch, sketch,
                          self.residual)

    def space(self) -> list:
        return _space(self.w, self.n, self.name, self.layout, self.relu, self.deterministic, self.residual,
                      self.arch)

    def choice_key(self, tune_budget: float | None, time_dense: bool, compiler) -> str:
        """The key of the cached choice: everything that decides it, the chooser's own code included."""
        bias_tag = "none" if self.bias_values is None else cache_key(np.asarray(self.bias_values, np.float32).tobytes())
        # the choice is cached like a kernel: a second compile of the same problem skips ranking and timing
        mode = "predicted" if tune_budget is None else f"measured|budget={float(tune_budget):g}|dense={time_dense}"
        return kernel_key("choice", "|".join([self.w.digest(), str(self.n), self.name, self.layout, bias_tag,
                                              str(self.relu), str(self.deterministic), mode, chooser_digest()]
                                             + (["residual"] if self.residual else [])), self.arch, compiler.version)


@forgets_packings
def plan_spmm(W, n: int, dtype="float32", layout: str = DEFAULT_LAYOUT, bias=None, relu: bool = False,
              deterministic: bool = False, arch: int = 90):
    """The cost model's pick without a GPU: (renderable plan, Choice with every candidate predicted).
    What compile_spmm(..., tune_budget=None) builds; the CPU mode of `sparseforge bench` checks it."""
    w = _as_sparse(W).astype(kernel_dtype_name(dtype))
    name, bias_values = kernel_dtype_name(dtype), checked_bias(bias, w.shape[0])
    space = _space(w, int(n), name, layout, relu, deterministic, arch=arch)
    return predicted_best(lambda cfg, sketch=False: _make_plan(w, int(n), name, layout, cfg, bias_values, relu,
                                                                 arch, sketch), space, time.perf_counter())


def _measure(make, space, w, n, name, layout, index, budget, time_dense, compiler):
    import torch

    # graph capture and timing run on torch's current device: make it the kernel's for the whole choice
    with torch.cuda.device(index):
        return _measure_on_device(make, space, w, n, name, layout, index, budget, time_dense, compiler)


def _measure_on_device(make, space, w, n, name, layout, index, budget, time_dense, compiler):
    import torch

    from .runtime.compiler import CompileError, PtxasCompiler
    from .runtime.driver import CudaError
    from .runtime.timing import ROTATED_MAX_N, graph_time_us, l2_bytes, rotating_graph_time_us, weight_copies
    from .semi.cusparselt import Sparse24Error

    plans = plans_of(make, space)
    shape = (w.shape[1], n) if layout == "kn" else (n, w.shape[1])
    torch_dtype = getattr(torch, name)
    gen = torch.Generator(device=f"cuda:{index}").manual_seed(0)
    inputs = [torch.randn(shape, device=f"cuda:{index}", generator=gen).to(torch_dtype) for _ in range(3)]
    out_shape = (w.shape[0], n) if layout == "kn" else (n, w.shape[0])
    out = torch.empty(out_shape, device=f"cuda:{index}", dtype=torch_dtype)

    def compile_one(plan):
        return compile_candidate(make, plan, compiler)

    residual = torch.randn(out_shape, device=f"cuda:{index}", generator=gen).to(torch_dtype)

    # decode widths: every side timed with its weights rotated through HBM (runtime.timing.ROTATED_MAX_N)
    rotated = n <= ROTATED_MAX_N
    l2 = l2_bytes(index) if rotated else 0
    in_bytes = inputs[0].numel() * inputs[0].element_size()

    def operands(weights: list) -> list:
        return [(weight, inputs[i % len(inputs)]) for i, weight in enumerate(weights)]

    def load_and_time(plan, compiled):
        kernel = load_candidate(*compiled, index, budget)
        extra = {"residual": residual} if getattr(plan, "residual", False) else {}
        if not rotated:
            return kernel, graph_time_us(lambda b: kernel(b, out=out, **extra), inputs)
        copies = kernel_copies(kernel, weight_copies(kernel.weight_bytes + getattr(kernel, "code_bytes", 0)
                                                     + in_bytes, l2) - 1,
                               cubin=compiled[1].cubin if compiled[1] is not None else None)
        try:
            return kernel, rotating_graph_time_us(lambda p: p[0](p[1], out=out, **extra),
                                                  operands([kernel] + copies))
        finally:  # the graph is gone: the copies' own modules (code kernels) are unloaded, their arrays freed
            torch.cuda.synchronize()
            release_copies(copies)

    def dense_us() -> float:
        weight = w.to_torch(f"cuda:{index}")
        weights = [weight] + [weight.clone() for _ in range(weight_copies(weight.numel() * weight.element_size()
                                                                          + in_bytes, l2) - 1)] if rotated else [weight]
        if layout == "kn":
            call = lambda p: torch.mm(p[0], p[1], out=out)  # noqa: E731
        else:
            call = lambda p: torch.mm(p[1], p[0].t(), out=out)  # noqa: E731
        if rotated:
            return rotating_graph_time_us(call, operands(weights))
        return graph_time_us(lambda b: call((weight, b)), inputs)

    # ptxas runs in subprocesses, so candidates compile side by side; the driver's JIT linker runs in this
    # process on the current context, so it compiles them one at a time
    return choose(plans, describe, compile_one, load_and_time, budget,
                  parallel=isinstance(compiler, PtxasCompiler),
                  time_dense=dense_us if time_dense else None, build_errors=(CompileError, CudaError, Sparse24Error))


def compile_gated_mlp(gate, up):
    """The Llama MLP's gate and up projections in one kernel: k(X) = silu(X G^T) * (X U^T) (layout "nk"; "kn":
    silu(G B) * (U B)), from two compiled kernels of one family, problem and config (e.g. both
    compile_spmm(..., config=DeltaRunsConfig())) over their own device arrays: nothing is copied, one launch
    and one pass over X where the model makes two products and two elementwise kernels. Keep `gate` and `up`
    alive as long as the result (it reads their arrays). Families with the registry's `gated` hook only
    (delta-runs, for few tokens; bitmap-tc at N >= 8, strips=1); the kernels plain products (no bias, ReLU or
    residual)."""
    from .mappings.registry import plan_family
    from .runtime.kernel import SpmmKernel

    for name, kernel in (("gate", gate), ("up", up)):
        if not isinstance(kernel, SpmmKernel):
            raise TypeError(f"{name} must be a kernel from compile_spmm, got {type(kernel).__name__}")
    family = plan_family(up.plan)
    if plan_family(gate.plan) is not family:
        raise ValueError(f"gate is a {plan_family(gate.plan).name} kernel and up a {family.name} kernel: compile "
                         "both with one config")
    hook = family.hook("gated")
    if hook is None:
        raise ValueError(f"the {family.name} family has no gated kernel: compile gate and up with a delta-runs "
                         "config (config=DeltaRunsConfig()) or, at N >= 8, a bitmap-tc one (config=BitmapTcConfig())")
    if gate.device_index != up.device_index:
        raise ValueError(f"gate is on cuda:{gate.device_index} and up on cuda:{up.device_index}: one device")
    plan = hook(gate.plan, gate.weight_tensors, up.plan, up.weight_tensors)
    return build_kernel(plan, up.device_index)


def load_candidate(plan, built, full_plan, index: int, tune_budget: float | None = 1.0):
    """The loaded kernel of a compiled candidate (tune.pipeline.compile_candidate) on device `index`: an
    SpmmKernel, or for split-24 the composite (semi/split24.py: W24 compressed for cuSPARSELt, R's kernel chosen
    within tune_budget)."""
    if is_composite(plan):
        from .semi.split24 import build_split24_kernel

        return build_split24_kernel(plan, index, tune_budget, compile_residual=compile_spmm)
    return build_kernel(plan, index, built=built, full_plan=full_plan)


def spmm(W, B, layout: str = DEFAULT_LAYOUT, bias=None, relu: bool = False, out=None, tune_budget: float | None = None,
         deterministic: bool = False):
    """C = W @ B (layout "kn", B: [batch,] K x N) or Y = B @ W^T (layout "nk", B: [batch,] N x K) in one
    call; the kernel for (W, N, dtype, layout, epilogue, device) is compiled once and kept in-process.
    B: a CUDA tensor of float32, float16 or bfloat16 with N >= 1; out: as for SpmmKernel. B's dtype, device,
    rank and K are checked before anything is compiled; out and the rest by the kernel (SpmmKernel)."""
    import torch

    if not isinstance(B, torch.Tensor):
        raise TypeError(f"B must be a torch.Tensor, got {type(B).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'kn' or 'nk', got {layout!r}")
    dims = "K x N" if layout == "kn" else "N x K"
    if B.dim() not in (2, 3):
        raise ValueError(f"B must be 2-D or 3-D ([batch,] {dims}), got shape {tuple(B.shape)}")
    if dtype_name(B.dtype) in (None, "float64"):
        raise TypeError(f"B has dtype {B.dtype}; sparseforge kernels take torch.float32, torch.float16 or "
                        "torch.bfloat16: convert it first (B.float())")
    w = _as_sparse(W)
    k, n = (B.shape[-2], B.shape[-1]) if layout == "kn" else (B.shape[-1], B.shape[-2])
    if k != w.shape[1]:
        raise ValueError(f"B has shape {tuple(B.shape)}: {k} along K where W ({w.shape[0]} x {w.shape[1]}) has "
                         f"K = {w.shape[1]} columns; layout {layout!r} takes B as [batch,] {dims}")
    if n == 0:
        empty = f"{w.shape[0]} x 0" if layout == "kn" else f"0 x {w.shape[0]}"
        raise ValueError(f"B has shape {tuple(B.shape)}: N = 0, nothing to multiply; kernels are compiled for "
                         f"N >= 1, so skip the call (the product is an empty {empty} matrix)")
    if B.device.type != "cuda":
        raise ValueError(f"B is on {B.device}; sparseforge kernels run on a CUDA device: move it with B.cuda() "
                         "(on a CPU, sparseforge.plan.execute() computes the same product)")
    bias_tag = None if bias is None else bias_values(bias).tobytes()
    key = (w.digest(), n, str(B.dtype), layout, bias_tag, relu, str(B.device), deterministic)
    kernel = _LOADED.get(key)
    if kernel is None:
        kernel = compile_spmm(w, n, B.dtype, layout, bias, relu, B.device, tune_budget=tune_budget,
                              deterministic=deterministic)
        _LOADED[key] = kernel
    return kernel(B, out=out)
