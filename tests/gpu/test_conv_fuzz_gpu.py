"""GPU fuzz of the direct sparse convolution: 150 kernels from seeded random geometries (kernels 1x1 to
7x7, 1xk, kx1, stride, padding past the kernel's reach, dilation, groups incl. depthwise, batch), every
dtype, bias / ReLU / residual, each on 4 fresh inputs into NaN-poisoned outputs against torch's float64
conv2d, in NCHW and in NHWC (channels_last tensors). Kernels compile side by side (ptxas in threads), then
load and run."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sparseforge import SparseMatrix
from sparseforge.plan.conv import ConvGeometry, make_conv_plan
from sparseforge.mappings.csr.plan import CsrColumnsConfig
from sparseforge.runtime import compile_plan
from sparseforge.runtime.conv import ConvKernel

pytestmark = pytest.mark.gpu
KERNELS, INPUTS = 150, 4
TOL = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}


def _problem(seed: int, layout: str = "nchw"):
    rng = np.random.default_rng(seed)
    kh, kw = [(1, 1), (3, 3), (5, 5), (7, 7), (1, 3), (3, 1), (1, 5), (2, 3)][int(rng.integers(0, 8))]
    groups = int(rng.choice([1, 1, 2, 4]))
    cin, cout = groups * int(rng.integers(1, 9)), groups * int(rng.integers(1, 9))
    if seed % 9 == 0:
        groups = cin = cout = int(rng.choice([8, 32]))  # depthwise
    stride, dilation = tuple(int(v) for v in rng.integers(1, 4, 2)), tuple(int(v) for v in rng.integers(1, 3, 2))
    padding = (int(rng.integers(0, kh + 1)), int(rng.integers(0, kw + 1)))
    low = (max(1, dilation[0] * (kh - 1) + 1 - 2 * padding[0]), max(1, dilation[1] * (kw - 1) + 1 - 2 * padding[1]))
    h, w = int(rng.integers(low[0], low[0] + 30)), int(rng.integers(low[1], low[1] + 30))
    g = ConvGeometry.of((int(rng.integers(1, 4)), cin, h, w), cout, (kh, kw), stride, padding, dilation, groups,
                        layout)
    density = float(rng.choice([0.0, 0.05, 0.2, 0.5, 1.0]))
    shape = (cout, cin // groups, kh, kw)
    w4 = np.where(rng.random(shape) < density, rng.standard_normal(shape), 0).astype(np.float32)
    dtype = str(rng.choice(["float32", "float16", "bfloat16"]))
    bias = rng.standard_normal(cout) if rng.integers(0, 2) else None
    relu, residual = bool(rng.integers(0, 2)), bool(rng.integers(0, 2))
    config = CsrColumnsConfig(int(rng.choice([1, 2])), int(rng.choice([1, 2, 4, 8])), 1)
    weight = SparseMatrix.from_dense(w4.reshape(cout, -1)).astype(dtype)
    return w4, make_conv_plan(weight, g, dtype, config, bias, relu, residual), bias


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_random_convolutions_match_float64(layout):
    memory = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    problems = [_problem(seed, layout) for seed in range(KERNELS)]
    with ThreadPoolExecutor(16) as pool:
        built = list(pool.map(lambda p: compile_plan(p[1]), problems))
    wrong, cases = [], 0
    for (w4, plan, bias), artefact in zip(problems, built):
        kernel = ConvKernel(plan, artefact, 0)
        g, dt = plan.geometry, getattr(torch, plan.dtype)
        weight = torch.from_numpy(w4).to(dt).double().cuda()  # the weights as the kernel holds them
        gen = torch.Generator(device="cuda").manual_seed(seed_of(plan))
        for i in range(INPUTS):
            batch = g.batch if i % 2 else 1
            x = torch.randn((batch, *g.input_shape[1:]), device="cuda", generator=gen).to(dt, memory_format=memory)
            r = torch.randn((batch, *g.output_shape[1:]), device="cuda", generator=gen).to(dt, memory_format=memory) \
                if plan.residual else None
            out = torch.full((batch, *g.output_shape[1:]), float("nan"), device="cuda", dtype=dt).contiguous(
                memory_format=memory)
            kernel(x, out=out, residual=r)
            ref = F.conv2d(x.double(), weight, None if bias is None else
                           torch.as_tensor(bias, dtype=torch.float32, device="cuda").double(),
                           g.stride, g.padding, g.dilation, g.groups)
            if r is not None:
                ref = ref + r.double()
            if plan.relu:
                ref = ref.clamp_min(0)
            cases += 1
            scale = ref.norm().item()
            err = ((out.double() - ref).norm().item() / scale) if scale else out.double().abs().max().item()
            if not bool(torch.isfinite(out).all()) or err > TOL[plan.dtype]:
                wrong.append((plan.name, i, err))
    assert cases >= 600
    assert not wrong, f"{len(wrong)} of {cases} cases wrong, e.g. {wrong[:5]}"


def seed_of(plan) -> int:
    return plan.M * 7919 + plan.N
