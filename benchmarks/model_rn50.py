"""ResNet-50 end to end: torchvision's architecture and initialisation (models/resnet.py) with the
DLMC rn50 magnitude patterns, BatchNorm calibrated on random inputs, then `convert` (every conv and the FC
measured dense against the unstructured kernels; BatchNorm folded) against the dense masked model with its
BatchNorm folded too (cuDNN, cudnn.benchmark on, the faster of NCHW and channels_last), whole forward under
CUDA-graph replay; the converted model's output against the masked model in float64. Conversion seconds
(the whole model, nothing timed but what the chooser measures): cold, into an empty kernel cache (a temporary
one unless SPARSEFORGE_CACHE_DIR is set), then warm, the same model again; each split into compiling and
measuring, with its slowest layers and a profile's top functions (in the log as each ends, and the JSON).

    PYTHONPATH=src python benchmarks/model_rn50.py DLMC_RN50_SPARSITY_DIR OUT.json [--dtype float32] [--batch 1]
        [--tune-budget 2]
"""
import argparse
import cProfile
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from sparseforge.bench.profile import describe_breakdown, kernel_breakdown
from sparseforge.bench.report import finish_model_run, provenance, top_functions
from sparseforge.models import apply_dlmc_masks, calibrate_batchnorm, resnet50
from sparseforge.nn import convert, fold_batchnorms, fuse_epilogues
from sparseforge.nn.convert import model_latency_us

TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 3e-2}  # the model-output bounds, fp32 / fp16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pattern_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tune-budget", type=float, default=2.0)
    parser.add_argument("--no-fuse", action="store_true",
                        help="time the converted model as convert() leaves it (no ReLU / residual fusion)")
    parser.add_argument("--channels-last", action="store_true",
                        help="run the converted model channels_last (NHWC sparse kernels, cuDNN channels_last for "
                             "the layers kept dense); the dense baseline is the fastest layout either way")
    parser.add_argument("--dense-only", action="store_true",
                        help="measure the dense model (latency, its own error against float64) and stop")
    args = parser.parse_args()
    if "SPARSEFORGE_CACHE_DIR" not in os.environ:  # the cold conversion: an empty cache
        os.environ["SPARSEFORGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="sparseforge-cold-")
    started = time.perf_counter()
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # fp32 is fp32 on both sides
    dtype = getattr(torch, args.dtype)
    model = resnet50(seed=0).cuda()
    sparsities = apply_dlmc_masks(model, args.pattern_dir)
    calibrate_batchnorm(model, input_shape=(8, 3, 224, 224))
    x = torch.randn(args.batch, 3, 224, 224, generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(x.double())  # the masked model in float64
    dense = copy.deepcopy(model).to(dtype)
    folded = fold_batchnorms(dense)
    xd = x.to(dtype)
    dense_nchw = model_latency_us(dense, (xd,))
    # the dense model with the converted one's epilogue help too (cuDNN's fused conv + bias (+ add) + ReLU where
    # it measures faster: nn/dense_epilogue.py), so that the baseline is the fastest dense model we can build
    dense_fused, dense_fuse_report = fuse_epilogues(copy.deepcopy(dense), (xd,))
    dense_fused_nchw = model_latency_us(dense_fused, (xd,))
    del dense_fused
    channels_last = torch.channels_last
    xcl = xd.contiguous(memory_format=channels_last)
    dense_cl = model_latency_us(dense.to(memory_format=channels_last), (xcl,))
    # the fused dense baseline channels_last too: the converted model runs channels_last with its epilogues
    # fused, so the dense one is given the same chance (the 1.76x measured at 57ecb66 had only NCHW fused here)
    dense_fused_cl_model, dense_fuse_cl_report = fuse_epilogues(copy.deepcopy(dense), (xcl,))
    dense_fused_cl = model_latency_us(dense_fused_cl_model, (xcl,))
    del dense_fused_cl_model
    with torch.no_grad():  # what the dtype itself costs: the dense model's own error against float64
        dense_error = float((dense(xd).double() - reference).norm() / reference.norm())
    # stage lines as they finish: a run killed by its timeout still leaves what it measured in the log
    print(f"[{time.perf_counter() - started:6.1f} s] dense {args.dtype} batch {args.batch}: NCHW {dense_nchw:.1f} us, "
          f"channels_last {dense_cl:.1f}, NCHW fused {dense_fused_nchw:.1f}, channels_last fused {dense_fused_cl:.1f}; "
          f"rel. error {dense_error:.1e}", flush=True)
    if args.dense_only:
        args.out.write_text(json.dumps({"provenance": provenance(sys.argv), "model": "rn50",
                                        "sparsity": float(sum(sparsities.values()) / len(sparsities)),
                                        "dtype": args.dtype, "batch": args.batch, "layout": "nchw",
                                        "geomean_speedup_vs_cudnn": None,  # dense only: nothing to compare
                                        "dense_nchw_us": dense_nchw, "dense_channels_last_us":
                                        dense_cl, "dense_rel_error_vs_float64": dense_error}, indent=1))
        print(f"rn50 dense {args.dtype} batch {args.batch}: rel. error vs float64 {dense_error:.1e}")
        return 0
    sparse = copy.deepcopy(model).to(dtype)
    xs = xd
    if args.channels_last:  # every activation channels_last: SparseConv2d compiles NHWC kernels for them
        sparse, xs = sparse.to(memory_format=channels_last), xd.contiguous(memory_format=channels_last)
    conversion_s, conversion_detail = {}, {}
    for kind in ("cold", "warm"):  # the conversion alone (no whole-model timing), on a copy
        copied = copy.deepcopy(sparse)
        profiler = cProfile.Profile()  # where its seconds go (the main thread's view: compiles wait in a pool)
        profiler.enable()
        done = convert(copied, xs, tune_budget=args.tune_budget, time_model=False)
        profiler.disable()
        conversion_s[kind] = done.seconds
        slowest = sorted(done.layers, key=lambda layer: layer.seconds, reverse=True)[:8]
        conversion_detail[kind] = {
            "seconds": done.seconds, "compile_seconds": done.compile_seconds,
            "measure_seconds": sum(layer.seconds for layer in done.layers),
            "slowest_layers": [{"name": layer.name, "seconds": round(layer.seconds, 3), "mapping": layer.mapping}
                               for layer in slowest],
            "profile": top_functions(profiler, 40)}
        del copied
        print(f"[{time.perf_counter() - started:6.1f} s] conversion {kind}: {done.seconds:.1f} s (compiling "
              f"{done.compile_seconds:.1f} s, measuring {conversion_detail[kind]['measure_seconds']:.1f} s; slowest "
              + ", ".join(f"{layer.name} {layer.seconds:.1f} s" for layer in slowest[:4]) + ")", flush=True)
        for row in conversion_detail[kind]["profile"][:25]:
            print(f"    {row['cumulative_s']:8.2f} s {row['own_s']:8.2f} s {row['calls']:7d} {row['function']}",
                  flush=True)
    report = convert(sparse, xs, tune_budget=args.tune_budget, time_model=True)
    unfused_us = report.latency_after_us
    print(f"[{time.perf_counter() - started:6.1f} s] converted (unfused) {unfused_us:.1f} us", flush=True)
    fused_report = None
    if not args.no_fuse:  # each SparseConv2d takes the ReLU / shortcut add after it (nn/fuse.py)
        sparse, fused_report = fuse_epilogues(sparse, (xs,))
        report.latency_after_us = model_latency_us(sparse, (xs,))
    with torch.no_grad():
        out = sparse(xs).double()
    error = float((out - reference).norm() / reference.norm())
    # the kernels each forward launches and their device time: the part of the latency outside the layers
    # (bench/profile.py); the dense model as it ran channels_last
    profiles = {}
    for label, run, latency in (("dense channels_last", lambda: dense(xcl), dense_cl),
                                ("converted", lambda: sparse(xs), report.latency_after_us)):
        try:
            profiles[label] = kernel_breakdown(run)
            print(describe_breakdown(label, profiles[label], latency), flush=True)
        except RuntimeError as exc:  # the profiler needs CUPTI: the figure is extra, the run goes on
            profiles[label] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    dense_us = min(dense_nchw, dense_cl, dense_fused_nchw, dense_fused_cl)
    # what the layers that run sparse save, each timed alone against its own dense time in the report (an
    # estimate of sparsity's share: the rest of the speedup over dense_us is epilogue fusion and dense paths a
    # dense model could take too)
    sparse_layers = [r for r in report.layers if r.choice != "dense" and r.times_us.get("dense")
                     and r.times_us.get(r.choice)]
    saved_us = sum(r.times_us["dense"] - r.times_us[r.choice] for r in sparse_layers)
    result = {"provenance": provenance(sys.argv), "model": "rn50", "patterns": str(args.pattern_dir),
              "sparsity": float(sum(sparsities.values()) / len(sparsities)), "dtype": args.dtype, "batch": args.batch,
              "layout": "channels_last" if args.channels_last else "nchw", "dense_us": dense_us, "dense_nchw_us": dense_nchw, "dense_channels_last_us": dense_cl,
              "dense_fused_nchw_us": dense_fused_nchw, "dense_fused": [list(f) for f in dense_fuse_report.fused],
              "dense_fused_channels_last_us": dense_fused_cl,
              "dense_fused_channels_last": [list(f) for f in dense_fuse_cl_report.fused],
              "layers_sparse": len(sparse_layers), "layers": len(report.layers),
              "saved_by_sparse_layers_us": saved_us,
              # an estimate, not a measurement: what the sparse layers saved, each timed alone by convert (before
              # fusion), added back to the converted model's time, over that time
              "estimated_speedup_from_sparse_layers": (report.latency_after_us + saved_us) / report.latency_after_us,
              "sparse_us": report.latency_after_us, "speedup_vs_cudnn": dense_us / report.latency_after_us,
              "rel_error_vs_float64": error, "dense_rel_error_vs_float64": dense_error,
              # the model amplifies rounding (rn50_conditioning.py: fp16-rounded weights alone give 1.7e-2 at
              # 95%), so beside the bound: the converted error against the dense model's in the dtype
              "error_over_dense_error": error / dense_error if dense_error else None,
              "error_ok": error <= TOLERANCE[args.dtype], "batchnorms_folded_dense": len(folded.folded),
              "converted_unfused_us": unfused_us, "conversion_seconds_cold": conversion_s["cold"],
              "conversion_seconds_warm": conversion_s["warm"], "conversion": conversion_detail,
              "fused": None if fused_report is None else [list(f) for f in fused_report.fused],
              "not_fused": None if fused_report is None else [s.__dict__ for s in fused_report.skipped],
              "kernel_profile": profiles, "report": report.as_dict(), "seconds": time.perf_counter() - started}
    return finish_model_run(args.out, result, report, f"rn50 {args.dtype} batch {args.batch}: dense {dense_us:.1f} us "
                            f"(NCHW {dense_nchw:.1f}, channels_last {dense_cl:.1f}, NCHW with {len(dense_fuse_report.fused)} "
                            f"cuDNN-fused epilogues {dense_fused_nchw:.1f}, channels_last fused {dense_fused_cl:.1f}), "
                            f"converted {report.latency_after_us:.1f} us: {result['speedup_vs_cudnn']:.2f}x (unfused "
                            f"{unfused_us:.1f} us; {0 if fused_report is None else len(fused_report.fused)} layers took "
                            f"their epilogue; {len(sparse_layers)} of {len(report.layers)} layers sparse, saving "
                            f"{saved_us:.1f} us alone: ~{result['estimated_speedup_from_sparse_layers']:.2f}x of it from sparsity)")


if __name__ == "__main__":
    sys.exit(main())
