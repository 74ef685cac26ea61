"""GPU fuzz of the decode families in 16 bits: 200 kernels from seeded random problems (N = 1..64, shapes with
tails, densities from 0 to 1, fp16 and bf16, both layouts, bias, a residual where the family adds one, ReLU, the
gated MLP's silu(G x) * (U x) where the family has a gated kernel), each config drawn from the whole design space
of its problem (the default space and the trial configs: csr, csr-staged, csr-columns, tc-scatter, delta-runs
with 8- and 4-bit gaps, bitmap-tc with B from L2 or staged a block, bitmap, the generated kernels), each run on 5 fresh inputs (plain and batched)
into NaN-poisoned outputs against float64: 1,000 cases, 0 wrong. Kernels compile side by side (ptxas in threads),
then load and run."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from sparseforge import SparseMatrix
from sparseforge.mappings.registry import family_of
from sparseforge.runtime import build_kernel, compile_plan
from sparseforge.tune.space import search_space

pytestmark = pytest.mark.gpu
KERNELS, INPUTS = 200, 5
TOL = {"float16": 5e-3, "bfloat16": 3e-2}
WIDTHS = [1, 1, 1, 2, 3, 4, 5, 8, 8, 13, 16, 24, 33, 64]
GATED = " gated"


def _problem(seed: int):
    """(W, plan, bias, relu, residual, G) of one seeded problem: the config drawn from the problem's whole space
    until one plans (a config may refuse a shape or dtype: then the next). G: a gated kernel's gate (W is its
    up; no bias, ReLU or residual), else None."""
    rng = np.random.default_rng(10_000 + seed)
    m, k, n = int(rng.integers(1, 300)), int(rng.choice([7, 64, 333, 1030, 2056])), int(rng.choice(WIDTHS))
    density = float(rng.choice([0.0, 0.003, 0.05, 0.3, 0.5, 0.7, 0.9, 1.0]))
    dense = np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0).astype(np.float32)
    if seed % 7 == 0:
        dense[rng.integers(0, m)] = rng.standard_normal(k)  # one dense row
    dtype = str(rng.choice(["float16", "bfloat16"]))
    layout = str(rng.choice(["kn", "nk"]))
    bias = rng.standard_normal(m) if rng.integers(0, 2) else None
    relu = bool(rng.integers(0, 2))
    w = SparseMatrix.from_dense(dense).astype(dtype)
    space = search_space(n, layout, m, w.nnz / m, relu, unmeasured=True, dtype=dtype)
    # a kind (family, and delta-runs' gap width; gated where the family has a gated kernel) drawn first, then a
    # config of it: every kind the space holds is drawn about as often however many configs it proposes, so the
    # 200 problems cover them all
    kinds = sorted({_kind(c) for c in space} | {_kind(c) + GATED for c in space if family_of(c).gated})
    first = kinds[int(rng.integers(0, len(kinds)))]
    order = rng.permutation(len(space))
    for i in sorted(order, key=lambda i: _kind(space[int(i)]) != first.removesuffix(GATED)):
        config = space[int(i)]
        family = family_of(config)
        if first.endswith(GATED) and _kind(config) + GATED == first:
            gate = SparseMatrix.from_dense(np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0)
                                           .astype(np.float32)).astype(dtype)  # its own pattern
            try:
                plans = [family.hook("plan")(x, n, dtype, layout, config, None, False, 90) for x in (gate, w)]
                return w, family.hook("gated")(plans[0], None, plans[1], None), None, False, False, gate
            except ValueError:  # bitmap-tc below N = 8, several strips a warp: then a plain kernel
                pass
        residual = family.residual and bool(rng.integers(0, 2)) and not getattr(config, "segment_nnz", 0)
        try:
            plan = family.hook("plan")(w, n, dtype, layout, config, bias, relu, 90,
                                       **({"residual": True} if residual else {}))
        except ValueError:
            continue
        if family.render is not None:  # composites (split-24) have their own tests
            return w, plan, bias, relu, residual, None
    raise AssertionError(f"seed {seed}: no config of the space plans")


def _kind(config) -> str:
    gap = getattr(config, "gap_bits", None)
    return (family_of(config).name + (f" g{gap}" if gap is not None else "")
            + (" b shared" if getattr(config, "b_shared", 0) else ""))


def test_decode_families_on_random_problems_match_float64():
    problems = [_problem(seed) for seed in range(KERNELS)]
    with ThreadPoolExecutor(16) as pool:
        built = list(pool.map(lambda p: compile_plan(p[1]), problems))
    mappings, wrong, cases = set(), [], 0
    for (w, plan, bias, relu, residual, gate), artefact in zip(problems, built):
        kernel = build_kernel(plan, 0, built=artefact)
        mappings.add(_kind(plan.config) + (GATED if gate is not None else ""))
        dt = getattr(torch, plan.dtype)
        wd = torch.from_numpy(w.to_dense().astype(np.float64)).cuda()
        gen = torch.Generator(device="cuda").manual_seed(plan.M * 7919 + plan.N)
        for i in range(INPUTS):
            batch = (2,) if i % 3 == 2 and kernel.max_batch > 1 else ()  # k_split: a batch entry a launch
            b = torch.randn((*batch, *kernel.in_shape), device="cuda", generator=gen).to(dt)
            out = torch.full((*batch, *kernel.out_shape), float("nan"), device="cuda", dtype=dt)
            r = torch.randn((*batch, *kernel.out_shape), device="cuda", generator=gen).to(dt) if residual else None
            kernel(b, out=out) if r is None else kernel(b, residual=r, out=out)
            ref = wd @ b.double() if plan.layout == "kn" else b.double() @ wd.T
            if gate is not None:  # silu(G x) * (W x)
                gd = torch.from_numpy(gate.to_dense().astype(np.float64)).cuda()
                g = gd @ b.double() if plan.layout == "kn" else b.double() @ gd.T
                ref = g * torch.sigmoid(g) * ref
            if bias is not None:
                bt = torch.as_tensor(bias, dtype=torch.float32, device="cuda").double()  # the kernel adds fp32 bias
                ref = ref + (bt[:, None] if plan.layout == "kn" else bt)
            if r is not None:
                ref = ref + r.double()
            if relu:
                ref = ref.clamp_min(0)
            cases += 1
            finite = bool(torch.isfinite(out).all())
            scale = ref.norm().item()
            err = ((out.double() - ref).norm().item() / scale) if scale else out.double().abs().max().item()
            if not finite or err > TOL[plan.dtype]:
                wrong.append((plan.name, i, finite, err))
    assert cases >= 1000
    assert mappings >= {"csr", "tc-scatter", "delta-runs g8", "delta-runs g4", "bitmap-tc", "delta-runs g8" + GATED,
                        "bitmap-tc" + GATED, "bitmap-tc b shared"}, mappings
    assert not wrong, f"{len(wrong)} of {cases} cases wrong, e.g. {wrong[:5]}"
