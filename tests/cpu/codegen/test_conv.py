"""The direct sparse convolution kernel (codegen/conv.py) run by the PTX interpreter against torch's conv2d
in float64, into NaN-poisoned outputs; its NaN semantics at the padding; ptxas for sm_90 / sm_80."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseforge import SparseMatrix
from sparseforge.codegen import render
from sparseforge.plan.conv import ConvGeometry, make_conv_plan
from sparseforge.plan.csr import CsrColumnsConfig

from .ptx_interp import launch
from .test_interpreted import _decode, _encode, _poisoned, assert_matches
from .test_ptx import _assemble_without_spills_and_link


def run_conv(plan, x: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    """The kernel on x ([batch,] Cin x H x W) as ConvKernel launches it; float64 out."""
    g = plan.geometry
    batch = x.shape[0] if x.ndim == 4 else 1
    out = _poisoned((batch, *g.output_shape[1:]), plan.dtype)
    arrays = [_encode(a.astype(np.float64), plan.dtype) if kind == "values" else a for a, kind in plan.weight_arrays()]
    bias = None if plan.bias is None else np.asarray(plan.bias, np.float32)
    extra = [_encode(residual, plan.dtype)] if plan.residual else []
    launch(render(plan).text, plan.name, (*plan.grid, batch), plan.threads, _encode(x, plan.dtype), out, *arrays,
           bias, *extra)
    return _decode(out, plan.dtype)


def _reference(x, w4, g, dtype, bias, residual, relu):
    """float64 conv of what the kernel sees: x, W and residual rounded to the dtype, the bias to fp32."""
    rounded = lambda a: _decode(_encode(np.asarray(a, np.float64), dtype), dtype)  # noqa: E731
    out = F.conv2d(torch.from_numpy(rounded(x)), torch.from_numpy(rounded(w4)),
                   None if bias is None else torch.from_numpy(np.asarray(bias, np.float32).astype(np.float64)),
                   g.stride, g.padding, g.dilation, g.groups)
    if residual is not None:
        out = out + torch.from_numpy(rounded(residual))
    return (out.clamp_min(0) if relu else out).numpy()


@st.composite
def conv_problems(draw):
    """Kernels 1x1 to 7x7 and 1xk / kx1, stride, padding (up to past the kernel's reach), dilation, groups
    (depthwise included), batch, every dtype, bias / ReLU / residual, any csr-columns config the
    convolution takes; densities from empty to full."""
    kh, kw = draw(st.sampled_from([(1, 1), (3, 3), (5, 5), (7, 7), (1, 3), (3, 1), (1, 5), (2, 3)]))
    groups = draw(st.sampled_from([1, 2, 4]))
    cin = groups * draw(st.integers(1, 3))
    cout = groups * draw(st.integers(1, 3))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = (draw(st.integers(0, kh)), draw(st.integers(0, kw)))
    low_h = max(1, dilation[0] * (kh - 1) + 1 - 2 * padding[0])  # the smallest image the kernel fits
    low_w = max(1, dilation[1] * (kw - 1) + 1 - 2 * padding[1])
    h, w = draw(st.integers(low_h, max(low_h, 11))), draw(st.integers(low_w, max(low_w, 11)))
    config = CsrColumnsConfig(draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2])))
    return (ConvGeometry.of((draw(st.integers(1, 2)), cin, h, w), cout, (kh, kw), stride, padding, dilation, groups),
            config, draw(st.sampled_from([0.0, 0.2, 0.6, 1.0])), draw(st.sampled_from(["float32", "float16", "bfloat16"])),
            draw(st.integers(0, 2**16)))


@given(conv_problems())
@settings(max_examples=30, deadline=None)
def test_random_convolutions_match_float64_torch(problem):
    g, config, density, dtype, seed = problem
    rng = np.random.default_rng(seed)
    shape = (g.out_channels, g.channels // g.groups, *g.kernel)
    w4 = np.where(rng.random(shape) < density, rng.standard_normal(shape), 0).astype(np.float32)
    bias = rng.standard_normal(g.out_channels) if seed % 2 else None
    relu, residual = seed % 3 == 0, (rng.standard_normal(g.output_shape) if seed % 5 < 2 else None)
    plan = make_conv_plan(SparseMatrix.from_dense(w4.reshape(g.out_channels, -1)), g, dtype, config, bias, relu,
                          residual is not None)
    x = rng.standard_normal(g.input_shape)
    got = run_conv(plan, x, residual)
    ref = _reference(x, w4, g, dtype, bias, residual, relu)
    assert_matches(got, ref, dtype)


def test_a_nan_pixel_poisons_exactly_its_receptive_outputs_and_padding_multiplies_nothing():
    """x holds NaN at one pixel and inf all along its border row; the padding taps read nothing, so only the
    outputs whose window holds the NaN pixel at a nonzero weight are NaN (dense im2col with a zero border
    would give 0 * inf = NaN at the border too, and cuDNN NaN wherever the weight is zero)."""
    g = ConvGeometry.of((1, 1, 6, 6), 1, 3, padding=1)
    w4 = np.zeros((1, 1, 3, 3), np.float32)
    w4[0, 0, 0, 0] = 1.0  # only the top-left tap: y[i, j] = x[i - 1, j - 1]
    plan = make_conv_plan(SparseMatrix.from_dense(w4.reshape(1, -1)), g, config=CsrColumnsConfig(1, 1, 1))
    x = np.ones((1, 1, 6, 6))
    x[0, 0, 2, 3] = np.nan
    got = run_conv(plan, x)[0, 0]
    assert np.isnan(got[3, 4]) and np.isnan(got).sum() == 1
    assert got[0].tolist() == [0.0] * 6 and got[:, 0].tolist() == [0.0] * 6  # taps in the padding: nothing


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rn50_and_vgg_shaped_convolutions_assemble_without_spills(arch, dtype):
    rng = np.random.default_rng(0)
    for shape, cout, kernel, stride, padding in (((1, 256, 14, 14), 256, 3, 1, 1), ((1, 3, 224, 224), 64, 7, 2, 3),
                                                 ((1, 64, 224, 224), 64, 3, 1, 1), ((1, 300, 1, 64), 100, (1, 5), 1, 0)):
        g = ConvGeometry.of(shape, cout, kernel, stride, padding)
        w = np.where(rng.random(g.weight_shape) < 0.1, rng.standard_normal(g.weight_shape), 0).astype(np.float32)
        for config in (CsrColumnsConfig(1, 1, 4), CsrColumnsConfig(2, 4, 1)):
            plan = make_conv_plan(SparseMatrix.from_dense(w), g, dtype, config, np.ones(cout), True, True, arch)
            _assemble_without_spills_and_link(render(plan), arch)
