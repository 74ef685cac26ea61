"""The public direct sparse convolution API: compile_conv2d() and compile_conv1d().

A Conv2d whose weight is sparse runs, with no im2col buffer, as one of two mappings (plan/conv.py): the
csr-columns kernel over an implicit im2col (W as data, padding by predicates; codegen/conv.py), or the
generated kernel over a zero-bordered copy of the input (every nonzero a load at a constant offset and an
FMA with its value as an immediate; codegen/ptx.py with codegen/operands.py's BorderedConvInput), in any
of the SpMM's tilings (row groups, row per block, split K, inline). Bias (folded BatchNorm), ReLU and a
residual add are fused in both. The candidates of both go through the one chooser (tune/choose.py): ranked
by the cost model, the best timed beside cuDNN (F.conv2d in the same dtype and memory layout); the choice
is cached with the kernel. Layouts: NCHW, or NHWC (torch's channels_last) for compile_conv2d.
"""
from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np

from .formats import SparseMatrix
from .formats.csr import forgets_packings
from .mappings.registry import CONV, families, family_recorded, find_family
from .plan import TileConfig
from .plan.conv import ConvGeometry, make_conv_plan
from .mappings.csr.plan import CsrColumnsConfig
from .runtime import KernelCache, cache_key, default_compiler, kernel_key
from .runtime.conv import ConvKernel, build_conv_kernel
from .dtypes import kernel_dtype_name
from .tune.pipeline import (checked_bias, compile_candidate, config_record, describe, device_index, plans_of,
                            prebuild_plans, predicted_best, within_compile_limit)
from .tune.choose import TUNE_BUDGET_S, Choice, choose, chooser_digest, tuning_budget


def _conv_weight(W, kernel_size) -> tuple[SparseMatrix, tuple[int, int]]:
    """W as the SpMM's Cout x Cin/groups*kh*kw matrix, and (kh, kw)."""
    if isinstance(W, SparseMatrix):
        if kernel_size is None:
            raise ValueError("W is a SparseMatrix (Cout x Cin/groups*kh*kw): pass kernel_size=(kh, kw) to say how "
                             "its columns split into channels and taps")
        kernel = (int(kernel_size),) * 2 if isinstance(kernel_size, (int, np.integer)) else tuple(kernel_size)
        return W, kernel
    if hasattr(W, "detach"):
        W = W.detach().cpu().float().numpy()
    array = np.asarray(W)
    if array.ndim != 4:
        raise ValueError(f"W must be a Conv2d weight (Cout x Cin/groups x kh x kw) or a SparseMatrix, got shape "
                         f"{array.shape}")
    kernel = (int(array.shape[2]), int(array.shape[3]))
    if kernel_size is not None and tuple(np.broadcast_to(kernel_size, 2)) != kernel:
        raise ValueError(f"kernel_size {kernel_size} does not match W's {kernel}")
    return SparseMatrix.from_dense(array.reshape(array.shape[0], -1)), kernel


def _candidates(geometry: ConvGeometry, w: SparseMatrix, relu: bool = False) -> list[CsrColumnsConfig | TileConfig]:
    """Every convolution family's configs (mappings/registry.py, in its order: the csr-columns kernel's, pixels
    a lane and warps an output channel, then the generated kernel's as tune/space.py proposes them for the
    SpMM of this shape), within the compile limit."""
    return within_compile_limit([c for f in families(CONV) for c in f.hook("candidates")(geometry, w, relu)], w.nnz)


def _planner(w: SparseMatrix, geometry: ConvGeometry, name: str, bias_values, relu: bool, residual: bool,
             arch: int):
    """make(config, sketch=False) -> the plan of either mapping (sketch: the generated one as counts only)."""
    def make(config, sketch: bool = False):
        return make_conv_plan(w, geometry, name, config, bias_values, relu, residual, arch, sketch)

    return make


