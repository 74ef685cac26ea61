"""The chooser pipeline that every compiled operator shares (SpMM, convolution, the model layer): the problem's
checks (device, bias), the candidates' plans within the compile limit, their descriptions and the cost model's
pick, prebuilding the shortlist into the disk cache, compiling and loading one candidate, and the record a
cached choice is kept as. compile_spmm (spmm.py) and compile_conv2d (conv.py) are its two callers."""
from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np

from ..codegen import render
from ..mappings.registry import CONV, SPMM, families, family_of, family_recorded, find_family, plan_family
from ..plan.plan import fp32_bias
from ..runtime import compile_plan, compile_sketch, default_compiler
from ..runtime.kernel import compile_source, plan_key
from .choose import Choice, rank, to_compile
from .cost import estimate


def device_index(device, caller: str = "compile_spmm", reference: str = "sparseforge.plan.execute()"
                 ) -> tuple[int, int]:
    """(ordinal, arch) of a CUDA device, with clear errors for no GPU or a GPU older than sm_80."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}; sparseforge kernels run on NVIDIA GPUs")
    if not torch.cuda.is_available():
        raise RuntimeError(f"no CUDA GPU is available: {caller} needs an NVIDIA GPU (sm_80 or newer); "
                           f"on a CPU use {reference} as the reference")
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device {device} does not exist: this machine has {count} CUDA device"
                         f"{'s' if count > 1 else ''} (cuda:0{f' .. cuda:{count - 1}' if count > 1 else ''})")
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 0):
        raise RuntimeError(f"GPU {torch.cuda.get_device_name(index)} is sm_{major}{minor}; sparseforge needs "
                           "sm_80 (Ampere) or newer")
    return index, major * 10 + minor


def bias_values(bias):
    if bias is None:
        return None
    if hasattr(bias, "detach"):
        bias = bias.detach().float().cpu().numpy()
    return np.asarray(bias, dtype=np.float64)


def checked_bias(bias, m: int):
    """bias as the fp32 values kernels add, refused here with the problem named: every candidate plan
    would refuse it alike, leaving the chooser nothing to pick from."""
    return fp32_bias(bias_values(bias), m)


# config classes by the name a cached choice records them under (mappings/registry.py)
CONFIG_FAMILIES = {f.choice_name: f.config_class for f in families(SPMM)}


def config_record(config) -> dict:
    family = find_family(config) or family_of(config, CONV)
    return {"family": family.choice_name, "config": asdict(config)}


def is_composite(plan) -> bool:
    """A composite family's plan (split-24): built from other families' kernels, nothing generated of its own."""
    return plan_family(plan).render is None


def choice_from_record(record: dict) -> Choice | None:
    """The cached Choice, or None when the record does not hold a whole one (then the choice is made again)."""
    try:
        return Choice.from_dict(record["choice"])
    except (KeyError, TypeError, ValueError, IndexError):
        return None


def config_from_record(record: dict):
    """The config a cached choice names, or None when the record is not one this version can rebuild."""
    try:
        return family_recorded(record["family"]).config_class(**record["config"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


# Candidates whose cold compile the cost model puts over this are not proposed (per-nonzero code for
# millions of nonzeros: a 1.7M-nonzero layer took 44 s); the small-N kernel and smaller tilings remain.
COMPILE_LIMIT_S = 60.0


def _compile_seconds(config):
    """The predicted-compile hook of the config's family (an SpMM or a convolution config), or None where its
    compile does not grow with W."""
    return (find_family(config) or family_of(config, CONV)).hook("compile_seconds")


def within_compile_limit(space: list, nnz: int) -> list:
    """The configs whose kernels the cost model does not put over COMPILE_LIMIT_S to compile, judged from W's
    nonzero count before any plan is made (sketching a generated candidate of a 29M-nonzero LLM layer costs
    seconds of host time, only to be dropped); all of them if none would stay."""
    fits = [c for c in space if (seconds := _compile_seconds(c)) is None or seconds(c, nnz) <= COMPILE_LIMIT_S]
    return fits or space


def prebuild_plans(make, plans: list, tune_budget: float | None, slot: int | None = None) -> int:
    """Compile (into the disk cache) the candidates among `plans` that the chooser would compile: the shared
    half of prebuild_spmm and prebuild_conv2d. A candidate that fails to compile is left to the chooser,
    which records the failure. slot: only the slot-th of them in the chooser's order (none past the last), so
    that a pool runs one problem's compiles side by side, not one after another."""
    from ..runtime.compiler import CompileError, PtxasCompiler

    if slot is not None and (isinstance(slot, bool) or not isinstance(slot, int) or slot < 0):
        raise ValueError(f"slot must be a candidate's place in the chooser's order (an int >= 0) or None, got "
                         f"{slot!r}")
    compiler = default_compiler()
    if not isinstance(compiler, PtxasCompiler):
        return 0
    records = [describe(p) for p in plans]
    picked = [rank([r["predicted_us"] for r in records])[0]] if tune_budget is None else \
        to_compile(records, tune_budget)
    from ..runtime.prebuild import stop_requested

    if slot is not None:
        picked = picked[slot:slot + 1]
    built = 0
    for i in picked:
        plan = plans[i]
        if stop_requested():  # Ctrl-C: the ptxas it killed was this job's; start no other
            break
        if is_composite(plan):  # nothing of its own to compile
            continue
        try:  # looked up by the sketch's key (the whole plan's): a hit makes no plan and renders nothing
            built += not compile_source(plan_key(plan, compiler.version), plan.arch,
                                        lambda plan=plan: render(renderable(make, plan)), compiler=compiler).hit
        except CompileError:
            continue
    return built


