"""`sparseforge bench` without a GPU: plans run on the CPU reference and are checked against W @ B, and the
generated PTX is assembled with ptxas so a CPU-only machine still proves the code is well formed."""
from __future__ import annotations

import time

import numpy as np

from ..mappings.registry import plan_family
from ..runtime import PtxasCompiler
from ..suite import Case
from .report import plan_traffic


def run_case_cpu(case: Case, dtype_name: str, layout: str, n: int, assemble: bool, arch: int = 90) -> dict:
    w = case.load(dtype=dtype_name)
    start = time.perf_counter()
    from ..spmm import plan_spmm

    plan, choice = plan_spmm(w, n, dtype_name, layout, arch=arch)  # the cost model's pick (no GPU to time)
    verify = plan_family(plan).hook("verify")  # where the code holds W's values: each nonzero used once
    if verify is not None:
        verify(plan, w)
    n_check = min(n, 64)
    small, _ = plan_spmm(w, n_check, dtype_name, layout, arch=arch)
    rng = np.random.default_rng(0)
    b = rng.standard_normal((case.K, n_check) if layout == "kn" else (n_check, case.K))
    ref = w.to_dense().astype(np.float64) @ (b if layout == "kn" else b.T)
    got = plan_family(small).hook("execute")(small, b)
    got = got if layout == "kn" else got.T
    error = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300))
    record = {"case": case.name, "model": case.model, "sparsity": case.sparsity, "M": case.M, "K": case.K,
              "N": n, "nnz": case.nnz, "dtype": dtype_name, "layout": layout, "config": plan.config.short(),
              "mapping": plan.mapping, "predicted_us": choice.records[choice.winner]["predicted_us"],
              "choice": choice.records, "reference_rel_error": error, "plan_seconds": time.perf_counter() - start,
              **plan_traffic(plan)}
    compiler = PtxasCompiler.available() if assemble else None
    if compiler:
        from ..codegen import render

        start = time.perf_counter()
        cubin = compiler.compile(render(plan).modules, arch)
        record["assemble_seconds"] = time.perf_counter() - start
        record["cubin_bytes"] = len(cubin)
    return record