@forgets_packings
def plan_conv2d(w: SparseMatrix, geometry: ConvGeometry, dtype: str = "float32", bias=None, relu: bool = False,
                residual: bool = False, arch: int = 90):
    """The cost model's pick without a GPU: (renderable plan, Choice with every candidate of both mappings
    predicted). What compile_conv2d(..., tune_budget=None) builds; the CPU mode of `sparseforge bench conv`
    checks it."""
    name = kernel_dtype_name(dtype)
    w = w.astype(name)
    make = _planner(w, geometry, name, checked_bias(bias, w.shape[0]), relu, residual, arch)
    return predicted_best(make, _candidates(geometry, w, relu), time.perf_counter())


def _conv_problem(W, input_shape, stride, padding, dilation, groups, dtype, bias, layout, kernel_size):
    """(W as a matrix in the dtype, the geometry, the dtype's name, the bias values), refusing with the problem
    named what no candidate could take."""
    name = kernel_dtype_name(dtype)
    w, kernel = _conv_weight(W, kernel_size)
    geometry = ConvGeometry.of(input_shape, w.shape[0], kernel, stride, padding, dilation, groups, layout)
    if tuple(w.shape) != geometry.weight_shape:
        raise ValueError(f"W is {w.shape[0]} x {w.shape[1]} as a matrix; input_shape {tuple(input_shape)} with "
                         f"groups = {groups} and a {kernel[0]} x {kernel[1]} kernel needs Cout x "
                         f"{geometry.weight_shape[1]} (Cin/groups x kh x kw = {geometry.channels // groups} x "
                         f"{kernel[0]} x {kernel[1]})")
    bias_values = checked_bias(bias, w.shape[0])
    return w.astype(name), geometry, name, bias_values


@forgets_packings
def prebuild_conv2d(W, input_shape, stride=1, padding=0, dilation=1, groups: int = 1, dtype="float32", bias=None,
                    relu: bool = False, residual: bool = False, layout: str = "nchw", arch: int = 90,
                    kernel_size=None, tune_budget: float | None = TUNE_BUDGET_S, time_dense: bool = True,
                    slot: int | None = None) -> int:
    """Compile into the disk cache the kernels compile_conv2d with the same arguments, on a GPU of compute
    capability `arch`, would compile, without a GPU (spmm.prebuild_spmm says why and what it returns).
    slot: only the slot-th of them (tune.pipeline.prebuild_plans)."""
    tune_budget = tuning_budget(tune_budget)
    w, geometry, name, bias_values = _conv_problem(W, input_shape, stride, padding, dilation, groups, dtype, bias,
                                                   layout, kernel_size)
    if KernelCache().get_tuned(_choice_key(w, geometry, name, bias_values, relu, residual, tune_budget, time_dense,
                                           arch, default_compiler()), arch) is not None:
        return 0  # compile_conv2d loads the cached winner without ranking or compiling candidates
    make = _planner(w, geometry, name, bias_values, relu, residual, arch)
    return prebuild_plans(make, plans_of(make, _candidates(geometry, w, relu)), tune_budget, slot)


def _choice_key(w: SparseMatrix, geometry: ConvGeometry, name: str, bias_values, relu: bool, residual: bool,
                tune_budget: float | None, time_dense: bool, arch: int, compiler) -> str:
    """The key of compile_conv2d's cached choice."""
    bias_tag = "none" if bias_values is None else cache_key(np.asarray(bias_values, np.float32).tobytes())
    mode = "predicted" if tune_budget is None else f"measured|budget={float(tune_budget):g}|dense={time_dense}"
    # the batch is in the key: the kernel takes any batch, but the best config depends on it
    return kernel_key("conv-choice", "|".join([w.digest(), geometry.short(), geometry.layout, f"b{geometry.batch}",
                                               name, bias_tag, str(relu), str(residual), mode, "csr-columns+generated",
                                               chooser_digest()]), arch, compiler.version)


