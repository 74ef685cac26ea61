"""Convolution cases (suite/conv.py) for `sparseforge bench conv:...`: on the GPU, compile_conv2d's kernel
against cuDNN (F.conv2d in the same dtype, TF32 off, cudnn.benchmark on, the faster of NCHW and
channels_last), both timed by graph replay in this process, every output checked against float64 into a
NaN-poisoned buffer; without a GPU, the cost model's pick, its PTX assembled, and the plan's own reference
executor checked against torch's float64 conv2d on a cropped image. layout "nhwc": the kernel compiled for
channels_last tensors and called on them."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..suite.conv import ConvCase
from .gpu import TOLERANCE, relative_error

CROP = 12  # CPU mode checks the plan on images cropped to at most this many rows and columns


def _record(case: ConvCase, dtype_name: str, w, layout: str) -> dict:
    g = case.geometry
    return {"case": case.name, "model": case.model, "sparsity": case.sparsity, "layer": case.layer,
            "dtype": dtype_name, "layout": layout, "batch": g.batch, "input_shape": list(g.input_shape),
            "output_shape": list(g.output_shape), "kernel": list(g.kernel), "stride": list(g.stride),
            "padding": list(g.padding), "groups": g.groups, "M": w.shape[0], "K": w.shape[1],
            "N": g.out_height * g.out_width, "nnz": w.nnz}


def conv_kernel_args(case: ConvCase, dtype_name: str, tune_budget: float | None, seed: int = 0,
                     layout: str = "nchw") -> dict:
    """What run_conv_case's compile_conv2d and prebuild_conv_case's prebuild_conv2d take, alike (their cache
    keys match only if every argument does)."""
    g = case.geometry
    return {"W": case.load(seed=seed, dtype=dtype_name), "input_shape": g.input_shape, "stride": g.stride,
            "padding": g.padding, "dilation": g.dilation, "groups": g.groups, "dtype": dtype_name, "layout": layout,
            "kernel_size": g.kernel, "tune_budget": tune_budget}


def prebuild_conv_case(case: ConvCase, dtype_name: str, tune_budget: float | None, arch: int, seed: int = 0,
                       layout: str = "nchw") -> int:
    """Compile into the disk cache, without a GPU, the kernels run_conv_case with the same arguments will compile
    on an sm_`arch` GPU (conv.prebuild_conv2d); how many."""
    from ..conv import prebuild_conv2d

    return prebuild_conv2d(**conv_kernel_args(case, dtype_name, tune_budget, seed, layout), arch=arch)


def run_conv_case(case: ConvCase, dtype_name: str, tune_budget: float | None, seed: int = 0,
                  layout: str = "nchw") -> dict:
    from ..conv import compile_conv2d

    arguments = conv_kernel_args(case, dtype_name, tune_budget, seed, layout)
    kernel = compile_conv2d(**arguments)
    return _check_and_time(case, kernel, arguments["W"], dtype_name, tune_budget, seed, layout)


def _check_and_time(case: ConvCase, kernel, w, dtype_name: str, tune_budget: float | None, seed: int,
                    layout: str) -> dict:
    """The record of a compiled case: its output checked against float64, its time beside cuDNN's."""
    import torch
    import torch.nn.functional as F

    from ..runtime.timing import graph_time_us

    g = case.geometry
    dtype = getattr(torch, dtype_name)
    memory = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    inputs = [torch.randn(g.input_shape, device="cuda", generator=gen).to(dtype, memory_format=memory)
              for _ in range(4)]
    dense = torch.from_numpy(w.to_dense().reshape(g.out_channels, g.channels // g.groups, *g.kernel)).cuda()
    out = torch.full(g.output_shape, float("nan"), device="cuda", dtype=dtype).contiguous(memory_format=memory)
    kernel(inputs[0], out=out)
    ref = F.conv2d(inputs[0].double(), dense.double(), None, g.stride, g.padding, g.dilation, g.groups)
    error = relative_error(out, ref)
    record = {**_record(case, dtype_name, w, layout), "rel_error": error, "error_ok": error <= TOLERANCE[dtype_name],
              "mapping": kernel.mapping, "config": kernel.plan.config.short(), "registers": kernel.registers,
              "compile_seconds": kernel.compile_seconds, "tune_seconds": kernel.tune_seconds,
              "tune_budget": tune_budget, "cache_hit": kernel.cache_hit}
    if kernel.choice is not None:
        record["choice"] = kernel.choice.as_dict()
        record["dense_faster"] = kernel.choice.dense_faster
    buffer = torch.empty(g.output_shape, device="cuda", dtype=dtype, memory_format=memory)
    record["sparseforge_us"] = graph_time_us(lambda x: kernel(x, out=buffer), inputs)
    record.update(_cudnn_times(dense.to(dtype), inputs, g))
    record["speedup_vs_cudnn"] = record["cudnn_us"] / record["sparseforge_us"]
    return record


def _cudnn_times(weight, inputs, g) -> dict:
    """cuDNN in NCHW and channels_last (TF32 off, benchmark on), whatever the kernel's layout; cudnn_us is the
    faster."""
    import torch
    import torch.nn.functional as F

    from ..runtime.timing import graph_time_us

    flags = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = True, False
    try:
        call = lambda w: lambda x: F.conv2d(x, w, None, g.stride, g.padding, g.dilation, g.groups)  # noqa: E731
        nchw = graph_time_us(call(weight.contiguous()), [x.contiguous() for x in inputs])
        last = [x.to(memory_format=torch.channels_last) for x in inputs]
        nhwc = graph_time_us(call(weight.to(memory_format=torch.channels_last)), last)
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = flags
    return {"cudnn_nchw_us": nchw, "cudnn_channels_last_us": nhwc, "cudnn_us": min(nchw, nhwc),
            "cudnn_layout": "nchw" if nchw <= nhwc else "channels_last"}


def run_conv_case_cpu(case: ConvCase, dtype_name: str, assemble: bool = True, layout: str = "nchw") -> dict:
    """The cost model's pick for the real geometry, its PTX assembled; the plan checked against torch's
    float64 conv2d on the same layer over an image cropped to CROP x CROP (the packed offsets depend on the
    image size, so the crop is planned again)."""
    import torch
    import torch.nn.functional as F

    from ..codegen import render
    from ..conv import plan_conv2d
    from ..plan.conv import ConvGeometry, execute_conv, make_conv_plan
    from ..runtime import PtxasCompiler

    started = time.perf_counter()
    g = dataclasses.replace(case.geometry, layout=layout)
    w = case.load(dtype=dtype_name)
    plan, choice = plan_conv2d(w, g, dtype_name)
    records = choice.records
    crop = ConvGeometry.of((1, g.channels, min(g.height, CROP), min(g.width, max(CROP, g.kernel[1]))),
                           g.out_channels, g.kernel, g.stride, g.padding, g.dilation, g.groups, layout)
    small = make_conv_plan(w, crop, dtype_name, plan.config)
    x = np.random.default_rng(0).standard_normal(crop.input_shape)
    dense = w.to_dense().reshape(g.out_channels, g.channels // g.groups, *g.kernel).astype(np.float64)
    ref = F.conv2d(torch.from_numpy(x), torch.from_numpy(dense), None, g.stride, g.padding, g.dilation,
                   g.groups).numpy()
    if layout == "nhwc":  # execute_conv takes and returns the layout's memory order
        got = execute_conv(small, x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    else:
        got = execute_conv(small, x)
    error = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300))
    record = {**_record(case, dtype_name, w, layout), "mapping": plan.mapping, "config": plan.config.short(),
              "predicted_us": min(r["predicted_us"] for r in records), "choice": records,
              "reference_rel_error": error, "error_ok": error <= 1e-9, "plan_seconds": time.perf_counter() - started}
    if assemble:
        start = time.perf_counter()
        PtxasCompiler.available().compile(render(plan).modules, plan.arch)
        record["assemble_seconds"] = time.perf_counter() - start
    return record
