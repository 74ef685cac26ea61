"""Llama decode end to end: a Llama-architecture decoder at Llama-3-8B widths, 2 layers, seeded
weights (models/llama.py), every projection pruned unstructured by magnitude (--sparsity) or 2:4 (--nm), then
`convert` (dense / unstructured / 2:4 measured per layer at the decode width) against the same pruned model run
dense; one decode step (batch x 1 token, static KV cache, position 128) timed under CUDA-graph replay, the
decoder layers only (the 1 GB lm_head is not part of it); the converted step's output against the dense one
in float64.

    PYTHONPATH=src python benchmarks/model_llama.py OUT.json [--sparsity 0.7 | --nm 2:4] [--dtype float16]
        [--batch 1] [--tune-budget 2]
"""
import argparse
import copy
import sys
import time
from pathlib import Path

import torch

from sparseforge.bench.report import finish_model_run, provenance
from sparseforge.models import llama_decoder
from sparseforge.nn import convert
from sparseforge.nn.convert import model_latency_us
from sparseforge.prune import prune_model

TOLERANCE = {"float16": 1e-2, "bfloat16": 3e-2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--sparsity", type=float)
    how.add_argument("--nm", help="N:M pruning, e.g. 2:4")
    parser.add_argument("--dtype", default="float16", choices=sorted(TOLERANCE))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--position", type=int, default=128)
    parser.add_argument("--tune-budget", type=float, default=2.0)
    args = parser.parse_args()
    started = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    model = llama_decoder(max_len=args.position + 16).to("cuda", dtype).eval()
    prune_model(model, sparsity=args.sparsity, nm=args.nm, include=r"_proj$", keep_masks=False)
    model.reset_cache(args.batch)
    x = torch.randn(args.batch, 1, model.shape.hidden, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    position = torch.tensor(args.position, device="cuda")
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double(), position)
    dense_us = model_latency_us(model, (x, position))
    report = convert(model, (x, position), tune_budget=args.tune_budget, fold_bn=False)
    with torch.no_grad():
        got = model(x, position).double()
    error = float((got - want).norm() / want.norm())
    result = {"provenance": provenance(sys.argv), "model": "llama3-8b-widths-2-layers",
              "sparsity": args.sparsity, "nm": args.nm, "dtype": args.dtype, "batch": args.batch,
              "layout": "nk", "dense_us_per_token": dense_us, "converted_us_per_token": report.latency_after_us,
              "speedup_vs_cublas": dense_us / report.latency_after_us, "rel_error_vs_float64": error,
              "error_ok": error <= TOLERANCE[args.dtype], "report": report.as_dict(),
              "seconds": time.perf_counter() - started}
    return finish_model_run(args.out, result, report, f"llama decode {args.dtype} batch {args.batch} "
                            f"({args.nm or args.sparsity}): dense {dense_us:.1f} us, converted "
                            f"{report.latency_after_us:.1f} us per token: {result['speedup_vs_cublas']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
