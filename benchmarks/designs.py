"""Every mapping side by side (GPU): for each case, every candidate of the design space (tune/space.py)
compiled and timed by graph replay, beside cuBLAS, each output checked against float64; with the cost
model's prediction for each, and what the default chooser (its shortlist of tune.choose.TOP) would pick.
This is the data the cost model is fitted on (benchmarks/cost_fit.py) and the check that the shortlist
holds each layer's winner.

    PYTHONPATH=src python benchmarks/designs.py OUT.json DLMC_ROOT CASE[:N] ... [--dtype float32] [--layout kn]
        [--mappings csr-columns,row-groups]   (only these mappings' candidates: a quick look at one family)
        [--configs btc_w8s3,btc_w16s2g4o2]   (only the candidates of these labels, config.short())
        [--rotate]   (also the best of each mapping and cuBLAS with W rotated through HBM, bench's protocol)
        [--rotate-all]  (every correct candidate rotated: configs of one mapping that differ in bytes, e.g.
                     delta-runs' gap widths, compare where their bytes matter)
CASE: a path under DLMC_ROOT without .smtx (rn50 cases take N from rn50_batchsizes.txt unless :N is given),
or an LLM suite spec with N after a slash: llm:0.9:llama_4096x4096/16 (every case it names, at N = 16).
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from sparseforge import SparseMatrix
from sparseforge.bench.gpu import TOLERANCE, relative_error
from sparseforge.bench.report import provenance
from sparseforge.runtime.compiler import CompileError
from sparseforge.runtime.driver import CudaError
from sparseforge.runtime.timing import graph_time_us
from sparseforge.spmm import _make_plan, load_candidate
from sparseforge.tune.pipeline import compile_candidate, describe as _describe, plans_of as _plans
from sparseforge.tune.choose import BYTES_TIE, TOP, choose, fewest_bytes_of_the_tied, shortlist
from sparseforge.mappings.bitmap.plan import BitmapConfig
from sparseforge.mappings.bitmap_tc.plan import BitmapTcConfig
from sparseforge.mappings.csr.plan import CsrColumnsConfig, CsrConfig
from sparseforge.mappings.delta_runs.plan import DeltaRunsConfig
from sparseforge.mappings.split24.plan import Split24Config
from sparseforge.semi.cusparselt import Sparse24Error
from sparseforge.mappings.tc_scatter.plan import TcScatterConfig
from sparseforge.tune.space import search_space

# the mappings each config family can give: --mappings drops a family before its plans are made (sketching
# every generated candidate of a million-nonzero LLM layer costs minutes)
FAMILY_MAPPINGS = {CsrConfig: {"csr", "csr-staged"}, CsrColumnsConfig: {"csr-columns"}, BitmapConfig: {"bitmap"},
                   TcScatterConfig: {"tc-scatter"}, Split24Config: {"split-24"}, DeltaRunsConfig: {"delta-runs"},
                   BitmapTcConfig: {"bitmap-tc"}}
TILE_MAPPINGS = {"row-groups", "row-per-block", "split-k", "staged-x", "inline"}


def batch_sizes(root: Path) -> dict:
    path = root / "rn50_batchsizes.txt"
    return dict((a, int(b)) for a, b in (line.strip().split(",") for line in path.read_text().splitlines() if "," in line))


def weights(root: Path, spec: str, dtype: str):
    """(name, W, N) of each case a CASE argument names."""
    if spec.startswith("llm"):
        from sparseforge.suite.llm import discover_llm

        llm_spec, _, n_text = spec.partition("/")
        for case in discover_llm(llm_spec, n=int(n_text) if n_text else None):
            yield str(case.path), case.load(dtype=dtype), case.N
        return
    name, _, n_text = spec.partition(":")
    n = int(n_text) if n_text else batch_sizes(root)[Path(name).name]
    yield name, SparseMatrix.from_smtx(root / f"{name}.smtx", seed=0).astype(dtype), n


def run(name: str, w: SparseMatrix, n: int, dtype: str, layout: str, mappings: set | None = None,
        rotate: bool = False, rotate_all: bool = False, configs: set | None = None) -> dict:
    tdt = getattr(torch, dtype)
    make = lambda cfg, sketch=False: _make_plan(w, n, dtype, layout, cfg, None, False, 90, sketch)  # noqa: E731
    space = search_space(n, layout, w.shape[0], w.nnz / w.shape[0], unmeasured=True, dtype=dtype)
    if mappings:
        space = [c for c in space if FAMILY_MAPPINGS.get(type(c), TILE_MAPPINGS) & mappings]
    if configs:
        space = [c for c in space if c.short() in configs]
    plans = _plans(make, space)
    if mappings:
        plans = [p for p in plans if p.mapping in mappings]
    shape = (w.shape[1], n) if layout == "kn" else (n, w.shape[1])
    gen = torch.Generator(device="cuda").manual_seed(1)
    inputs = [torch.randn(shape, device="cuda", generator=gen).to(tdt) for _ in range(4)]
    out_shape = (w.shape[0], n) if layout == "kn" else (n, w.shape[0])
    out = torch.empty(out_shape, device="cuda", dtype=tdt)
    dense = w.to_torch("cuda")
    ref = dense.double() @ inputs[0].double() if layout == "kn" else inputs[0].double() @ dense.double().T
    errors, kernels = {}, {}

    def compile_one(plan):
        return compile_candidate(make, plan)

    def load_and_time(plan, compiled):
        kernel = load_candidate(*compiled, 0, 1.0)
        check = torch.full(out_shape, float("nan"), device="cuda", dtype=tdt)
        kernel(inputs[0], out=check)
        errors[kernel.plan.config.short()] = relative_error(check, ref)
        kernels[kernel.plan.config.short()] = kernel
        return kernel, graph_time_us(lambda b: kernel(b, out=out), inputs)

    def dense_us():
        if layout == "kn":
            return graph_time_us(lambda b: torch.mm(dense, b, out=out), inputs)
        return graph_time_us(lambda x: torch.mm(x, dense.t(), out=out), inputs)

    started = time.perf_counter()
    _, choice = choose(plans, _describe, compile_one, load_and_time, math.inf, top=len(plans), time_dense=dense_us,
                       build_errors=(CompileError, CudaError, Sparse24Error))
    records = choice.records
    for r in records:
        r["rel_error"] = errors.get(r["label"])
        r["error_ok"] = r["rel_error"] is not None and r["rel_error"] <= TOLERANCE[dtype]
    timed = [i for i, r in enumerate(records) if r.get("us")]
    best = min(timed, key=lambda i: records[i]["us"])
    listed = [i for i in shortlist(records, TOP) if records[i].get("us")]
    quickest = min(records[i]["us"] for i in listed)  # the chooser's pick from its shortlist (ties to fewer bytes)
    picked = fewest_bytes_of_the_tied(records, [i for i in listed if records[i]["us"] <= quickest * BYTES_TIE])
    predicted = min(range(len(records)), key=lambda i: records[i]["predicted_us"])
    rotating = {}
    if rotate or rotate_all:  # the fastest correct candidate of each mapping (or every one), streaming W from HBM
        from sparseforge.bench.gpu import _rotating_times

        if rotate_all:
            chosen = [j for j in timed if records[j]["error_ok"]]
        else:
            chosen = [min((j for j in timed if records[j]["mapping"] == mapping and records[j]["error_ok"]),
                          key=lambda j: records[j]["us"], default=None)
                      for mapping in sorted({records[i]["mapping"] for i in timed})]
        for i in (j for j in chosen if j is not None):
            rotating[records[i]["label"]] = _rotating_times(kernels[records[i]["label"]], dense, layout, tdt, shape, 11)
    kernels.clear()
    return {"rotating": rotating, "case": name, "M": w.shape[0], "K": w.shape[1], "N": n, "nnz": w.nnz, "dtype": dtype, "layout": layout,
            "cublas_us": choice.dense_us, "candidates": records, "best": records[best]["label"],
            "best_mapping": records[best]["mapping"], "best_us": records[best]["us"],
            "chooser_us": records[picked]["us"], "chooser_label": records[picked]["label"],
            "model_top1_us": records[predicted].get("us"), "seconds": time.perf_counter() - started,
            "all_correct": all(r["error_ok"] for r in records if r.get("us"))}


def summarize_designs(results: list[dict]) -> list[dict]:
    """Summary rows with the keys of every benchmark file, per (model, sparsity, dtype, N, layout): the
    geomean over the group's cases of cuBLAS over the best candidate and over the chooser's pick (weights in
    L2), and over the best of each rotated mapping where --rotate timed them (weights streamed from HBM)."""
    from sparseforge.bench.report import geomean

    groups: dict = {}
    for r in results:
        model, _, sparsity = Path(r["case"]).name.partition("@")
        sparsity, _, method = sparsity.partition("~")  # llm/<layer>@<sparsity>~wanda: its own rows
        model = f"{model}_{method}" if method else model
        groups.setdefault((model, sparsity or None, r["dtype"], r["N"], r["layout"]), []).append(r)
    rows = []
    for (model, sparsity, dtype, n, layout), items in groups.items():
        rotated = [max(v["speedup_vs_cublas_rotating"] for v in r["rotating"].values()) for r in items if r.get("rotating")]
        rows.append({"model": model, "sparsity": float(sparsity) if sparsity else None, "dtype": dtype, "batch": 1,
                     "n": n, "layout": layout, "cases": len(items),
                     "geomean_speedup_vs_cublas": geomean(r["cublas_us"] / r["best_us"] for r in items),
                     "geomean_speedup_vs_cublas_chooser": geomean(r["cublas_us"] / r["chooser_us"] for r in items),
                     **({"geomean_speedup_vs_cublas_rotating": geomean(rotated)} if rotated else {}),
                     "all_correct": all(r["all_correct"] for r in items)})
    return rows


def report(out: str, results: list[dict], r: dict) -> None:
    """Rewrite the results file (a run cut by a timeout keeps what it measured) and print r's line."""
    Path(out).write_text(json.dumps({"provenance": provenance(sys.argv), "summary": summarize_designs(results),
                                     "cases": results}, indent=1))
    for label, t in r.get("rotating", {}).items():
        print(f"    rotating {label:20s} {t['sparseforge_rotating_us']:7.2f} us ({t['sparseforge_rotating_tbs']:.2f} TB/s)"
              f"  cuBLAS {t['cublas_rotating_us']:7.2f} us ({t['cublas_rotating_tbs']:.2f} TB/s)  "
              f"x{t['speedup_vs_cublas_rotating']:.2f}", flush=True)
    print(f"{r['case'][-48:]:48s} {r['M']:5d}x{r['K']:<5d} N={r['N']:<5d} cuBLAS {r['cublas_us']:7.2f}  best "
          f"{r['best_us']:7.2f} {r['best_mapping']:13s} {r['best']:20s} chooser {r['chooser_us']:7.2f}  "
          f"model-top1 {r['model_top1_us'] or float('nan'):7.2f}  ok={r['all_correct']}  {r['seconds']:.0f}s",
          flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("root", type=Path)
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layout", default="kn")
    parser.add_argument("--mappings", default="", help="comma-separated mappings to keep (default: all)")
    parser.add_argument("--configs", default="", help="comma-separated config labels to keep (default: all)")
    parser.add_argument("--rotate", action="store_true", help="also time with W rotated through HBM")
    parser.add_argument("--rotate-all", action="store_true", help="every correct candidate rotated, not the best of each "
                        "mapping only")
    args = parser.parse_args()
    results = []
    for spec in args.cases:
        for name, w, n in weights(args.root, spec, args.dtype):
            try:
                r = run(name, w, n, args.dtype, args.layout, set(filter(None, args.mappings.split(","))), args.rotate,
                        args.rotate_all, set(filter(None, args.configs.split(","))))
            except ValueError as exc:  # e.g. --mappings keeps no candidate of this case
                print(f"{name}: skipped ({exc})", flush=True)
                continue
            results.append(r)
            report(args.out, results, r)
    if not results:
        return 1
    geo = lambda key: math.exp(sum(math.log(r["cublas_us"] / r[key]) for r in results) / len(results))  # noqa: E731
    print(f"geomean x cuBLAS: best {geo('best_us'):.2f}  chooser {geo('chooser_us'):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