@forgets_packings
def compile_conv2d(W, input_shape, stride=1, padding=0, dilation=1, groups: int = 1, dtype="float32", bias=None,
                   relu: bool = False, residual: bool = False, layout: str = "nchw", device="cuda",
                   kernel_size=None, config: CsrColumnsConfig | TileConfig | None = None,
                   tune_budget: float | None = TUNE_BUDGET_S, time_dense: bool = True) -> ConvKernel:
    """Compile (or fetch from the cache) and load the fastest direct convolution for a sparse Conv2d.

    W: the Conv2d weight (Cout x Cin/groups x kh x kw; torch tensor or numpy array, zeros where pruned), or a
    SparseMatrix over Cout x (Cin/groups*kh*kw) in torch's (ci, r, s) order with kernel_size=(kh, kw).
    input_shape: (batch, Cin, H, W); the kernel takes any batch up to 65535 of that image size. stride,
    padding, dilation: an int or a pair; groups as in torch (depthwise: groups = Cin). dtype: float32,
    float16, bfloat16 (fp32 accumulation). bias: Cout values (a folded BatchNorm's shift); relu; residual:
    the kernel takes residual= and adds it before the ReLU (ResNet's shortcut). layout: how x, the output
    and residual lie in memory, "nchw" (NCHW-contiguous; a 3-D x without batch is taken too) or "nhwc"
    (4-D tensors contiguous in torch.channels_last; the output is allocated so; a 3-D x is refused, as torch
    has no channels_last for it). In nhwc the csr-columns kernel reads x where it lies (its loads across a
    warp are Cin elements apart) and the generated one reads the NCHW zero-bordered copy it makes anyway
    (the copy transposes) and stores NHWC; the chooser times both on channels_last tensors, and cuDNN on a
    channels_last input and weight. tune_budget: seconds for timing the candidates (None: the cost model's
    pick); time_dense: time cuDNN beside them (k.choice.dense_us, k.choice.dense_faster). config: a fixed mapping,
    a CsrColumnsConfig (columns 1 or 2: the csr-columns kernel) or a TileConfig (the generated kernel over
    the zero-bordered input, in that tiling; its vec is cut to what the geometry allows). k.mapping names
    the kernel's mapping ("conv-csr-columns", "conv-row-groups", "conv-row-per-block", "conv-split-k",
    "conv-inline")."""
    if config is not None:
        _check_config(config)
    tune_budget = tuning_budget(tune_budget)  # 0 and None: the cost model's pick
    w, geometry, name, bias_values = _conv_problem(W, input_shape, stride, padding, dilation, groups, dtype, bias,
                                                   layout, kernel_size)
    index, arch = device_index(device, "compile_conv2d", "sparseforge.plan.conv.execute_conv()")
    make = _planner(w, geometry, name, bias_values, relu, residual, arch)
    if config is not None:
        return build_conv_kernel(make(config, sketch=True), index, full_plan=lambda: make(config))
    started = time.perf_counter()
    cache, compiler = KernelCache(), default_compiler()
    key = _choice_key(w, geometry, name, bias_values, relu, residual, tune_budget, time_dense, arch, compiler)
    known = cache.get_tuned(key, arch)
    cached = _cached(known)
    if cached is not None:
        winner, choice = cached
        try:  # the launch needs only the plan's counts (a sketch): the whole plan is made if the cubin is gone
            kernel_obj = build_conv_kernel(make(winner, sketch=True), index, full_plan=lambda: make(winner))
        except (ValueError, RuntimeError):  # a record this version cannot build: choose again
            kernel_obj = None
        if kernel_obj is not None:
            kernel_obj.choice, kernel_obj.tuning = choice, choice.records
            return kernel_obj
    # spmm's filters: a config the problem refuses (split K with a residual, say) is dropped, and so is one
    # whose compile the cost model puts past COMPILE_LIMIT_S
    space = _candidates(geometry, w, relu)
    if tune_budget is None:
        plan, choice = predicted_best(make, space, started)
        kernel_obj = build_conv_kernel(plan, index)
    else:
        kernel_obj, choice = _measure(make, plans_of(make, space), geometry, w, name, index, tune_budget, time_dense,
                                      compiler)
        kernel_obj.tune_seconds = time.perf_counter() - started - kernel_obj.compile_seconds
    kernel_obj.choice, kernel_obj.tuning = choice, choice.records
    cache.put_tuned(key, arch, {**config_record(kernel_obj.config), "records": choice.records,
                                "choice": choice.as_dict()})
    return kernel_obj


