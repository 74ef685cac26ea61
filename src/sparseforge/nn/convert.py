"""Whole-model conversion: convert() (every Linear / Conv2d to the fastest of dense, unstructured and 2:4, by
measurement), to_sparse24() (2:4 Linear layers only), and preparing the decisions before CUDA graph capture."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Iterable

import torch
from torch import nn

from ..prune.targets import LayerFilter, Skipped, check_selected, select_layers
from ..semi.cusparselt import Sparse24Error, check_weight
from ..semi.decide import DENSE, MIN_SPEEDUP, SPARSE, UNSTRUCTURED, Decision
from ..ops import conv_memory_format
from ..tune.choose import TOP, TUNE_BUDGET_S, check_tune_budget, fastest_with_margin, tuning_budget
from .linear24 import SparseLinear24

CHANNELS_LAST = "channels_last"  # the tag of a channels_last input shape in convert's per-layer shapes


@dataclass
class ConversionReport:
    converted: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{len(self.converted)} Linear layers now SparseLinear24, {len(self.skipped)} left as they were"]
        lines += [f"  skipped {s.name}: {s.reason}" for s in self.skipped]
        return "\n".join(lines)


def to_sparse24(model: nn.Module, include: LayerFilter = None, exclude: LayerFilter = None,
                policy: str = "measure", min_speedup: float = MIN_SPEEDUP) -> ConversionReport:
    """Replace, in place, every nn.Linear of `model` (filtered by include / exclude: a regex on the
    qualified name or a callable (name, module) -> bool) whose weight is 2:4, float16/bfloat16 and
    16-aligned in shape by a SparseLinear24 holding the same (masked) weights. Other layers stay as they
    were, listed in the report with the reason. Prune first with sparseforge.semi.sparsify_24; cast the
    model with .half() or .to(torch.bfloat16)."""
    from ..semi.runtime import check_policy

    check_policy(policy)  # checked here too: with no 2:4 layer in the model, nothing else would look at it
    check_not_a_bare_layer(model, "to_sparse24")
    chosen, skipped = select_layers(model, include, exclude)
    report = ConversionReport(skipped=list(skipped))
    for name, module in chosen:
        if not isinstance(module, nn.Linear):
            report.skipped.append(Skipped(name, f"{type(module).__name__}: cuSPARSELt has no convolution; "
                                                "the layer stays as it is"))
            continue
        try:
            check_weight(module.weight.detach())
        except Sparse24Error as exc:
            report.skipped.append(Skipped(name, str(exc)))
            continue
        _replace(model, name, SparseLinear24.from_dense(module, policy=policy, min_speedup=min_speedup))
        report.converted.append(name)
    return report


def check_not_a_bare_layer(model, function: str) -> None:
    """Refuse a model that is itself a Linear / Conv2d: the conversions replace layers inside a model, in place,
    and no function can replace the object its caller holds (the layer would be measured, then kept)."""
    if isinstance(model, (nn.Linear, nn.Conv2d)):
        kind = type(model).__name__
        raise ValueError(f"the model is itself an nn.{kind}: {function}() replaces layers inside a model in place "
                         f"and cannot replace the object you hold; pass nn.Sequential(layer) and take [0] from it "
                         f"afterwards, or build the module directly (Sparse{'Linear' if kind == 'Linear' else 'Conv2d'}"
                         ".from_dense(layer))")


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def prepare(model: nn.Module, widths: Iterable[int], seed: int = 0) -> list[Decision]:
    """Decide now, for every SparseLinear24 and SparseLinear of `model` (on a CUDA device) and every input
    width n in `widths`, between the sparse kernels and dense (measuring on seeded random inputs), so that a
    later CUDA graph capture or latency-critical call finds every decision made. A converted LLM's
    DecodeLinears prepare their own decode widths instead (DecodeLinear.prepare: after a move or cast, what
    conversion left them), and its GatedDecodeMLPs that a move left unfused fuse again from those kernels.
    Returns the decisions."""
    import numbers

    # int() would read "16" as the widths 1 and 6, and 1.5 as 1: exact integers only
    if isinstance(widths, (str, bytes)) or not isinstance(widths, Iterable):
        raise TypeError(f"widths must be a list of input row counts such as [1, 16, 2048], got {widths!r}")
    given = list(widths)
    bad = [n for n in given if isinstance(n, bool) or not isinstance(n, numbers.Integral)]
    if bad:
        raise TypeError(f"widths must be integers (input row counts), got {bad[0]!r} in {given}")
    widths = sorted({int(n) for n in given})
    if not widths or widths[0] < 1:
        raise ValueError(f"widths must be positive input row counts, got {widths}")
    from .llm import DecodeLinear, GatedDecodeMLP  # here: nn.llm builds on this module
    from .sparse import SparseLinear

    made, decoders = [], [m for m in model.modules() if isinstance(m, DecodeLinear)]
    for layer in decoders:  # its kernel widths, its dense W released, the prefill workspace grown
        if layer.inner.device.type != "cuda":
            raise ValueError("prepare needs the model on a CUDA device: call model.cuda() first")
        layer.prepare()
        made.extend(layer.decisions)
    for mlp in model.modules():  # a move or cast unfused it (its kernels were the moved layers'): fused again
        if isinstance(mlp, GatedDecodeMLP) and not mlp.fused_widths:
            mlp.fuse()
    inside = {id(layer.inner) for layer in decoders}
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, SparseLinear):
            if module.device.type != "cuda":
                raise ValueError("prepare needs the model on a CUDA device: call model.cuda() first")
            made.extend(module.prepare(widths))
            continue
        if isinstance(module, SparseLinear24):
            made.extend(module.prepare(widths, seed))
    return made


# -- convert(): every Linear / Conv2d to the fastest of dense, unstructured and 2:4, by measurement ------------

@dataclass
class LayerReport:
    name: str
    kind: str                         # "Linear" or "Conv2d"
    weight_shape: tuple
    sparsity: float
    input_shapes: list                # the shapes the example run fed it (a channels_last one tagged so, at its end)
    choice: str                       # "dense", "unstructured" or "2:4"
    times_us: dict = field(default_factory=dict)  # path -> summed graph-replay time over input_shapes
    # path -> the sparse kernels' own summed time, where every width was measured: where a width kept dense,
    # times_us counts dense's time for it (what the module costs) and this the kernel that lost there
    kernel_us: dict = field(default_factory=dict)
    mapping: str | None = None        # the unstructured kernel's mapping, where measured
    reason: str = ""
    # per width whose kernel won under graph replay: the eager decision (host time included; where dense wins
    # there, eager calls of that width run dense: SparseLinear / SparseConv2d.eager_decisions)
    eager: list = field(default_factory=list)
    seconds: float = 0.0              # measuring this layer (the chooser's timing, and any compile it still did)

    @property
    def speedup(self) -> float | None:
        dense, chosen = self.times_us.get("dense"), self.times_us.get(self.choice)
        return dense / chosen if dense and chosen else None

    def as_dict(self) -> dict:
        return {**{k: v for k, v in self.__dict__.items()}, "speedup": self.speedup}


@dataclass
class ModelReport:
    layers: list[LayerReport] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    folded: list[tuple[str, str]] = field(default_factory=list)
    latency_before_us: float | None = None
    latency_after_us: float | None = None
    memory_before_bytes: int = 0
    memory_after_bytes: int = 0
    seconds: float = 0.0
    compile_seconds: float = 0.0      # of seconds: compiling every layer's candidates side by side, before timing

    def as_dict(self) -> dict:
        return {"layers": [layer.as_dict() for layer in self.layers],
                "skipped": [s.__dict__ for s in self.skipped], "folded": self.folded,
                "latency_before_us": self.latency_before_us, "latency_after_us": self.latency_after_us,
                "memory_before_bytes": self.memory_before_bytes, "memory_after_bytes": self.memory_after_bytes,
                "seconds": self.seconds, "compile_seconds": self.compile_seconds}

    def __str__(self) -> str:
        lines = [f"{'layer':40s} {'kind':7s} {'sparsity':>8s} {'choice':>12s} {'dense us':>9s} {'chosen us':>9s} "
                 f"{'speedup':>7s}"]
        for r in self.layers:
            dense, chosen = r.times_us.get("dense"), r.times_us.get(r.choice)
            lines.append(f"{r.name[-40:]:40s} {r.kind:7s} {r.sparsity:8.1%} {r.choice:>12s} "
                         f"{_num(dense):>9s} {_num(chosen):>9s} {_num(r.speedup, '{:.2f}x'):>7s}")
        lines.append(f"BatchNorms folded: {len(self.folded)}; layers left as they were: {len(self.skipped)}")
        if self.latency_before_us and self.latency_after_us:
            lines.append(f"whole model: {self.latency_before_us:.1f} us -> {self.latency_after_us:.1f} us "
                         f"({self.latency_before_us / self.latency_after_us:.2f}x, CUDA graph replay)")
        before, after = self.memory_before_bytes / 2**20, self.memory_after_bytes / 2**20
        lines.append(f"memory: {before:.1f} MiB -> {after:.1f} MiB; "
                     f"conversion took {self.seconds:.1f} s"
                     + (f" ({self.compile_seconds:.1f} s compiling)" if self.compile_seconds else ""))
        return "\n".join(lines)


def _num(value, spec: str = "{:.2f}") -> str:
    return "-" if value is None else spec.format(value)


def convert(model: nn.Module, example_inputs=None, dtype=None, include: LayerFilter = None,
            exclude: LayerFilter = None, policy: str = "measure", tune_budget: float | None = TUNE_BUDGET_S,
            fold_bn: bool = True, time_model: bool = True, progress=None, eager: bool = False,
            tokens=None, fuse_mlp: bool = False, memory_slack: float = 0.0) -> ModelReport:
    """Replace, in place, each nn.Linear / nn.Conv2d of `model` (include / exclude: a regex on the qualified
    name or a callable (name, module) -> bool) by the fastest of: the layer as it is (dense), SparseLinear /
    SparseConv2d (the unstructured kernels, the one chooser), SparseLinear24 (Linear layers whose weight is
    2:4 in float16 / bfloat16). policy="measure" times every candidate under CUDA-graph replay on the shapes
    `example_inputs` (a tuple of the model's positional inputs, or one tensor) feed each layer, and keeps a
    sparse one only with the chooser's margin over dense; "sparse" puts in the unstructured modules without
    timing; "dense" replaces nothing (the report still lists the layers). A layer with nothing pruned (unpruned():
    under half the lowest sparsity bucket of zeros) stays dense under every policy. A model with no Linear /
    Conv2d to convert (or include / exclude leaving none) raises NothingSelectedError. dtype: cast the model first.
    fold_bn: fold each BatchNorm2d into the Conv2d it follows (eval mode; fold.py says which pairs).
    Returns a ModelReport: per layer its shape, sparsity, choice and measured times; whole-model latency
    before and after (graph replay, time_model); memory before and after; the conversion time.
    progress: called as progress(name, index, total) before each layer is measured (a progress bar).
    eager: the unstructured modules also time each winning width called eagerly and run it dense in eager
    calls where dense is faster there (SparseLinear.measure_eager: costs the dense W beside the kernel for such
    widths; of no use to a model served under CUDA graphs).
    Afterwards nn.fuse_epilogues(model, example_inputs) fuses each sparse convolution's ReLU / shortcut add.
    A transformers causal LM (LlamaForCausalLM and its kind) takes tokens=(1, 8), the decode batch sizes, in
    place of example_inputs (given neither, tokens=(1,)): nn.llm.convert_causal_lm (progress None shows a bar there; False shows none;
    fuse_mlp: the MLPs' gate and up projections in one gated kernel where they can; memory_slack: the share of a
    layer's decode time it may give for fewer bytes of W)."""
    import time

    from .fold import fold_batchnorms
    from .llm import convert_causal_lm, is_causal_lm

    if tokens is not None or (example_inputs is None and is_causal_lm(model)):
        if example_inputs is not None:
            raise TypeError("give either tokens=(1, 8) (a transformers causal LM, converted for its decode batch "
                            "sizes) or example_inputs (any other model), not both")
        return convert_causal_lm(model, tokens=(1,) if tokens is None else tokens, dtype=dtype, include=include,
                                 exclude=exclude, policy=policy, tune_budget=tune_budget,
                                 progress=True if progress is None else progress, fuse_mlp=fuse_mlp,
                                 memory_slack=memory_slack)
    if fuse_mlp:
        raise TypeError("fuse_mlp applies to transformers causal LMs (their MLPs' gate and up projections)")
    if memory_slack != 0:
        raise TypeError("memory_slack applies to transformers causal LMs converted for their decode widths "
                        "(tokens=...): leave it out for this model")

    if policy not in ("measure", "sparse", "dense"):
        raise ValueError(f"policy must be 'measure', 'sparse' or 'dense', got {policy!r}")
    _check_convert_arguments(model, example_inputs, dtype, include, exclude, tune_budget)
    tune_budget = tuning_budget(tune_budget)  # 0 and None: the cost model's pick, as everywhere
    started = time.perf_counter()
    inputs = tuple(example_inputs) if isinstance(example_inputs, tuple) else (example_inputs,)
    if dtype is not None:
        model.to(dtype)
        inputs = tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
    on_gpu = any(p.is_cuda for p in itertools.chain(model.parameters(), model.buffers()))
    if policy == "measure" and not on_gpu:
        raise ValueError("convert(policy='measure') times the kernels on a CUDA device: move the model and "
                         "example_inputs there first (model.cuda()), or pass policy='sparse' / 'dense'")
    model.eval()
    _check_model_runs(model, inputs)
    report = ModelReport(memory_before_bytes=model_bytes(model))
    if time_model and on_gpu:
        report.latency_before_us = model_latency_us(model, inputs)
    if fold_bn and policy != "dense":  # "dense" changes nothing
        folded = fold_batchnorms(model)
        report.folded, report.skipped = folded.folded, list(folded.skipped)
    chosen, skipped = select_layers(model, include, exclude)
    report.skipped += skipped
    shapes = _input_shapes(model, inputs, [m for _, m in chosen])
    if policy == "measure":  # every layer's candidates compiled side by side first: measure_layer finds them built
        if progress is not None:
            progress("(compiling every layer's candidates)", 0, len(chosen))
        compiling = time.perf_counter()
        prebuild_layers([(m, shapes[m]) for _, m in chosen if m in shapes], tune_budget)
        report.compile_seconds = time.perf_counter() - compiling
    for index, (name, module) in enumerate(chosen):
        if progress is not None:
            progress(name, index, len(chosen))
        if module not in shapes:
            report.skipped.append(Skipped(name, "not called by the example inputs: nothing to measure"))
            continue
        measuring = time.perf_counter()
        layer, replacement = measure_layer(name, module, shapes[module], policy, tune_budget, eager)
        layer.seconds = time.perf_counter() - measuring
        report.layers.append(layer)
        if replacement is not None:
            for alias in _names_of(model, module):  # a module shared under several names: every one
                _replace(model, alias, replacement)
    report.memory_after_bytes = model_bytes(model)
    if time_model and on_gpu:
        report.latency_after_us = model_latency_us(model, inputs)
    report.seconds = time.perf_counter() - started
    return report


def _check_convert_arguments(model, example_inputs, dtype, include, exclude, tune_budget) -> None:
    """convert()'s arguments checked before the model is cast, timed or changed: a mistake found after the
    whole-model timing or BatchNorm folding would surface from deep inside, or leave the model half done."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_not_a_bare_layer(model, "convert")
    if example_inputs is None:
        raise TypeError("example_inputs is required: a tensor, or a tuple of the model's positional inputs")
    if isinstance(example_inputs, list):  # a list is one input to some models, several to others: say which
        raise TypeError("example_inputs is a list; pass a tuple of the model's positional inputs (or one tensor); "
                        "a model whose one input is a list takes (that_list,)")
    for x in example_inputs if isinstance(example_inputs, tuple) else (example_inputs,):
        if type(x).__module__ == "numpy":
            raise TypeError("example_inputs holds a numpy array; pass torch tensors (torch.from_numpy(x))")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype such as torch.float16, or None; got {dtype!r}")
    check_tune_budget(tune_budget)
    # the patterns checked, and a model with nothing to convert refused (else: a report of no layer)
    check_selected(*select_layers(model, include, exclude), include, exclude, "layer", "convert")


class ExampleInputError(ValueError):
    """The model fails on convert()'s example_inputs (the original error is the __cause__)."""


def _check_model_runs(model: nn.Module, inputs: tuple) -> None:
    """One forward on the example first: inputs the model does not take fail here, with their shapes named,
    not after the whole-model timing and BatchNorm folding, from inside the layer hooks."""
    try:
        with torch.no_grad():
            model(*inputs)
    except Exception as err:
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in inputs]
        raise ExampleInputError(f"the model fails on example_inputs {shapes} ({one_line(err)}); pass inputs the "
                                "model takes (a tuple of its positional inputs)") from err


def one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def measure_layer(name: str, module: nn.Module, input_shapes: list, policy: str, tune_budget: float | None,
                  eager: bool = False):
    """(LayerReport, the module to put in its place or None to keep it). The one place convert() times."""
    from .sparse import SparseConv2d, SparseLinear

    is_linear = isinstance(module, nn.Linear)
    kind = "Linear" if is_linear else "Conv2d"
    weight = module.weight.detach()
    sparsity = 1.0 - float(torch.count_nonzero(weight)) / max(weight.numel(), 1)
    layer = LayerReport(name, kind, tuple(weight.shape), sparsity, [list(s) for s in input_shapes], DENSE)
    if policy == "dense":
        layer.reason = "policy='dense'"
        return layer, None
    if unpruned(sparsity):  # a sparse module of it would hold W twice over and run no faster
        layer.reason = unpruned_reason(sparsity)
        return layer, None
    if not is_linear and not _padding_taken(module):
        layer.reason = "padding the sparse convolution does not take: kept dense"
        return layer, None
    unstructured_policy = "sparse" if policy == "sparse" else "measure"
    make = SparseLinear if is_linear else SparseConv2d
    try:
        sparse = make.from_dense(module, policy=unstructured_policy, tune_budget=tune_budget)
        sparse.measure_eager = eager
    except ValueError as exc:
        layer.reason = f"the sparse {kind} refuses it ({exc}): kept dense"
        return layer, None
    if policy == "sparse":
        layer.choice, layer.reason = UNSTRUCTURED, "policy='sparse'"
        return layer, sparse
    # one measurement per distinct width (Linear: tokens; Conv2d: the input shape and layout, which key a kernel)
    if is_linear:
        widths = sorted({math.prod(s[:-1]) for s in input_shapes})
        decisions = sparse.prepare(widths)
    else:
        widths = list(dict.fromkeys(input_shapes))
        nchw = [s for s in widths if s[-1] != CHANNELS_LAST]
        nhwc = [s[:-1] for s in widths if s[-1] == CHANNELS_LAST]
        if nchw:
            sparse.prepare(nchw)
        if nhwc:
            sparse.prepare(nhwc, channels_last=True)
        decisions = sparse.decisions
    layer.times_us["dense"] = _summed(decisions, "dense")
    # what the module costs: per width its kernel, or dense where dense was kept
    layer.times_us[UNSTRUCTURED] = _summed(decisions, "chosen")
    layer.kernel_us[UNSTRUCTURED] = _summed(decisions, "sparse")
    layer.eager = [d.as_dict() for d in sparse.eager_decisions]
    kernels = [k for k in sparse._paths.values() if k is not None]
    layer.mapping = kernels[0].mapping if kernels else None
    candidates = {UNSTRUCTURED: sparse}
    if is_linear:
        try:
            check_weight(weight)
        except Sparse24Error:
            pass
        else:
            semi = SparseLinear24.from_dense(module, policy="measure")
            generator = torch.Generator(device="cpu").manual_seed(0)
            made = []
            for n in widths:
                x = torch.randn(n, module.in_features, generator=generator).to(weight.device, weight.dtype)
                made += [d for d in semi.runtime().prepare(x)[0].decisions() if d.mode in ("graph", "any")]
            # The 2:4 runtime times its paths and dense itself (at decode widths, like the unstructured side,
            # with weights rotated through HBM): each 2:4 width is put on the unstructured side's scale by the
            # ratio of that width's two dense times, so the paths compare by their speedups over their own dense.
            own_dense = {d.n: d.dense_us for d in decisions}
            made = [_rescaled(d, own_dense.get(d.n)) for d in made]
            layer.times_us[SPARSE] = _summed(made, "chosen")
            layer.kernel_us[SPARSE] = _summed(made, "sparse")
            candidates[SPARSE] = semi
    measured = {path: t for path, t in layer.times_us.items() if t}
    if "dense" not in measured or len(measured) < 2:
        layer.reason = "not measured against dense: kept dense"
        return layer, None
    picked, ratio = fastest_with_margin(measured, "dense", MIN_SPEEDUP)
    layer.choice = picked
    layer.reason = (f"{picked} measured {ratio:.2f}x faster than dense" if picked != "dense" else
                    f"no sparse path {MIN_SPEEDUP:.2f}x faster than dense: kept dense")
    return layer, candidates.get(picked)


# Layers whose sparsity rounds to the same multiple of this share one measurement (nn.llm): at 32 layers of
# magnitude-pruned weights every decoder Linear of one kind has the same sparsity, so the bucket only absorbs
# rounding (per-row pruning of an odd width) and hand-edited weights. The lowest bucket is "not pruned".
SPARSITY_BUCKET = 0.05


def unpruned(sparsity: float) -> bool:
    """A weight with too few zeros to be a pruned one: its sparsity rounds to the lowest sparsity bucket (none,
    or the stray zeros of random or 16-bit-rounded weights), where no sparse path pays."""
    return round(sparsity / SPARSITY_BUCKET) == 0


def unpruned_reason(sparsity: float) -> str:
    """Why an unpruned layer stays dense, as the conversion reports say it."""
    return "nothing pruned: kept dense" if sparsity == 0 else \
        f"{sparsity:.2%} zeros, under {SPARSITY_BUCKET / 2:.1%}: not pruned, kept dense"


def _padding_taken(conv: nn.Conv2d) -> bool:
    return conv.padding_mode == "zeros" and not (isinstance(conv.padding, str) and conv.padding == "same" and
                                                 any(d * (k - 1) % 2 for d, k in zip(conv.dilation, conv.kernel_size)))


def _arch(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def prebuild_layers(layers: list, tune_budget: float | None, arch: int | None = None,
                    workers: int | None = None) -> int:
    """Compile into the disk cache the candidate kernels of every (Linear or Conv2d, its input shapes as convert
    records them) in `layers` for GPUs of compute capability `arch` (default: each layer's own GPU), the layers
    side by side in `workers` forked processes (all cores: runtime.prebuild.run_prebuilds). measure_layer then times the
    layers one by one and finds their candidates compiled: one layer's shortlist keeps only a few cores busy, so
    compiling layer after layer left most of a 16-core machine idle (ResNet-50: 120-340 s of conversion).
    Nothing is timed or loaded here. A layer the sparse modules refuse is left to measure_layer, which reports
    why; a prebuild that fails is only a missed head start (measure_layer compiles what it needs), so it warns
    and goes on. Returns the kernels compiled now. Does nothing where the disk cache is off or ptxas is missing
    (nothing would carry over)."""
    from functools import partial

    from ..conv import prebuild_conv2d
    from ..runtime.prebuild import prebuild_useful, run_prebuilds
    from ..spmm import prebuild_spmm
    from .sparse import SparseConv2d, SparseLinear

    if not prebuild_useful():
        return 0
    jobs = []  # (nonzeros, label, prebuild call): arguments made here, one layer at a time; only compiles go to the pool
    for module, entries in layers:
        conv = isinstance(module, nn.Conv2d)
        target = arch if arch is not None else _arch(module.weight.device) if module.weight.is_cuda else None
        weight = module.weight.detach()
        if target is None or conv and not _padding_taken(module) or \
                unpruned(1.0 - float(torch.count_nonzero(weight)) / max(weight.numel(), 1)):
            continue  # measure_layer keeps it dense, untimed
        try:
            sparse = (SparseConv2d if conv else SparseLinear).from_dense(module, policy="measure",
                                                                         tune_budget=tune_budget)
        except ValueError:
            continue
        kind, nnz = type(module).__name__, int(torch.count_nonzero(module.weight))
        if conv:  # the module keys its kernels by image size and layout: one prebuild for each
            seen = set()
            for entry in entries:
                tagged = entry[-1] == CHANNELS_LAST
                shape = tuple(entry[:-1] if tagged else entry)
                channels_last = tagged and shape[1] > 1 and shape[2] * shape[3] > 1  # else it runs NCHW
                if (shape[2], shape[3], channels_last) not in seen:
                    seen.add((shape[2], shape[3], channels_last))
                    arguments = sparse.kernel_args(shape, channels_last)
                    # a job a candidate: a layer's compiles (2-6 s each for large fp32 layers) run side by side,
                    # not one after another in one worker, which made the slowest layer the pool's makespan
                    jobs += [(nnz, f"{kind} {shape} #{slot}",
                              partial(prebuild_conv2d, **arguments, arch=target, slot=slot))
                             for slot in range(TOP if tune_budget is not None else 1)]
        else:
            jobs += [(nnz, f"{kind} n={n}", partial(prebuild_spmm, **sparse.kernel_args(n), arch=target))
                     for n in sorted({math.prod(s[:-1]) for s in entries})]
        del sparse  # its device buffers: the jobs hold W on the host (the module's SparseMatrix)
    # the largest layers first: where W is the code a kernel's compile grows with its nonzeros (ResNet-50's last
    # 3x3 layers: 10-15 s each), and one started last would end the pool's work alone, long after the rest
    jobs.sort(key=lambda job: -job[0])
    # forked workers: planning and rendering generated kernels is Python, serialized by one interpreter's GIL
    return run_prebuilds([(label, job) for _, label, job in jobs], workers, what="layer shapes",
                         processes=True).built


def _rescaled(decision, dense_us: float | None):
    """A 2:4 decision's times on the scale of another dense time for the same width."""
    if not (dense_us and decision.dense_us):
        return decision
    scale = dense_us / decision.dense_us
    return replace(decision, dense_us=dense_us,
                   sparse_us=None if decision.sparse_us is None else decision.sparse_us * scale)


def _summed(decisions: list, which: str) -> float | None:
    """Sum over widths of each decision's dense time ("dense"), of its sparse kernel's ("sparse") or of the
    time of the path it kept ("chosen"); None unless every width was measured."""
    total = 0.0
    for d in decisions:
        t = d.sparse_us if which == "sparse" else d.dense_us if which == "dense" or d.path == DENSE else d.sparse_us
        if not t:
            return None
        total += t
    return total or None


def _names_of(model: nn.Module, module: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules(remove_duplicate=False) if m is module and name]


def _input_shapes(model: nn.Module, inputs, modules) -> dict:
    """The input shape(s) each of `modules` sees when the model runs `inputs` (forward hooks, no grad); a
    channels_last one (which a SparseConv2d runs on an NHWC kernel of its own) as (*shape, CHANNELS_LAST)."""
    seen: dict = {}

    def hook(module, args, kwargs):
        first = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        if first is None:
            return
        shape = tuple(first.shape)
        if isinstance(module, nn.Conv2d) and conv_memory_format(first) == torch.channels_last:
            shape = (*shape, CHANNELS_LAST)
        if shape not in seen.setdefault(module, []):
            seen[module].append(shape)

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return seen


def model_bytes(model: nn.Module) -> int:
    """Parameters and buffers, plus what sparse modules hold beyond them (their kernels' copies, dense W),
    less the weights a sparse module holds in host memory (memory_bytes()['csr_host'], ['weight_host'])."""
    total = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    for module in model.modules():
        if hasattr(module, "memory_bytes"):
            extra = module.memory_bytes()
            total += extra["kernels"] + extra["dense"] - extra.get("csr_host", 0) - extra.get("weight_host", 0)
    return total


def model_latency_us(model: nn.Module, inputs) -> float:
    """One forward of the whole model under CUDA-graph replay (median); eagerly where capture fails."""
    from ..runtime.timing import TimingContention, eager_time_us, graph_time_us

    def run(_):
        return model(*inputs)

    with torch.no_grad():
        try:
            return graph_time_us(run, [None], calls_per_graph=5, repeats=15)
        except TimingContention:
            raise
        except Exception:
            torch.cuda.synchronize()
            return eager_time_us(run, [None] * 5, repeats=15)
