"""The packed 2:4 GEMV's register sets (codegen/gemv24.py: two sets of `unroll` chunks a lane, one set's
loads in flight while the other's chunks are used) side by side with cuBLAS on the dense W, at decode widths:
which set width each N should take, and how near each comes to HBM's bandwidth. CUDA-graph replay with the
stream held, every weight rotated through HBM (runtime.timing: enough copies that no call finds its W in L2),
fresh random inputs a copy, medians; every output checked against float64 into a NaN-poisoned buffer.

    PYTHONPATH=src python benchmarks/gemv24_sets.py OUT.json [--dtypes float16 bfloat16] [--ns 1 2 4 8]
        [--unrolls 1 2 4] [--shapes 4096x4096 1024x4096 14336x4096 4096x14336]

Summary rows: model (the shape), sparsity "2:4", dtype, batch, layout "nk", n, unroll,
geomean_speedup_vs_cublas_rotating (the GEMV over cuBLAS, both rotated), the GEMV's and cuBLAS's TB/s.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from sparseforge.bench.gpu import TOLERANCE
from sparseforge.bench.report import provenance
from sparseforge.bench.semi import random_24_weight
from sparseforge.codegen.gemv24 import default_unroll
from sparseforge.runtime.timing import l2_bytes, rotating_graph_time_us, weight_copies
from sparseforge.semi.gemv import Gemv24

LLAMA_SHAPES = ("4096x4096", "1024x4096", "14336x4096", "4096x14336")  # q / o, k / v, gate / up, down


def _shape(text: str) -> tuple[int, int]:
    m, _, k = text.partition("x")
    if not (m.isdigit() and k.isdigit()) or int(k) % 16:
        raise argparse.ArgumentTypeError(f"a shape is MxK with K a multiple of 16 (the 2:4 chunk), got {text!r}")
    return int(m), int(k)


def _case(m: int, k: int, n: int, dtype: torch.dtype, unrolls: list[int], gen: torch.Generator) -> dict:
    name = str(dtype).replace("torch.", "")
    w = random_24_weight(m, k, name, seed=m + k)
    x = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
    want = x.double() @ w.double().T
    l2, in_bytes = l2_bytes(), x.numel() * x.element_size()
    record = {"M": m, "K": k, "N": n, "dtype": name, "default_unroll": default_unroll(n), "variants": {}}
    dense_bytes = m * k * w.element_size()
    copies = weight_copies(dense_bytes + in_bytes, l2)
    weights = [w] + [w.clone() for _ in range(copies - 1)]
    inputs = [torch.randn(n, k, device="cuda", generator=gen).to(dtype) for _ in range(copies)]
    out = torch.empty(n, m, device="cuda", dtype=dtype)
    record["cublas_us"] = rotating_graph_time_us(lambda p: torch.matmul(p[1], p[0].T, out=out),
                                                 list(zip(weights, inputs)))
    record["cublas_tb_s"] = dense_bytes / record["cublas_us"] / 1e6
    del weights, inputs
    for unroll in unrolls:
        gemv = Gemv24(w, unroll=unroll)
        got = torch.full((n, m), float("nan"), device="cuda", dtype=dtype)
        gemv(x, out=got)
        error = float((got.double() - want).norm() / want.norm())
        copies = weight_copies(gemv.nbytes + in_bytes, l2)
        gemvs = [gemv] + [gemv.with_copy_of_w() for _ in range(copies - 1)]
        inputs = [torch.randn(n, k, device="cuda", generator=gen).to(dtype) for _ in range(copies)]
        us = rotating_graph_time_us(lambda p: p[0](p[1], out=out), list(zip(gemvs, inputs)))
        del gemvs, inputs
        record["variants"][str(unroll)] = {
            "us": us, "tb_s": gemv.nbytes / us / 1e6, "speedup_vs_cublas_rotating": record["cublas_us"] / us,
            "rel_error": error, "error_ok": bool(error <= TOLERANCE[name] and torch.isfinite(got).all())}
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtypes", nargs="+", default=["float16"], choices=("float16", "bfloat16"))
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--unrolls", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shapes", type=_shape, nargs="+", default=[_shape(s) for s in LLAMA_SHAPES])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark times CUDA kernels: run it on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(11)
    cases = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for n in args.ns:
            for m, k in args.shapes:
                r = _case(m, k, n, dtype, args.unrolls, gen)
                cases.append(r)
                parts = ", ".join(f"u{u} {v['us']:.2f} us {v['tb_s']:.2f} TB/s {v['speedup_vs_cublas_rotating']:.2f}x"
                                  f"{'' if v['error_ok'] else ' WRONG'}" for u, v in r["variants"].items())
                print(f"{m}x{k} {dtype_name} N={n}: cuBLAS {r['cublas_us']:.2f} us {r['cublas_tb_s']:.2f} TB/s; {parts}",
                      flush=True)
                args.out.write_text(json.dumps({"provenance": provenance(sys.argv if argv is None else
                                                                         ["benchmarks/gemv24_sets.py", *argv]),
                                                "summary": _summary(cases), "cases": cases}, indent=1))
    return 0 if all(v["error_ok"] for r in cases for v in r["variants"].values()) else 1


def _summary(cases: list[dict]) -> list[dict]:
    """One row a (dtype, n, unroll): the geometric mean over the shapes."""
    rows = {}
    for r in cases:
        for unroll, v in r["variants"].items():
            rows.setdefault((r["dtype"], r["N"], int(unroll)), []).append((r, v))
    summary = []
    for (dtype, n, unroll), items in rows.items():
        speedups = torch.tensor([v["speedup_vs_cublas_rotating"] for _, v in items], dtype=torch.float64)
        summary.append({"model": "llama_8b_linear_shapes", "sparsity": "2:4", "dtype": dtype, "batch": 1,
                        "layout": "nk", "n": n, "unroll": unroll, "default": unroll == default_unroll(n),
                        "geomean_speedup_vs_cublas": float(speedups.log().mean().exp()),
                        "geomean_speedup_vs_cublas_rotating": float(speedups.log().mean().exp()),
                        "tb_s": {f"{r['M']}x{r['K']}": round(v["tb_s"], 3) for r, v in items},
                        "cublas_tb_s": {f"{r['M']}x{r['K']}": round(r["cublas_tb_s"], 3) for r, _ in items},
                        "all_correct": all(v["error_ok"] for _, v in items)})
    return summary


if __name__ == "__main__":
    sys.exit(main())
