"""Where the split-24 composite's time goes (GPU): for each LLM case at a prefill width, the whole composite
(compile_spmm with Split24Config) beside cuBLAS, then each of its launches alone under graph replay: the
cuSPARSELt 2:4 product, X's transposed copy, R's kernel adding into D in place, D's copy into X's layout.
Every output checked against float64 (NaN-poisoned). The large-N tensor-core path for 16-bit LLM layers.

    PYTHONPATH=src python benchmarks/split24_breakdown.py OUT.json llm:0.9,0.7:llama_4096x4096/2048 ...
        [--dtype float16]
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

from sparseforge.bench.gpu import TOLERANCE, relative_error
from sparseforge.bench.report import provenance
from sparseforge.mappings.split24.plan import Split24Config
from sparseforge.runtime.timing import graph_time_us
from sparseforge.semi.runtime import padded_input
from sparseforge.semi.transpose import transpose_columns
from sparseforge.spmm import compile_spmm
from sparseforge.suite.llm import discover_llm


def breakdown(name: str, w, n: int, dtype: str) -> dict:
    tdt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    inputs = [torch.randn(n, w.shape[1], device="cuda", generator=gen).to(tdt) for _ in range(4)]
    dense = w.to_torch("cuda").to(tdt)
    out = torch.empty(n, w.shape[0], device="cuda", dtype=tdt)
    started = time.perf_counter()
    k = compile_spmm(w, n, dtype, "nk", config=Split24Config(), tune_budget=0.5)
    build_s = time.perf_counter() - started
    check = torch.full_like(out, float("nan"))
    k(inputs[0], out=check)
    error = relative_error(check, inputs[0].double() @ dense.double().T)
    cublas = graph_time_us(lambda x: torch.mm(x, dense.t(), out=out), inputs)
    whole = graph_time_us(lambda x: k(x, out=out), inputs)
    padded = [padded_input(k.matmul, x) for x in inputs]
    d = torch.empty(w.shape[0], k.matmul.padded_n, device="cuda", dtype=tdt)
    parts = {"tensor_2to4": graph_time_us(lambda x: k.matmul.run(x, d), padded),
             "d_to_y_copy": graph_time_us(lambda _: transpose_columns(d, n), [None])}
    if k.matmul.padded_n != n:  # the composite pads X to a width cuSPARSELt takes: one more copy a call
        parts["x_padding_copy"] = graph_time_us(lambda x: padded_input(k.matmul, x), inputs)
    r = k.residual_kernel
    if r is not None:
        xts = [transpose_columns(x, w.shape[1]) for x in padded]
        parts["x_transposed_copy"] = graph_time_us(lambda x: transpose_columns(x, w.shape[1]), padded)
        parts["residual_on_d"] = graph_time_us(lambda xt: r(xt, out=d, residual=d), xts)
    row = {"case": name, "M": w.shape[0], "K": w.shape[1], "N": n, "dtype": dtype, "nnz": w.nnz,
           "residual_nnz": k.plan.split.residual.nnz,
           "residual_mapping": None if r is None else r.plan.mapping,
           "residual_config": None if r is None else r.plan.config.short(),
           "cublas_us": cublas, "split24_us": whole, "speedup_vs_cublas": cublas / whole, "parts_us": parts,
           "rel_error": error, "error_ok": error <= TOLERANCE[dtype], "build_seconds": build_s}
    print(f"{name[-30:]:30s} N={n:<5d} {dtype:8s} cuBLAS {cublas:8.2f} split-24 {whole:8.2f} "
          f"({cublas / whole:.2f}x) R nnz {row['residual_nnz']} on {row['residual_config']}: "
          + " ".join(f"{a} {b:.1f}" for a, b in parts.items()) + f"  err {error:.1e}", flush=True)
    return row


def summarize_breakdown(rows: list[dict]) -> list[dict]:
    """Summary rows with the keys of every benchmark file, per (sparsity, dtype, N): the geomean over the
    group's shapes of cuBLAS over the composite."""
    from sparseforge.bench.report import geomean

    groups: dict = {}
    for r in rows:
        groups.setdefault((float(r["case"].rpartition("@")[2]), r["dtype"], r["N"]), []).append(r)
    return [{"model": "llama", "sparsity": sparsity, "dtype": dtype, "batch": n, "layout": "nk", "cases": len(items),
             "mapping": "split-24", "geomean_speedup_vs_cublas": geomean(r["speedup_vs_cublas"] for r in items),
             "all_correct": all(r["error_ok"] for r in items)} for (sparsity, dtype, n), items in groups.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("cases", nargs="+", help="LLM suite specs with N after a slash")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    args = parser.parse_args()
    rows = []
    for spec in args.cases:
        llm_spec, _, n_text = spec.partition("/")
        for case in discover_llm(llm_spec, n=int(n_text)):
            rows.append(breakdown(str(case.path), case.load(dtype=args.dtype), case.N, args.dtype))
            args.out.write_text(json.dumps({"provenance": provenance(sys.argv), "summary": summarize_breakdown(rows),
                                            "cases": rows}, indent=1))
    return 0 if all(r["error_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