def _check_config(config) -> None:
    """ValueError unless a convolution family takes `config` and its own check passes."""
    family = find_family(config, CONV)
    if family is None:
        names = " or a ".join(f.config_class.__name__ for f in families(CONV))
        raise ValueError(f"config must be a {names}, got {config!r}")
    if family.check is not None:
        family.hook("check")(config)


def _cached(record) -> tuple[CsrColumnsConfig | TileConfig, Choice] | None:
    """(winner, choice) of a cached record, or None when it is not a whole one (then it is made again). A
    record without a family is the csr-columns kernel's (made before the generated mapping joined)."""
    try:
        family = family_recorded(record.get("family", "csr-columns"), CONV)
        if family is None:
            return None
        kind = family.config_class
        defaults, fields = asdict(kind()), record["config"]
        if set(fields) - set(defaults) or \
                any(type(v) is not type(defaults[k]) for k, v in fields.items()):  # 2.0 == 2 would pass the checks
            return None
        config = kind(**fields)
        if family.check is not None:
            family.hook("check")(config)
        return config, Choice.from_dict(record["choice"])
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return None


def _measure(make, plans, geometry: ConvGeometry, w: SparseMatrix, name: str, index: int, budget: float,
             time_dense: bool, compiler):
    import torch
    import torch.nn.functional as F

    from .runtime.compiler import CompileError, PtxasCompiler
    from .runtime.driver import CudaError
    from .runtime.timing import graph_time_us

    with torch.cuda.device(index):
        torch_dtype = getattr(torch, name)
        # inputs, residual, output and cuDNN's weight in the kernel's layout: the times are of what a caller runs
        memory = torch.channels_last if geometry.layout == "nhwc" else torch.contiguous_format
        gen = torch.Generator(device=f"cuda:{index}").manual_seed(0)
        inputs = [torch.randn(geometry.input_shape, device=f"cuda:{index}", generator=gen).to(torch_dtype,
                                                                                                memory_format=memory)
                  for _ in range(3)]
        residual = torch.randn(geometry.output_shape, device=f"cuda:{index}", generator=gen).to(torch_dtype,
                                                                                                 memory_format=memory)
        out = torch.empty(geometry.output_shape, device=f"cuda:{index}", dtype=torch_dtype, memory_format=memory)

        def compile_one(plan):
            return compile_candidate(make, plan, compiler)

        def load_and_time(plan, compiled):
            launch, built, full_plan = compiled
            kernel = ConvKernel(launch, built, index, full_plan)
            extra = {"residual": residual} if plan.residual else {}
            return kernel, graph_time_us(lambda x: kernel(x, out=out, **extra), inputs)

        def dense_us() -> float:
            """cuDNN as the bench times it (bench/conv.py): TF32 off, benchmark on, flags restored; in the
            kernel's layout (channels_last input and weight for nhwc: cuDNN's NHWC kernels)."""
            weight = torch.from_numpy(w.to_dense().reshape(geometry.out_channels, geometry.channels // geometry.groups,
                                                           *geometry.kernel)).to(f"cuda:{index}", torch_dtype)
            weight = weight.contiguous(memory_format=memory)
            flags = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32)
            torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = True, False
            try:
                return graph_time_us(lambda x: F.conv2d(x, weight, None, geometry.stride, geometry.padding,
                                                        geometry.dilation, geometry.groups), inputs)
            finally:
                torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = flags

        return choose(plans, describe, compile_one, load_and_time, budget,
                      parallel=isinstance(compiler, PtxasCompiler), time_dense=dense_us if time_dense else None,
                      build_errors=(CompileError, CudaError))


