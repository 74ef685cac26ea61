"""What the decode prototypes' benches share (bitmap_*_bench.py, rowlane_walk_bench.py, delta_runs_bench.py):
CUDA-graph timing (the calls captured once in order, replayed, the median per call), a seeded pruned case with
cuBLAS's rotated time beside it, and NVRTC builds of a prototype's CUDA source."""
import statistics

import torch


def graph_us(calls, reps=15):
    """median microseconds per call of a CUDA graph replaying `calls` in order."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in calls[:3]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(calls))
    return statistics.median(times)


def pruned_case(m: int, k: int, sparsity: float, dtype):
    """(W pruned per row by magnitude to `sparsity`, x (1 x k), the float64 reference y, cuBLAS's microseconds
    with W rotated through HBM) of one decode case, seeded: what the N = 1 prototypes are measured against."""
    import math

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(m, k, device="cuda", generator=gen)
    thr = w.abs().topk(round(k * (1 - sparsity)), dim=1).values[:, -1:]
    w = torch.where(w.abs() >= thr, w, torch.zeros_like(w)).to(dtype)
    x = torch.randn(1, k, device="cuda", generator=gen).to(dtype)
    ref = (x.double() @ w.double().t()).view(-1)
    ys = torch.empty(1, m, device="cuda", dtype=dtype)
    copies = [w.clone() for _ in range(max(2, math.ceil(256e6 / (m * k * 2))))]
    dense = graph_us([lambda wi=wi: torch.matmul(x, wi.t(), out=ys) for wi in copies], reps=9)
    return w, x, ref, dense


def compiled(source: str, entry: str, defines: tuple[str, ...]):
    """(the entry function of `source` built by NVRTC for sm_90 with `defines`, seconds it took), its dynamic
    shared memory allowed up to the block's limit (the opt-in covers static and dynamic shared memory together)."""
    import time

    import cupy as cp

    started = time.perf_counter()
    fn = cp.RawModule(code=source, options=("-std=c++17", "-arch=sm_90", *defines)).get_function(entry)
    fn.max_dynamic_shared_size_bytes = 227 * 1024 - fn.shared_size_bytes
    return fn, time.perf_counter() - started


def summary_rows(results: list[dict]) -> list[dict]:
    """The benchmark files' summary rows over a prototype's cases ({m, k, sparsity, n, dtype, speedup}): per
    sparsity, the geomean over shapes of cuBLAS's time over the prototype's best config. Both sides are timed
    with W rotated through HBM (the only protocol the prototypes time), so the plain and the _rotating keys
    carry the same figure."""
    import math

    rows = []
    for sparsity in sorted({r["sparsity"] for r in results}):
        cases = [r for r in results if r["sparsity"] == sparsity and r.get("speedup")]
        if not cases:
            continue
        geomean = math.exp(sum(math.log(r["speedup"]) for r in cases) / len(cases))
        rows.append({"model": "llama", "sparsity": sparsity, "dtype": cases[0]["dtype"], "batch": 1, "layout": "nk",
                     "n": cases[0]["n"], "cases": len(cases), "shapes": [f"{r['m']}x{r['k']}" for r in cases],
                     "geomean_speedup_vs_cublas": geomean, "geomean_speedup_vs_cublas_rotating": geomean,
                     "all_correct": all(not r.get("wrong") for r in cases), "timing": "W rotated through HBM, both sides"})
    return rows
