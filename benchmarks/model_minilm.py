"""MiniLM latency end to end: all-MiniLM-L6-v2's encoder (models/bert.py, BertModel's layers) with
every encoder Linear pruned unstructured by magnitude to --sparsity, then `convert` (dense / unstructured
measured per layer at the layer's token count) against the same pruned model run dense, in --dtype and, beside
it, in float32; one forward of batch x tokens (all unpadded) timed under CUDA-graph replay; the converted
output against the pruned model in float64.

Weights: all-MiniLM-L6-v2's own (--weights DIR, a sentence-transformers directory or its model.safetensors)
where the machine has them, else seeded (BertModel's initialisation: only speed is measured then; the
pattern of a magnitude-pruned seeded weight is as irregular as a trained one's, or more).

    PYTHONPATH=src python benchmarks/model_minilm.py OUT.json --sparsity 0.8 [--dtype float16] [--batch 1]
        [--tokens 128] [--tune-budget 1] [--weights DIR]
"""
import argparse
import copy
import sys
import time
from pathlib import Path

import torch

from sparseforge.bench.report import finish_model_run, provenance
from sparseforge.models import bert_encoder, load_bert_weights
from sparseforge.nn import convert
from sparseforge.nn.convert import model_latency_us
from sparseforge.prune import prune_model

TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 3e-2}
ENCODER_LINEARS = r"^encoder\.layer\.\d+\.(attention\.(self\.(query|key|value)|output\.dense)|intermediate\.dense|output\.dense)$"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--sparsity", type=float, required=True)
    parser.add_argument("--dtype", default="float16", choices=sorted(TOLERANCE))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--tune-budget", type=float, default=1.0)
    parser.add_argument("--weights", type=Path, default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 is fp32 on both sides
    dtype = getattr(torch, args.dtype)
    model = bert_encoder(seed=0)
    weights = "seeded (BertModel's initialisation)"
    if args.weights is not None:
        load_bert_weights(model, args.weights)
        weights = str(args.weights)
    pruned = prune_model(model, sparsity=args.sparsity, include=ENCODER_LINEARS, keep_masks=False)
    model = model.cuda().eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, model.shape.vocab, (args.batch, args.tokens), generator=g).cuda()
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(ids, mask)
    dense_fp32_us = model_latency_us(model, (ids, mask))
    model = model.to(dtype)
    dense_us = model_latency_us(model, (ids, mask))
    print(f"dense {args.dtype} {dense_us:.1f} us, float32 {dense_fp32_us:.1f} us; converting", flush=True)
    report = convert(model, (ids, mask), tune_budget=args.tune_budget, fold_bn=False,
                     progress=lambda name, i, total: print(f"[{i + 1}/{total}] {name} "
                                                           f"({time.perf_counter() - started:.0f} s)", flush=True))
    with torch.no_grad():
        got = model(ids, mask).double()
    error = float((got - want).norm() / want.norm())
    picks: dict[str, int] = {}
    for layer in report.layers:
        picks[layer.choice] = picks.get(layer.choice, 0) + 1
    result = {"provenance": provenance(sys.argv), "model": "all-minilm-l6-v2", "weights": weights,
              "sparsity": args.sparsity, "layers_pruned": len(pruned.layers), "dtype": args.dtype,
              "batch": args.batch, "tokens": args.tokens, "layout": "nk",
              "dense_us": dense_us, "dense_float32_us": dense_fp32_us, "converted_us": report.latency_after_us,
              "speedup_vs_cublas": dense_us / report.latency_after_us,
              "speedup_vs_dense_float32": dense_fp32_us / report.latency_after_us,
              "choices": picks, "rel_error_vs_float64": error, "error_ok": error <= TOLERANCE[args.dtype],
              "report": report.as_dict(), "seconds": time.perf_counter() - started}
    return finish_model_run(args.out, result, report, f"minilm {args.dtype} batch {args.batch} x {args.tokens} "
                            f"({args.sparsity:.0%}): dense {dense_us:.1f} us (float32 {dense_fp32_us:.1f}), converted "
                            f"{report.latency_after_us:.1f} us: {result['speedup_vs_cublas']:.2f}x; picks {picks}")


if __name__ == "__main__":
    sys.exit(main())