def plans_of(make, space) -> list:
    """Plans (generated kernels as sketches) of the configs that apply (a config that does not fit the
    problem is dropped), without those whose compile would blow COMPILE_LIMIT_S (unless none would stay)."""
    plans, refusals = [], []
    for cfg in space:
        try:
            plans.append(make(cfg, sketch=True))
        except ValueError as exc:
            refusals.append(exc)
    if not plans and refusals:
        raise refusals[0]  # what every candidate refused (the problem, not the configs): say so, not IndexError
    fits = [p for p in plans if estimate(p).compile_s <= COMPILE_LIMIT_S]
    return fits or plans


def predicted_best(make, space, started: float):
    plans = plans_of(make, space)
    choice = Choice([describe(p) for p in plans])
    choice.winner = rank([r["predicted_us"] for r in choice.records])[0]
    plan = renderable(make, plans[choice.winner])
    choice.seconds = time.perf_counter() - started
    return plan, choice


def renderable(make, plan):
    return make(plan.config) if getattr(plan, "sketch", False) else plan


def describe(plan) -> dict:
    e = estimate(plan)
    return {"label": plan.config.short(), "mapping": plan.mapping, "predicted_us": e.us, **config_record(plan.config),
            **{k: v for k, v in e.as_dict().items() if k != "predicted_us"}}


def compile_candidate(make, plan, compiler=None):
    """(the plan a launch reads, its compiled cubin, what makes the whole plan or None) of a candidate: what the
    chooser compiles, in a thread (no CUDA call). A generated candidate ranked as a sketch is looked up by the
    sketch's key, and its whole plan is made only where the cache misses (to render it) or something reads
    k.plan: a prebuilt candidate is loaded and timed without it (a large layer's whole plan takes 0.1-0.7 s of
    Python). A split-24 candidate compiles nothing of its own (R's kernel is chosen when it is loaded): None."""
    if getattr(plan, "sketch", False):
        return (plan, *compile_sketch(plan, lambda: make(plan.config), compiler=compiler))
    return plan, None if is_composite(plan) else compile_plan(plan, compiler=compiler), None
