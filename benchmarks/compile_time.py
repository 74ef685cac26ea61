"""Compile time from a cold cache and the time of the same call from a warm cache, per DLMC matrix, with
the cost model's pick (tune_budget=None: nothing timed). Cold: ranking the candidates (the chooser's share,
reported apart as rank_seconds) + generation and compile of the picked kernel (compile_seconds) + load.
Warm: the cached choice and cubin: planning the picked config and loading the module. The warm pass runs
after every cold compile, over the matrices again in order, as a process that loads a converted model from
the cache does (the first call straight after a cold compile of the same matrix measured ~2 ms more on the CPU
alone, from state the compile left behind, which loading a model never meets).
Convolution cases (a `conv:` spec, as `sparseforge bench` takes: conv:DIR for the DLMC rn50 layers, conv:vgg16)
go through compile_conv2d with their real geometry, fp32 NCHW: the convolution target "median <= 1.5 s per layer cold"
(bench's compile_seconds no longer says it: bench prebuilds every case's candidates before measuring).
Usage: python benchmarks/compile_time.py DIR|conv:SPEC OUT.json"""
import json
import statistics
import sys
import tempfile
import time

import torch

from sparseforge import compile_conv2d, compile_spmm
from sparseforge.bench.report import provenance
from sparseforge.suite import discover


class _SpmmCase:
    """One DLMC matrix: compile_spmm at its N (fp32, layout kn), the cost model's pick."""

    def __init__(self, case):
        self.name, self.nnz, self.N = case.name, case.nnz, case.N
        self._w = case.load()  # outside the timed calls: reading the .smtx and drawing values is not compiling

    def compile(self):
        return compile_spmm(self._w, self.N, torch.float32, tune_budget=None)


class _ConvCase:
    """One convolution layer: compile_conv2d with its geometry (fp32, NCHW), the cost model's pick."""

    def __init__(self, case):
        from sparseforge.bench.conv import conv_kernel_args

        self.args = conv_kernel_args(case, "float32", None)
        self.name, self.nnz, self.N = case.name, self.args["W"].nnz, case.geometry.out_height * case.geometry.out_width

    def compile(self):
        return compile_conv2d(**self.args)


def _cases(path: str) -> list:
    if path.startswith("conv:"):
        from sparseforge.suite.conv import discover_conv

        return [_ConvCase(c) for c in discover_conv(path)]
    return [_SpmmCase(c) for c in discover(path)]


def main(path: str, out: str) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        import os

        os.environ["SPARSEFORGE_CACHE_DIR"] = cache
        cases = _cases(path)
        for case in cases:
            start = time.perf_counter()
            cold = case.compile()
            cold_s = time.perf_counter() - start
            start = time.perf_counter()
            case.compile()
            after_cold_s = time.perf_counter() - start
            rows.append({"case": case.name, "nnz": case.nnz, "N": case.N, "config": cold.plan.config.short(),
                         "mapping": cold.mapping, "cold_seconds": cold_s, "rank_seconds": cold.tune_seconds,
                         "compile_seconds": cold.compile_seconds,
                         "warm_after_cold_seconds": after_cold_s})
            print(f"{case.name:70s} nnz {case.nnz:7d} cold {cold_s:6.2f}s", flush=True)
        for case, row in zip(cases, rows):
            start = time.perf_counter()
            warm = case.compile()
            row["warm_seconds"] = time.perf_counter() - start
            row["load_seconds"] = warm.load_seconds
            assert warm.cache_hit and warm.plan.config.short() == row["config"], "the warm call must hit the cache"
            print(f"{case.name:70s} warm {row['warm_seconds'] * 1e3:7.2f}ms "
                  f"(module load {warm.load_seconds * 1e3:.2f}ms)", flush=True)
    summary = {"median_cold_seconds": statistics.median(r["cold_seconds"] for r in rows),
               "median_compile_seconds": statistics.median(r["compile_seconds"] for r in rows),
               "median_rank_seconds": statistics.median(r["rank_seconds"] for r in rows),
               "max_cold_seconds": max(r["cold_seconds"] for r in rows),
               "median_warm_seconds": statistics.median(r["warm_seconds"] for r in rows),
               "median_warm_after_cold_seconds": statistics.median(r["warm_after_cold_seconds"] for r in rows),
               "median_load_seconds": statistics.median(r["load_seconds"] for r in rows)}
    print(json.dumps(summary, indent=1))
    with open(out, "w") as f:
        json.dump({"provenance": provenance(sys.argv), "summary": summary, "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
