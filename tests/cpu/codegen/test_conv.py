"""The direct sparse convolution's kernels run by the PTX interpreter against torch's conv2d in float64, into
NaN-poisoned outputs: the csr-columns kernel (codegen/conv.py) and the generated one over the zero-bordered
input (codegen/ptx.py with operands.py's BorderedConvInput); their NaN semantics at the padding; ptxas for
sm_90 / sm_80 on real layers."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseforge import SparseMatrix
from sparseforge.codegen import render
from sparseforge.plan import TileConfig
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
    assert _run_drawn(problem, run_conv).mapping == "conv-csr-columns"


def _run_drawn(problem, run):
    """A drawn problem's weight, epilogue (bias, ReLU, residual by its seed; split K takes neither ReLU nor a
    residual) and input, its plan run by `run` against the float64 reference; the plan back."""
    g, config, density, dtype, seed = problem
    rng = np.random.default_rng(seed)
    shape = (g.out_channels, g.channels // g.groups, *g.kernel)
    w4 = np.where(rng.random(shape) < density, rng.standard_normal(shape), 0).astype(np.float32)
    split = getattr(config, "segment_nnz", 0) > 0  # partial sums meet through atomics
    bias = rng.standard_normal(g.out_channels) if seed % 2 else None
    relu = seed % 3 == 0 and not split
    residual = rng.standard_normal(g.output_shape) if seed % 5 < 2 and not split else None
    # W in the kernel's dtype, as compile_conv2d hands it over: the generated kernels take its values as
    # immediates, so an fp32 W would be multiplied unrounded where the reference rounds it
    weight = SparseMatrix.from_dense(w4.reshape(g.out_channels, -1)).astype(dtype)
    plan = make_conv_plan(weight, g, dtype, config, bias, relu, residual is not None)
    x = rng.standard_normal(g.input_shape)
    assert_matches(run(plan, x, residual), _reference(x, w4, g, dtype, bias, residual, relu), dtype)
    return plan


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


# -- the generated mapping: every nonzero an immediate over the zero-bordered input (ConvTilePlan) ----------
TILINGS = [  # row groups, row per block (vector widths where the geometry allows), runs, split K, inline, chunks
    TileConfig(4, 4, 1), TileConfig(1, 2, 1, 16), TileConfig(2, 2, 4), TileConfig(8, 1, 2, 4, 2),
    TileConfig(4, 2, 1, segment_nnz=4), TileConfig(1, 2, 1, 16, inline=True),
    TileConfig(2, 4, 2, 16, cluster_rows=True, inline=True), TileConfig(2, 2, 1, chunk_k=8, groups_per_block=2),
]


def run_generated(plan, x: np.ndarray, residual: np.ndarray | None = None, guard: int = 64) -> np.ndarray:
    """The generated kernel on x ([batch,] Cin x H x W) as ConvKernel launches it: x copied inside a zero
    border, the split output channels zeroed; the output buffer NaN-poisoned, with `guard` more poisoned
    elements past it that must stay untouched. float64 out."""
    g = plan.geometry
    batch = x.shape[0] if x.ndim == 4 else 1
    (ph, pw), size = g.padding, batch * int(np.prod(g.output_shape[1:]))
    flat = np.pad(x.reshape(batch, *g.input_shape[1:]), ((0, 0), (0, 0), (ph, ph), (pw, pw))).reshape(batch, -1)
    # the buffer of shifted copies ConvKernel.bordered fills: copy j at i holds copy 0 at i + j
    bordered = np.zeros((batch, plan.shifts, plan.plane))
    for j in range(plan.shifts):
        bordered[:, j, :plan.plane - j] = flat[:, j:]
    out = _poisoned(size + guard, plan.dtype)
    y = out[:size].reshape(batch, *g.output_shape[1:])
    y[:, list(plan.partial_rows)] = _encode(np.zeros(1), plan.dtype)[0]
    extra = [_encode(residual, plan.dtype)] if plan.residual else []
    launch(render(plan).text, plan.name, (*plan.grid, batch), plan.threads, _encode(bordered, plan.dtype), out, *extra)
    assert np.isnan(_decode(out[size:], plan.dtype)).all(), "the kernel wrote past the output"
    return _decode(y, plan.dtype)


@st.composite
def generated_problems(draw):
    """Kernels 1x1 to 7x7 and 1xk / kx1 with odd image sizes, strides 1-3 (equal, and unequal now and then:
    the lane's base is computed, so they work too), padding 0-3, dilation 1-2, groups 1, 2 or depthwise,
    batch 1-2, every dtype, bias / ReLU / residual, any tiling (split K without ReLU or a residual)."""
    kh, kw = draw(st.sampled_from([(1, 1), (3, 3), (5, 5), (7, 7), (1, 3), (3, 1), (1, 5), (5, 1), (2, 3)]))
    kind = draw(st.sampled_from(["dense", "grouped", "depthwise"]))
    if kind == "depthwise":
        groups = cin = cout = draw(st.integers(1, 4))
    else:
        groups = 1 if kind == "dense" else 2
        cin, cout = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    s = draw(st.integers(1, 3))
    stride = (s, s) if draw(st.integers(0, 3)) else (s, draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
    low_h = max(1, dilation[0] * (kh - 1) + 1 - 2 * padding[0])
    low_w = max(1, dilation[1] * (kw - 1) + 1 - 2 * padding[1])
    h = draw(st.integers(low_h, max(low_h, 11)))
    w = draw(st.integers(low_w, max(low_w, 11)))
    geometry = ConvGeometry.of((draw(st.integers(1, 2)), cin, h, w), cout, (kh, kw), stride, padding, dilation, groups)
    return (geometry, draw(st.sampled_from(TILINGS)), draw(st.sampled_from([0.0, 0.3, 0.7, 1.0])),
            draw(st.sampled_from(["float32", "float16", "bfloat16"])), draw(st.integers(0, 2**16)))


@given(generated_problems())
@settings(max_examples=40, deadline=None)
def test_random_generated_convolutions_match_float64_torch(problem):
    plan = _run_drawn(problem, run_generated)
    assert plan.mapping.startswith("conv-") and plan.mapping != "conv-csr-columns"


@pytest.mark.parametrize("config", [TileConfig(4, 4, 1), TileConfig(1, 2, 4, inline=True)])
def test_a_wide_stride_and_vectors_where_the_geometry_allows_them(config):
    """Stride 2 (the lanes' reads two elements apart, bases computed per pixel) and a 1x1 kernel at stride 1
    whose rows are multiples of 4 (vector loads and stores of 4 pixels): both against torch."""
    rng = np.random.default_rng(1)
    for g in (ConvGeometry.of((2, 3, 13, 11), 5, 3, 2, 1), ConvGeometry.of((2, 6, 5, 8), 7, 1)):
        w4 = np.where(rng.random((g.out_channels, g.channels, *g.kernel)) < 0.5,
                      rng.standard_normal((g.out_channels, g.channels, *g.kernel)), 0).astype(np.float32)
        residual = rng.standard_normal(g.output_shape)
        plan = make_conv_plan(SparseMatrix.from_dense(w4.reshape(g.out_channels, -1)), g, "float16", config,
                              np.ones(g.out_channels), True, True)
        assert plan.config.vec == (config.vec if g.kernel == (1, 1) else 1)
        x = rng.standard_normal(g.input_shape)
        assert_matches(run_generated(plan, x, residual), _reference(x, w4, g, "float16", np.ones(g.out_channels),
                                                                    residual, True), "float16")


@pytest.mark.parametrize("config", [CsrColumnsConfig(1, 1, 1), TileConfig(1, 1, 1)], ids=["csr-columns", "generated"])
def test_a_nan_pixel_poisons_exactly_its_receptive_outputs_and_padding_multiplies_nothing(config):
    """x holds NaN at one pixel; the csr-columns kernel's padding taps read nothing and the generated kernel's
    read the border's zeros (times a finite immediate: zero), so only the outputs whose window holds the NaN
    pixel at a nonzero weight are NaN (cuDNN gives NaN wherever the weight is zero too)."""
    g = ConvGeometry.of((1, 1, 6, 6), 1, 3, padding=1)
    w4 = np.zeros((1, 1, 3, 3), np.float32)
    w4[0, 0, 0, 0] = 1.0  # only the top-left tap: y[i, j] = x[i - 1, j - 1]
    plan = make_conv_plan(SparseMatrix.from_dense(w4.reshape(1, -1)), g, config=config)
    x = np.ones((1, 1, 6, 6))
    x[0, 0, 2, 3] = np.nan
    got = (run_generated if isinstance(config, TileConfig) else run_conv)(plan, x)[0, 0]
    assert np.isnan(got[3, 4]) and np.isnan(got).sum() == 1
    assert got[0].tolist() == [0.0] * 6 and got[:, 0].tolist() == [0.0] * 6  # taps in the padding: nothing


REAL_LAYERS = {  # input shape, Cout, kernel, stride, padding at 90% sparsity: the generated kernels' real sizes
    "rn50_3x3_64": ((1, 64, 56, 56), 64, 3, 1, 1),
    "rn50_3x3_128_stride2": ((1, 128, 56, 56), 128, 3, 2, 1),
    "vgg16_conv3_256": ((1, 256, 56, 56), 256, 3, 1, 1),
}


def _real_plans(name: str, dtype: str, arch: int):
    """The cost model's pick for the layer, and fixed tilings of each mapping on the rn50 ones."""
    from sparseforge.conv import plan_conv2d

    shape, cout, kernel, stride, padding = REAL_LAYERS[name]
    g = ConvGeometry.of(shape, cout, kernel, stride, padding)
    rng = np.random.default_rng(0)
    w = SparseMatrix.from_dense(np.where(rng.random(g.weight_shape) < 0.1, rng.standard_normal(g.weight_shape),
                                         0).astype(np.float32)).astype(dtype)
    generated = [c for c in (plan_conv2d(w, g, dtype, np.ones(cout), arch=arch)[1].records) if c["family"] == "tile"]
    configs = [TileConfig(**min(generated, key=lambda r: r["predicted_us"])["config"])]
    if name == "rn50_3x3_64":
        configs += [TileConfig(4, 8, 1, 16), TileConfig(1, 4, 1, 16), TileConfig(4, 8, 1, 16, segment_nnz=64),
                    TileConfig(1, 4, 1, 16, inline=True),
                    # pairs of pixels a lane over two shifted copies (56 x 56, Wp = 58)
                    TileConfig(rows_per_group=4, warps_per_block=8, vec=2, load_batch=16),
                    TileConfig(rows_per_group=1, warps_per_block=4, vec=2, load_batch=16, inline=True)]
    elif name.startswith("rn50"):
        configs += [TileConfig(1, 4, 1, 16)]
    return [make_conv_plan(w, g, dtype, c, np.ones(cout), not c.segment_nnz, not c.segment_nnz, arch)
            for c in dict.fromkeys(configs)]


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("name, dtype", [("rn50_3x3_64", "float32"), ("rn50_3x3_64", "float16"),
                                         ("rn50_3x3_128_stride2", "float32"), ("vgg16_conv3_256", "float32")])
def test_generated_kernels_of_real_layers_assemble_without_spills(name, dtype, arch):
    for plan in _real_plans(name, dtype, arch):
        _assemble_without_spills_and_link(render(plan), arch)


@pytest.mark.parametrize("shape, kernel, padding, vec, dtype", [
    ((2, 3, 6, 8), 3, 1, 2, "float32"),    # Wp = 10: pairs, two copies
    ((1, 2, 8, 8), 5, 2, 4, "float16"),    # Wp = 12, OW = 8: fours, four copies
    ((1, 2, 7, 8), (3, 5), (1, 2), 4, "bfloat16"),
])
def test_vectors_over_shifted_copies_of_the_bordered_input(shape, kernel, padding, vec, dtype):
    """A lane's vec pixels read each tap as one aligned vector from the copy shifted by the tap's column
    offset mod vec (the harness fills the copies as ConvKernel.bordered does)."""
    rng = np.random.default_rng(vec)
    g = ConvGeometry.of(shape, 5, kernel, 1, padding)
    w4 = np.where(rng.random((5, shape[1], *g.kernel)) < 0.6, rng.standard_normal((5, shape[1], *g.kernel)), 0)
    w = SparseMatrix.from_dense(w4.reshape(5, -1).astype(np.float32)).astype(dtype)
    plan = make_conv_plan(w, g, dtype, TileConfig(rows_per_group=2, warps_per_block=1, vec=vec), relu=True)
    assert plan.config.vec == vec and plan.shifts == vec
    x = rng.standard_normal(shape)
    assert_matches(run_generated(plan, x), _reference(x, w4.astype(np.float32), g, dtype, None, None, True), dtype)
