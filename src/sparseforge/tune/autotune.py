"""Autotuning in the shape of Triton's, small: a few configs, each compiled and timed once by the median
of CUDA events on fresh random input, the winner persisted under a key; a compile or launch failure scores
infinity; a time budget bounds the whole search (the first candidate, the heuristic pick, always runs)."""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import asdict

from ..plan import TileConfig, pick_vec


def _column_warps(n: int, vec: int, cap: int = 8) -> int:
    """Fewest power-of-two warps covering N columns, at most cap (more warps: more share one fetch)."""
    warps = 1
    while warps < cap and warps * 32 * vec < n:
        warps *= 2
    return warps


def _kn(n: int, rows: int, vec: int, groups: int = 1) -> TileConfig:
    vec = pick_vec(n, "kn", vec)
    # 16 loads in flight per warp: with few warps per SM the kernels are latency-bound (measured: 8 in
    # flight left a 100k-nonzero kernel at 0.12 instructions per clock on the H200)
    return TileConfig(rows, _column_warps(n, vec), vec, 16, groups)


def default_config(n: int, layout: str) -> TileConfig:
    """The pick without measurement."""
    if layout == "nk":
        return TileConfig(rows_per_group=4, warps_per_block=8, vec=1)
    return _kn(n, 4, 4 if n >= 1024 else 2 if n >= 128 else 1)


def split_candidates(first: TileConfig, n: int, group_nnz: float | None) -> list[TileConfig]:
    """Configs that split groups (segment_nnz), given the mean nonzeros of a default group: at twice the
    mean only outlier groups (long rows) are cut; for small N, where few column tiles leave few warps
    per SM, a quarter or half of the mean multiplies the warps (split-K)."""
    if not group_nnz or group_nnz < 2:
        return []
    fractions = (0.25, 0.5, 2.0) if n <= 256 else (2.0,)
    return [dataclasses.replace(first, segment_nnz=max(int(group_nnz * f), 4)) for f in fractions]


# B rows per chunk of a run (kn): 64 rows x 32*vec columns is 8-32 KB per warp in fp32, so 8-16 warps'
# chunks fit an SM's L1 while the run's groups re-read them; shorter chunks would multiply the per-chunk
# section calls (accumulators passed in and out), longer ones would spill out of L1. Unmeasured yet.
CHUNK_K = 64


def chunked_candidates(first: TileConfig) -> list[TileConfig]:
    """Runs of 4 and 8 groups going chunk by chunk (kn)."""
    return [dataclasses.replace(first, groups_per_block=g, chunk_k=CHUNK_K) for g in (4, 8)]


def candidates(n: int, layout: str, group_nnz: float | None = None, relu: bool = False) -> list[TileConfig]:
    """Heuristic pick first, then (unless relu, which splits cannot fuse) splitting variants, then
    neighbours in rows per group, vector width and groups per block."""
    first = default_config(n, layout)
    if layout == "nk":
        # X transposed by the launch, then read like B in kn: one extra copy, coalesced direct loads
        transposed = dataclasses.replace(_kn(n, 4, 1), transpose_x=True)
        pool = [transposed, dataclasses.replace(transposed, rows_per_group=8),
                TileConfig(8, 8, 1), TileConfig(2, 8, 1), TileConfig(4, 16, 1), TileConfig(4, 4, 1)]
    else:
        v = first.vec
        pool = [_kn(n, 8, v), _kn(n, 2, v), _kn(n, 4, max(v // 2, 1)), _kn(n, 4, min(v * 2, 4)),
                _kn(n, 4, v, 2), _kn(n, 1, v), _kn(n, 8, max(v // 2, 1))]
        pool.insert(1, TileConfig(4, first.warps_per_block, first.vec, 32))
    if layout == "kn":
        pool += chunked_candidates(first)
    out = [first]
    for config in ([] if relu else split_candidates(first, n, group_nnz)) + pool:
        if config not in out:
            out.append(config)
    return out


def time_kernel(kernel, b, repeats: int = 30) -> float:
    """Median microseconds of single launches, each bracketed by CUDA events, after warm-up."""
    import torch

    out = kernel(b)
    for _ in range(3):
        kernel(b, out=out)
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernel(b, out=out)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def tune(build, n: int, layout: str, make_input, budget_seconds: float = 5.0, configs=None):
    # configs: the list to try; default candidates(n, layout) (callers with the matrix pass split variants)
    """Try configs with build(config) -> kernel, timed on make_input(); returns (best kernel, records)."""
    started = time.perf_counter()
    best, best_us, records = None, math.inf, []
    for i, config in enumerate(configs or candidates(n, layout)):
        if i and time.perf_counter() - started > budget_seconds:
            break
        try:
            kernel = build(config)
            us = time_kernel(kernel, make_input())
        except Exception as err:  # a config that fails to build or run is just not a winner
            records.append({"config": asdict(config), "us": math.inf, "error": str(err)[:300]})
            continue
        records.append({"config": asdict(config), "us": us, "compile_seconds": kernel.compile_seconds})
        if us < best_us:
            best, best_us = kernel, us
    if best is None:
        raise RuntimeError(f"no configuration built and ran; attempts: {records}")
    return best, records
