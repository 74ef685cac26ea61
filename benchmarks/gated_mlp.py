"""The Llama MLP's gate and up projections at decode: one gated kernel (sparseforge.compile_gated_mlp: silu(G x) *
(U x) over the two kernels' arrays: delta-runs at N < 8, bitmap-tc from N = 8 unless --family says otherwise)
against the same two kernels launched apart with torch's
silu and multiply, and against dense (two cuBLAS products, silu, multiply), side by side in one process:
CUDA-graph replay with the stream held, weights rotated through HBM (runtime.timing: enough copies of every
array that no call finds its weights in L2), medians; outputs checked against float64 into NaN-poisoned
buffers.

    PYTHONPATH=src python benchmarks/gated_mlp.py OUT.json [--sparsities 0.5 0.7] [--dtype float16]
        [--shape 14336 4096] [--n 1] [--family delta-runs|bitmap-tc]

Summary rows: model, sparsity, dtype, batch, layout, n, geomean_speedup_vs_cublas (the gated kernel over
dense), geomean_speedup_vs_cublas_rotating (the same: every side rotated), and the gated kernel over the
unfused pair.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from sparseforge import compile_gated_mlp, compile_spmm
from sparseforge.bench.report import provenance
from sparseforge.mappings.bitmap_tc.plan import BitmapTcConfig
from sparseforge.mappings.delta_runs.plan import DeltaRunsConfig
from sparseforge.runtime.kernel import kernel_copies, release_copies
from sparseforge.runtime.timing import l2_bytes, rotating_graph_time_us, weight_copies
from sparseforge.suite.llm import magnitude_prune, seeded_weight


CONFIGS = {"delta-runs": DeltaRunsConfig, "bitmap-tc": BitmapTcConfig}


def _case(m: int, k: int, n: int, sparsity: float, dtype, family: str) -> dict:
    name = str(dtype).replace("torch.", "")
    gate, up = (magnitude_prune(seeded_weight(m, k, seed=s), sparsity) for s in (1, 2))
    config = CONFIGS[family]()
    kg, ku = (compile_spmm(w, n, dtype, "nk", config=config, tune_budget=None) for w in (gate, up))
    fused = compile_gated_mlp(kg, ku)
    dense = [torch.from_numpy(w.astype(name).to_dense()).cuda().to(dtype) for w in (gate, up)]
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
    out = torch.full((n, m), float("nan"), device="cuda", dtype=dtype)
    fused(x, out=out)
    g, u = (x.double() @ w.double().T for w in dense)
    want = g * torch.sigmoid(g) * u
    error = float((out.double() - want).norm() / want.norm())

    l2 = l2_bytes()
    copies = weight_copies(kg.weight_bytes + ku.weight_bytes, l2)
    gates, ups = [kg] + kernel_copies(kg, copies - 1), [ku] + kernel_copies(ku, copies - 1)
    try:
        fuseds = [fused] + [compile_gated_mlp(a, b) for a, b in zip(gates[1:], ups[1:])]
        inputs = [torch.randn(n, k, device="cuda", generator=gen).to(dtype) for _ in range(copies)]
        gated_us = rotating_graph_time_us(lambda p: p[0](p[1], out=out), list(zip(fuseds, inputs)))
        pair_us = rotating_graph_time_us(lambda p: torch.mul(F.silu(p[0](p[2])), p[1](p[2]), out=out),
                                         list(zip(gates, ups, inputs)))
    finally:
        torch.cuda.synchronize()
        release_copies(gates[1:] + ups[1:])
    dense_copies = weight_copies(2 * m * k * x.element_size(), l2)
    weights = [dense] + [[w.clone() for w in dense] for _ in range(dense_copies - 1)]
    inputs = [torch.randn(n, k, device="cuda", generator=gen).to(dtype) for _ in range(dense_copies)]
    dense_us = rotating_graph_time_us(lambda p: torch.mul(F.silu(p[1] @ p[0][0].T), p[1] @ p[0][1].T, out=out),
                                      list(zip(weights, inputs)))
    return {"case": f"llama_gate_up_{m}x{k}@{sparsity}", "M": m, "K": k, "N": n, "sparsity": sparsity,
            "dtype": name, "family": family, "config": kg.plan.config.short(), "rel_error": error,
            "error_ok": error <= {"float16": 5e-3, "bfloat16": 3e-2}[name], "gated_us": gated_us,
            "pair_us": pair_us, "cublas_us": dense_us, "speedup_vs_cublas": dense_us / gated_us,
            "speedup_vs_pair": pair_us / gated_us, "weight_copies": copies, "dense_weight_copies": dense_copies}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.5, 0.7])
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--shape", type=int, nargs=2, default=[14336, 4096], metavar=("M", "K"))
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--family", choices=sorted(CONFIGS), default=None,
                        help="the gated kernel's family (default: delta-runs below N = 8, bitmap-tc from 8)")
    args = parser.parse_args(argv)
    family = args.family or ("delta-runs" if args.n < 8 else "bitmap-tc")
    if not torch.cuda.is_available():
        print("error: this benchmark times CUDA kernels: run it on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    cases, summary = [], []
    for sparsity in args.sparsities:
        r = _case(*args.shape, args.n, sparsity, dtype, family)
        cases.append(r)
        summary.append({"model": f"llama_gate_up_{args.shape[0]}x{args.shape[1]}", "sparsity": sparsity,
                        "dtype": args.dtype, "batch": 1, "layout": "nk", "n": args.n, "family": family,
                        "geomean_speedup_vs_cublas": r["speedup_vs_cublas"],
                        "geomean_speedup_vs_cublas_rotating": r["speedup_vs_cublas"],
                        "speedup_vs_unfused_pair": r["speedup_vs_pair"], "all_correct": r["error_ok"]})
        print(f"{r['case']} {args.dtype} N={args.n} {family}: gated {r['gated_us']:.2f} us, pair + silu * up "
              f"{r['pair_us']:.2f} us, dense {r['cublas_us']:.2f} us: {r['speedup_vs_cublas']:.2f}x dense, "
              f"{r['speedup_vs_pair']:.2f}x the pair; rel err {r['rel_error']:.1e}")
        args.out.write_text(json.dumps({"provenance": provenance(sys.argv if argv is None else
                                                                 ["benchmarks/gated_mlp.py", *argv]),
                                        "summary": summary, "cases": cases}, indent=1, default=str))
    return 0 if all(r["error_ok"] for r in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