class Conv1dKernel:
    """A 1-D convolution ([batch,] Cin x L -> [batch,] Cout x L_out) as a Conv2d over 1 x L images."""

    def __init__(self, kernel: ConvKernel):
        self.conv2d = kernel

    def __getattr__(self, name):  # plan, source, choice, compile_seconds, ...: the Conv2d kernel's
        return getattr(self.conv2d, name)

    def __call__(self, x, out=None, residual=None):
        """x: [batch,] Cin x L; out, residual: [batch,] Cout x L_out (the same checks as the Conv2d kernel)."""
        import torch

        for what, t in (("x", x), ("out", out), ("residual", residual)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
            if t is not None and t.dim() not in (2, 3):
                raise ValueError(f"{what} has shape {tuple(t.shape)}, expected [batch,] channels x length")

        def lift(t):  # a view with H = 1: contiguity and memory are x's own
            return None if t is None else t.unsqueeze(-2)

        result = self.conv2d(lift(x), out=lift(out), residual=lift(residual))
        return out if out is not None else result.squeeze(-2)


def _single(value, name: str):
    """An int, or None; nn.Conv1d keeps stride, padding and dilation as 1-tuples: those unwrap."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if value is None or (isinstance(value, (int, np.integer)) and not isinstance(value, bool)):
        return None if value is None else int(value)
    raise TypeError(f"{name} must be an int (or a 1-tuple, as nn.Conv1d keeps it), got {value!r}")


def compile_conv1d(W, input_shape, stride: int = 1, padding: int = 0, dilation: int = 1, groups: int = 1,
                   dtype="float32", bias=None, relu: bool = False, residual: bool = False, device="cuda",
                   kernel_size=None, config: CsrColumnsConfig | TileConfig | None = None,
                   tune_budget: float | None = TUNE_BUDGET_S, time_dense: bool = True) -> Conv1dKernel:
    """compile_conv2d for a Conv1d: W is Cout x Cin/groups x k (or a SparseMatrix with kernel_size=k);
    input_shape (batch, Cin, L). The text CNN of Kim's sentence classifier (CNN-non-static): Cin = 300, L = 64, k = 3, 4, 5."""
    stride, padding, dilation, kernel_size = (_single(v, name) for v, name in ((stride, "stride"), (padding, "padding"),
                                                                               (dilation, "dilation"),
                                                                               (kernel_size, "kernel_size")))
    if isinstance(W, SparseMatrix):
        if kernel_size is None:
            raise ValueError("W is a SparseMatrix (Cout x Cin/groups*k): pass kernel_size=k")
        W2, size = W, (1, kernel_size)
    else:
        array = W.detach().cpu().float().numpy() if hasattr(W, "detach") else np.asarray(W)
        if array.ndim != 3:
            raise ValueError(f"W must be a Conv1d weight (Cout x Cin/groups x k) or a SparseMatrix, got shape "
                             f"{array.shape}")
        if kernel_size is not None and kernel_size != array.shape[2]:
            raise ValueError(f"kernel_size {kernel_size} does not match W's {array.shape[2]}")
        W2, size = array[:, :, None, :], None
    shape = tuple(input_shape)
    if len(shape) != 3:
        raise ValueError(f"input_shape must be (batch, channels, length), got {input_shape!r}")
    kernel = compile_conv2d(W2, (shape[0], shape[1], 1, shape[2]), (1, stride), (0, padding), (1, dilation), groups,
                            dtype, bias, relu, residual, "nchw", device, size, config, tune_budget, time_dense)
    return Conv1dKernel(kernel)
