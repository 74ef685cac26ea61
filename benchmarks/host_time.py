"""Eager host time per layer call (target: <= 1.2x that of the dense F.linear / F.conv2d call on the
same machine): the CPU microseconds a call takes to issue (checks, allocation, launch), measured with the
stream held by a spin kernel so that no call waits for the GPU (runtime/timing.py host_time_us). For each
case: the module (SparseLinear / SparseConv2d with its kernel forced, policy 'sparse'), the raw kernel call
(k(x): the kernel's own checks and launch), the torch.library op where the module has one, and the dense call
on the same input, side by side in one process; the GPU time of both under graph replay beside them.

    PYTHONPATH=src python benchmarks/host_time.py OUT.json [--dtype float16]
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from sparseforge.bench.report import provenance
from sparseforge.nn import SparseConv2d, SparseLinear
from sparseforge.runtime.timing import graph_time_us, host_time_us

# (name, kind, weight shape, input shape, density): MiniLM's projections at 128 tokens, a Llama decode
# projection at one token, ResNet-50's 3x3 and 1x1 layers at batch 1
CASES = [
    ("minilm_qkv_128", "linear", (384, 384), (128, 384), 0.2),
    ("minilm_ffn_up_128", "linear", (1536, 384), (128, 384), 0.2),
    ("llama_o_proj_1", "linear", (4096, 4096), (1, 4096), 0.3),
    ("rn50_3x3_64_56", "conv", (64, 64, 3, 3), (1, 64, 56, 56), 0.1),
    ("rn50_1x1_256_14", "conv", (1024, 256, 1, 1), (1, 256, 14, 14), 0.1),
]


def _layer(kind: str, shape: tuple, density: float, dtype) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    if kind == "linear":
        dense = nn.Linear(shape[1], shape[0])
    else:
        dense = nn.Conv2d(shape[1], shape[0], shape[2], padding=shape[2] // 2)
    with torch.no_grad():
        dense.weight.mul_((torch.rand(dense.weight.shape, generator=g) < density).float())
    return dense.to("cuda", dtype).eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="float16", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--inputs", type=int, default=64, help="calls per timed run (fresh inputs, rotated)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.backends.cudnn.benchmark = True
    rows = []
    for name, kind, shape, input_shape, density in CASES:
        dense = _layer(kind, shape, density, dtype)
        make = SparseLinear if kind == "linear" else SparseConv2d
        started = time.perf_counter()
        sparse = make.from_dense(dense, policy="sparse", tune_budget=0.5)
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(input_shape, generator=g).to("cuda", dtype) for _ in range(args.inputs)]
        with torch.no_grad():
            sparse(xs[0])  # builds the kernel
            compile_s = time.perf_counter() - started
            key = xs[0].shape[0] if kind == "linear" else tuple(xs[0].shape[2:])
            kernel = sparse._paths[key]
            dense_call = (lambda x: F.linear(x, dense.weight, dense.bias)) if kind == "linear" else \
                (lambda x: F.conv2d(x, dense.weight, dense.bias, dense.stride, dense.padding))
            timed = {"dense": dense_call, "module": sparse, "kernel": lambda x: kernel(x)}
            host = {label: [] for label in timed}
            for _ in range(5):  # interleaved: a drift of the machine touches every path alike
                for label, fn in timed.items():
                    host[label].append(host_time_us(fn, xs, repeats=3))
            host = {label: statistics.median(v) for label, v in host.items()}
            gpu = {label: graph_time_us(fn, xs[:8]) for label, fn in (("dense", dense_call), ("module", sparse))}
        row = {"case": name, "kind": kind, "weight_shape": list(shape), "input_shape": list(input_shape),
               "density": density, "mapping": getattr(kernel, "mapping", None), "compile_s": compile_s,
               **{f"host_{k}_us": v for k, v in host.items()}, **{f"gpu_{k}_us": v for k, v in gpu.items()},
               "host_ratio_module_vs_dense": host["module"] / host["dense"]}
        rows.append(row)
        print(f"{name:22s} host: dense {host['dense']:.1f} us, module {host['module']:.1f} us "
              f"({row['host_ratio_module_vs_dense']:.2f}x; target <= 1.2x)"
              + f", raw kernel {host['kernel']:.1f} us"
              + f"; gpu: dense {gpu['dense']:.1f} us, sparse {gpu['module']:.1f} us", flush=True)
    ratios = [r["host_ratio_module_vs_dense"] for r in rows]
    result = {"provenance": provenance(sys.argv), "dtype": args.dtype, "cases": rows,
              "summary": {"model": "host time per call", "sparsity": None, "dtype": args.dtype, "batch": None,
                          "layout": None, "geomean_speedup_vs_cublas": None,
                          "geomean_host_ratio_module_vs_dense": statistics.geometric_mean(ratios),
                          "max_host_ratio_module_vs_dense": max(ratios), "target": "<= 1.2x"}}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"host time, module against dense: geomean {result['summary']['geomean_host_ratio_module_vs_dense']:.2f}x, "
          f"worst {max(ratios):.2f}x (target <= 1.2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
