"""Kernel designs side by side on a DLMC directory (GPU): the heuristic pick, unsplit and split groups
(segment_nnz), rows grouped by shared columns (cluster_rows), and for nk X staged in shared memory, each case's output checked, all timed by graph
replay against cuBLAS in one process. For kn also chunked runs (chunk_k): their first implementation
measured 2.4-3.3x slower with this script at dfaac08 (results/h200_2026-11-30_designs_*_dfaac08.json);
the inline one that replaced it is what this measures now. Writes JSON with per-case times and geomean speedups per design.

    PYTHONPATH=src python benchmarks/designs.py DLMC_DIR OUT.json [--dtype float32] [--batch 1] [--limit N]
"""
import argparse
import dataclasses
import json
import sys

from sparseforge.bench.gpu import run_case
from sparseforge.bench.report import geomean, provenance
from sparseforge.plan import TileConfig, make_plan, operand_bytes
from sparseforge.suite import discover
from sparseforge.tune import default_config
from sparseforge.tune.autotune import chunked_candidates


def designs(case, n: int, layout: str) -> dict:
    """The heuristic pick against its alternatives: unsplit, split, rows clustered by shared columns, and
    chunked runs (kn) or staged X (nk)."""
    row_nnz = case.nnz / max(case.M, 1)
    first = dataclasses.replace(default_config(n, layout, row_nnz, m=case.M), segment_nnz=0)
    group_nnz = row_nnz * first.rows_per_group
    out = {"default": default_config(n, layout, row_nnz, m=case.M), "unsplit": first,
           "split": dataclasses.replace(first, segment_nnz=max(int(group_nnz * (0.25 if n <= 256 else 2.0)), 4))}
    out["clustered"] = dataclasses.replace(out["default"], cluster_rows=True)
    if layout == "kn":
        out["chunked"], out["chunked8_clustered"] = chunked_candidates(first, n)
    else:
        out["staged_x"] = TileConfig(4, 8, 1)
    return {name: config for i, (name, config) in enumerate(out.items())
            if config not in list(out.values())[:i]}  # a design equal to an earlier one is not re-run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("out")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layout", default="kn")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--limit", type=int, default=None, help="at most LIMIT cases, spread over the directory")
    args = parser.parse_args()
    cases = discover(args.path, batch=args.batch)
    if args.limit:  # every k-th case, so a short run still spans the layer shapes
        cases = cases[:: max(len(cases) // args.limit, 1)][: args.limit]
    records = []
    for case in cases:
        for name, config in designs(case, case.N, args.layout).items():
            try:
                record = run_case(case, args.dtype, args.layout, case.N, None, config=config, with_cusparse=False)
                plan = make_plan(case.load(dtype=args.dtype), case.N, args.dtype, args.layout, config)
                record["operand_bytes"] = operand_bytes(plan)  # the traffic model's prediction
            except Exception as exc:  # a design that fails to build or run is a result too
                record = {"case": case.name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            records.append({"design": name, **record})
            print(name, case.name, record.get("sparseforge_us"), record.get("speedup_vs_cublas"),
                  record.get("error_ok", record.get("error")), flush=True)
            _write(args.out, records, partial=True)  # survives a stage timeout
    summary = _write(args.out, records, partial=False)
    print(json.dumps(summary, indent=1))
    return 0 if all(v["all_correct"] for v in summary.values()) else 1


def _write(path: str, records: list, partial: bool) -> dict:
    summary = {name: {"geomean_speedup_vs_cublas": geomean(r.get("speedup_vs_cublas") for r in records
                                                            if r["design"] == name),
                      "all_correct": all(r.get("error_ok", False) for r in records if r["design"] == name)}
               for name in dict.fromkeys(r["design"] for r in records)}
    with open(path, "w") as f:
        json.dump({"provenance": provenance(sys.argv), "partial": partial, "summary": summary, "cases": records},
                  f, indent=1)
    return summary


if __name__ == "__main__":
    sys.exit(main())
