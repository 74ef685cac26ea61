"""Compile time from a cold cache and the time of the same call from a warm cache, per DLMC matrix, with
the cost model's pick (tune_budget=None: nothing timed). Cold: ranking the candidates (the chooser's share,
reported apart as rank_seconds) + generation and compile of the picked kernel (compile_seconds) + load.
Warm: the cached choice and cubin: planning the picked config and loading the module.
Usage: python benchmarks/compile_time.py DIR OUT.json"""
import json
import statistics
import sys
import tempfile
import time

import torch

from sparseforge import compile_spmm
from sparseforge.bench.report import provenance
from sparseforge.suite import discover


def main(path: str, out: str) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        import os

        os.environ["SPARSEFORGE_CACHE_DIR"] = cache
        for case in discover(path):
            w = case.load()
            start = time.perf_counter()
            cold = compile_spmm(w, case.N, torch.float32, tune_budget=None)
            cold_s = time.perf_counter() - start
            start = time.perf_counter()
            warm = compile_spmm(w, case.N, torch.float32, tune_budget=None)
            warm_s = time.perf_counter() - start
            assert warm.cache_hit
            rows.append({"case": case.name, "nnz": case.nnz, "N": case.N, "config": cold.plan.config.short(),
                         "mapping": cold.mapping, "cold_seconds": cold_s, "rank_seconds": cold.tune_seconds,
                         "compile_seconds": cold.compile_seconds, "warm_seconds": warm_s,
                         "load_seconds": warm.load_seconds})
            print(f"{case.name:70s} nnz {case.nnz:7d} cold {cold_s:6.2f}s warm {warm_s * 1e3:7.2f}ms "
                  f"(module load {warm.load_seconds * 1e3:.2f}ms)", flush=True)
    summary = {"median_cold_seconds": statistics.median(r["cold_seconds"] for r in rows),
               "median_compile_seconds": statistics.median(r["compile_seconds"] for r in rows),
               "median_rank_seconds": statistics.median(r["rank_seconds"] for r in rows),
               "max_cold_seconds": max(r["cold_seconds"] for r in rows),
               "median_warm_seconds": statistics.median(r["warm_seconds"] for r in rows),
               "median_load_seconds": statistics.median(r["load_seconds"] for r in rows)}
    print(json.dumps(summary, indent=1))
    with open(out, "w") as f:
        json.dump({"provenance": provenance(sys.argv), "summary": summary, "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
