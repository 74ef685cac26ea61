"""Refit the cost model's GPU constants (tune/cost.py: Gpu) from measured runs, on the CPU.

Reads benchmark / design JSON files (per case: the config's short name and the measured time), rebuilds
each case's plan from the DLMC matrix, and fits the constants that minimise the squared log error of the
predicted times. Reports the rank agreement within each case (what the chooser needs: the winner among the
top few), before and after.

    PYTHONPATH=src python benchmarks/cost_fit.py DLMC_ROOT results/*.json [--write fitted.json]
"""
import argparse
import dataclasses
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy.optimize import minimize
from scipy.stats import spearmanr

from sparseforge import SparseMatrix
from sparseforge.plan import TileConfig
from sparseforge.mappings.bitmap.plan import BitmapConfig
from sparseforge.mappings.csr.plan import CsrColumnsConfig, CsrConfig
from sparseforge.mappings.tc_scatter.plan import TcScatterConfig
from sparseforge.spmm import _make_plan
from sparseforge.tune.choose import TOP, shortlist
from sparseforge.tune.cost import H200, estimate

FITTED = ("l2_bytes_per_s", "ifetch_bytes_per_s", "launch_us", "cycles_per_instruction", "step_cycles")


def parse_config(short: str):
    """A config back from its short name (every family's short())."""
    if short.startswith("csrc_"):
        m = re.fullmatch(r"csrc_c(\d+)s(\d+)r(\d+)", short)
        return CsrColumnsConfig(int(m[1]), int(m[2]), int(m[3]))
    if short.startswith("bmp_"):
        m = re.fullmatch(r"bmp_w(\d+)r(\d+)u(\d+)", short)
        return BitmapConfig(warps_per_block=int(m[1]), rows_per_warp=int(m[2]), unroll=int(m[3]))
    if short.startswith("csr_"):
        m = re.fullmatch(r"csr_l(\d+)c(\d+)w(\d+)(?:u(\d+))?(?:s(\d+))?(p?)", short)
        return CsrConfig(int(m[1]), int(m[2]), int(m[3]), int(m[4] or 1), stage_b=m[5] is not None,
                         ctas=int(m[5] or 0), prefetch=bool(m[6]))
    if short.startswith("tcs_"):
        m = re.fullmatch(r"tcs_w(\d+)a(\d+)", short)
        return TcScatterConfig(warps_per_block=int(m[1]), ahead=int(m[2]))
    m = re.fullmatch(r"r(\d+)w(\d+)v(\d+)b(\d+)g(\d+)(?:s(\d+))?(?:k(\d+))?(t?)(c?)(i?)", short)
    return TileConfig(rows_per_group=int(m[1]), warps_per_block=int(m[2]), vec=int(m[3]), load_batch=int(m[4]),
                      groups_per_block=int(m[5]), segment_nnz=int(m[6] or 0), chunk_k=int(m[7] or 0),
                      transpose_x=bool(m[8]), cluster_rows=bool(m[9]), inline=bool(m[10]))


def weight(root: str, name: str, matrices: dict):
    """W of a case: a DLMC .smtx under root, or an LLM suite case (llm/<layer>@<sparsity>[~<method>], seeded)."""
    if name not in matrices:
        if name.startswith("llm/"):
            from sparseforge.suite.llm import case_of_path

            matrices[name] = case_of_path(name).load()
        else:
            path = Path(root) / f"{name}.smtx"
            matrices[name] = SparseMatrix.from_smtx(path) if path.exists() else None
    return matrices[name]


def load_records(paths):
    """(case, config label, measured us) from bench JSON (one config a case) or designs.py JSON (every
    candidate of a case)."""
    for path in paths:
        data = json.loads(Path(path).read_text())
        for case in data.get("cases", []):
            if "candidates" in case:
                for r in case["candidates"]:
                    if r.get("us") and r.get("error_ok", True):
                        yield {**case, "config": r["label"], "sparseforge_us": r["us"]}
            elif case.get("config") and case.get("sparseforge_us") and case.get("error_ok", True):
                yield case


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dlmc_root")
    parser.add_argument("results", nargs="+")
    parser.add_argument("--write")
    parser.add_argument("--report-only", action="store_true", help="report the current constants, fit nothing")
    parser.add_argument("--limit", type=int, default=400)
    parser.add_argument("--fit", default=",".join(FITTED),
                        help=f"comma-separated Gpu constants to fit (default {','.join(FITTED)})")
    args = parser.parse_args()
    plans, measured, keys = [], [], []
    matrices = {}
    for case in load_records(args.results):
        if len(plans) >= args.limit:
            break
        if case.get("batch", 1) != 1:
            continue
        w = weight(args.dlmc_root, case["case"], matrices)
        if w is None:
            continue
        config = parse_config(case["config"])
        plan = _make_plan(w.astype(case["dtype"]), case["N"], case["dtype"], case["layout"], config, None, False, 90)
        plans.append(plan)
        measured.append(case["sparseforge_us"])
        keys.append((case["case"], case["dtype"], case["layout"], case["N"]))
    measured = np.log(np.array(measured))
    print(f"{len(plans)} measured plans", file=sys.stderr)

    def predict(gpu):
        return np.log(np.array([estimate(p, 1, gpu).us for p in plans]))

    def report(gpu, label):
        """rms log error; within each case (several designs measured): rank correlation, whether the model's
        top-1 runs within 10% of the best measured, and whether the chooser's shortlist holds a design
        within 5% of it."""
        pred = predict(gpu)
        groups = defaultdict(list)
        for key, p, m, plan in zip(keys, pred, measured, plans):
            groups[key].append({"predicted_us": float(np.exp(p)), "us": float(np.exp(m)), "mapping": plan.mapping})
        multi = [g for g in groups.values() if len(g) >= 3]
        rhos = [spearmanr([r["predicted_us"] for r in g], [r["us"] for r in g]).statistic for g in multi]
        best = [min(r["us"] for r in g) for g in multi]
        top1 = sum(min(g, key=lambda r: r["predicted_us"])["us"] <= 1.1 * b for g, b in zip(multi, best))
        short = sum(min(g[i]["us"] for i in shortlist(g, TOP)) <= 1.05 * b for g, b in zip(multi, best))
        print(f"{label}: rms log error {np.sqrt(np.mean((pred - measured) ** 2)):.3f}; over {len(multi)} cases with "
              f"several designs: rank corr median {np.nanmedian(rhos) if rhos else float('nan'):.2f}, model top-1 "
              f"within 10% of the best in {top1}, shortlist of {TOP} within 5% in {short}")

    report(H200, "before")
    if args.report_only:
        return 0
    fitted_names = tuple(filter(None, args.fit.split(",")))
    start = np.log([getattr(H200, f) for f in fitted_names])

    def loss(x):
        gpu = dataclasses.replace(H200, **{f: float(math.exp(v)) for f, v in zip(fitted_names, x)})
        return float(np.mean((predict(gpu) - measured) ** 2))

    best = minimize(loss, start, method="Nelder-Mead", options={"maxiter": 400, "xatol": 1e-3, "fatol": 1e-5})
    fitted = dataclasses.replace(H200, **{f: float(math.exp(v)) for f, v in zip(fitted_names, best.x)})
    report(fitted, "fitted")
    values = {f: getattr(fitted, f) for f in fitted_names}
    print(json.dumps(values, indent=1))
    if args.write:
        Path(args.write).write_text(json.dumps(values, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
