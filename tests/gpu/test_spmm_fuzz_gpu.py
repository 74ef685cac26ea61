"""GPU fuzz of every mapping: 240 kernels from seeded random problems (shapes with tails, densities from 0
to 1, every dtype, both layouts, bias and ReLU, row groups, row per block, split K, staged and transposed X,
the small-N kernel, csr-columns, bitmap decode, every group inline), each run on 10 fresh inputs (plain and batched) into NaN-poisoned outputs against
float64: 2,400 cases, 0 wrong. Kernels compile side by side (ptxas in threads), then load and run."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from sparseforge import SparseMatrix
from sparseforge.plan import TileConfig, make_plan
from sparseforge.mappings.bitmap.plan import BitmapConfig, make_bitmap_plan
from sparseforge.mappings.csr.plan import CsrColumnsConfig, CsrConfig, make_csr_plan
from sparseforge.runtime import build_kernel, compile_plan

pytestmark = pytest.mark.gpu
KERNELS, INPUTS = 240, 10
TOL = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}


def _config(rng, layout: str, relu: bool, eight_columns: bool, decode: bool):
    kind = int(rng.integers(0, 8))
    if kind in (6, 7) and decode:  # W as a bitmap + packed values (N = 1)
        return BitmapConfig(warps_per_block=int(rng.choice([1, 2, 4])), rows_per_warp=int(rng.choice([1, 2, 4, 8])),
                            unroll=int(rng.choice([1, 2, 4])))
    if kind == 5 and layout == "kn":  # W as data, a warp per row (or several) with lanes across N
        columns = int(rng.choice([1, 2, 4, 8] if eight_columns else [1, 2, 4]))  # 8: one 16-byte vector only
        warps = int(rng.choice([1, 2, 4, 8]))
        return CsrColumnsConfig(columns, warps, int(rng.choice([1, 2])) if warps < 8 else 1)
    if kind == 0:
        columns = int(rng.integers(1, 17))
        return CsrConfig(int(rng.choice([4, 8, 16, 32])), columns, int(rng.choice([1, 2, 4])),
                         int(rng.choice([1, 2])) if columns <= 8 else 1, prefetch=bool(rng.integers(0, 2)))
    if layout == "nk" and kind == 1:  # X staged through shared memory
        return TileConfig(int(rng.integers(1, 6)), int(rng.choice([1, 2, 4])), 1, int(rng.integers(1, 17)))
    rows = 1 if kind == 2 else int(rng.integers(1, 9))  # kind 2: row per block
    split = 0 if relu or kind != 3 else int(rng.integers(2, 40))  # kind 3: split K
    return TileConfig(rows, int(rng.choice([1, 2, 4, 8])), int(rng.choice([1, 2, 4])), int(rng.integers(1, 17)),
                      int(rng.integers(1, 4)), split, transpose_x=layout == "nk",
                      cluster_rows=bool(rng.integers(0, 2)), inline=kind == 4)  # kind 4: every group inline


def _problem(seed: int):
    rng = np.random.default_rng(seed)
    m, k, n = int(rng.integers(1, 90)), int(rng.integers(1, 200)), int(rng.choice([1, 1, 2, 3, 8, 17, 31, 33, 64, 100, 130]))
    density = float(rng.choice([0.0, 0.01, 0.05, 0.2, 0.5, 1.0]))
    dense = np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0).astype(np.float32)
    if seed % 7 == 0:
        dense[rng.integers(0, m)] = rng.standard_normal(k)  # one dense row
    dtype = str(rng.choice(["float32", "float16", "bfloat16"]))
    layout = str(rng.choice(["kn", "nk"]))
    bias = rng.standard_normal(m) if rng.integers(0, 2) else None
    relu = bool(rng.integers(0, 2))
    config = _config(rng, layout, relu, dtype != "float32" and n % 8 == 0, n == 1)
    w = SparseMatrix.from_dense(dense).astype(dtype)
    make = (make_bitmap_plan if isinstance(config, BitmapConfig) else
            make_csr_plan if isinstance(config, (CsrConfig, CsrColumnsConfig)) else make_plan)
    return w, make(w, n, dtype, layout, config, bias, relu, 90), bias, relu


def test_every_mapping_on_random_problems_matches_float64():
    problems = [_problem(seed) for seed in range(KERNELS)]
    with ThreadPoolExecutor(16) as pool:
        built = list(pool.map(lambda p: compile_plan(p[1]), problems))
    mappings, wrong, cases = set(), [], 0
    for (w, plan, bias, relu), artefact in zip(problems, built):
        kernel = build_kernel(plan, 0, built=artefact)
        mappings.add(plan.mapping)
        dt = getattr(torch, plan.dtype)
        wd = torch.from_numpy(w.to_dense().astype(np.float64)).cuda()
        gen = torch.Generator(device="cuda").manual_seed(plan.M * 7919 + plan.N)
        for i in range(INPUTS):
            batch = (2,) if i % 3 == 2 else ()
            b = torch.randn((*batch, *kernel.in_shape), device="cuda", generator=gen).to(dt)
            out = torch.full((*batch, *kernel.out_shape), float("nan"), device="cuda", dtype=dt)
            kernel(b, out=out)
            ref = wd @ b.double() if plan.layout == "kn" else b.double() @ wd.T
            if bias is not None:
                bt = torch.as_tensor(bias, dtype=torch.float32, device="cuda").double()  # the kernel adds fp32 bias
                ref = ref + (bt[:, None] if plan.layout == "kn" else bt)
            if relu:
                ref = ref.clamp_min(0)
            cases += 1
            finite = bool(torch.isfinite(out).all())
            scale = ref.norm().item()
            err = ((out.double() - ref).norm().item() / scale) if scale else out.double().abs().max().item()
            if not finite or err > TOL[plan.dtype]:
                wrong.append((plan.name, i, finite, err))
    assert cases >= 2000 and len(problems) >= 200
    assert mappings >= {"row-groups", "row-per-block", "split-k", "staged-x", "csr", "csr-columns", "bitmap", "inline"}, mappings
    assert not wrong, f"{len(wrong)} of {cases} cases wrong, e.g. {wrong[:5]}"
