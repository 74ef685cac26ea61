"""The direct sparse convolution's kernels run by the PTX interpreter against torch's conv2d in float64, into
NaN-poisoned outputs: the csr-columns kernel (codegen/conv.py) and the generated one over the zero-bordered
input (codegen/ptx.py with operands.py's BorderedConvInput), in NCHW and NHWC (channels_last: the harness
lays x, residual and output out in that memory order, the reference stays NCHW); their NaN semantics at the
padding; ptxas for sm_90 / sm_80 on real layers."""
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
from sparseforge.mappings.csr.plan import CsrColumnsConfig

from .ptx_interp import launch
from .ptx_interp import launch as launch_ptx
from .test_interpreted import _decode, _encode, _poisoned, assert_matches
from .test_ptx import _assemble_without_spills_and_link


def in_memory_order(a: np.ndarray, g) -> np.ndarray:
    """An NCHW-semantics array ([batch,] C x H x W) as the geometry's layout lays it out in memory."""
    a = a.reshape(-1, *a.shape[-3:])
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)) if g.layout == "nhwc" else a


def from_memory_order(a: np.ndarray, g) -> np.ndarray:
    """in_memory_order's inverse: [batch,] C x H x W again."""
    return np.ascontiguousarray(a.transpose(0, 3, 1, 2)) if g.layout == "nhwc" else a


def run_conv(plan, x: np.ndarray, residual: np.ndarray | None = None, guard: int = 64) -> np.ndarray:
    """The kernel on x ([batch,] Cin x H x W, laid out in the plan's layout first) as ConvKernel launches it,
    into a NaN-poisoned output with `guard` more poisoned elements past it that must stay untouched; float64
    out, NCHW."""
    g = plan.geometry
    batch = x.shape[0] if x.ndim == 4 else 1
    size = batch * int(np.prod(g.output_shape[1:]))
    out = _poisoned(size + guard, plan.dtype)
    arrays = [_encode(a.astype(np.float64), plan.dtype) if kind == "values" else a for a, kind in plan.weight_arrays()]
    bias = None if plan.bias is None else np.asarray(plan.bias, np.float32)
    extra = [_encode(in_memory_order(residual, g), plan.dtype)] if plan.residual else []
    launch(render(plan).text, plan.name, (*plan.grid, batch), plan.threads, _encode(in_memory_order(x, g), plan.dtype),
           out, *arrays, bias, *extra)
    assert np.isnan(_decode(out[size:], plan.dtype)).all(), "the kernel wrote past the output"
    return from_memory_order(_decode(out[:size], plan.dtype).reshape(batch, *g.output_memory_shape[1:]), g)


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
def conv_problems(draw, layout: str = "nchw"):
    """Kernels 1x1 to 7x7 and 1xk / kx1, stride, padding (up to past the kernel's reach), dilation, groups
    (depthwise included), batch, every dtype, bias / ReLU / residual, any csr-columns config the
    convolution takes; densities from empty to full; in `layout`."""
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
    return (ConvGeometry.of((draw(st.integers(1, 2)), cin, h, w), cout, (kh, kw), stride, padding, dilation, groups,
                            layout),
            config, draw(st.sampled_from([0.0, 0.2, 0.6, 1.0])), draw(st.sampled_from(["float32", "float16", "bfloat16"])),
            draw(st.integers(0, 2**16)))


@given(conv_problems())
@settings(max_examples=30, deadline=None)
def test_random_convolutions_match_float64_torch(problem):
    assert _run_drawn(problem, run_conv).mapping == "conv-csr-columns"


@given(conv_problems("nhwc"))
@settings(max_examples=30, deadline=None)
def test_random_nhwc_convolutions_match_float64_torch(problem):
    """The csr-columns kernel reading a channels_last x where it lies (pixel bases times Cin, offsets
    (r*dh*W + s*dw)*Cin + channel) and storing n*Cout + co."""
    plan = _run_drawn(problem, run_conv)
    assert plan.mapping == "conv-csr-columns" and plan.name.startswith("conv2d_nhwc_")


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
    border (NCHW in either layout: the launch's copy transposes a channels_last x), the split output
    channels zeroed; the output buffer NaN-poisoned (in the plan's layout), with `guard` more poisoned
    elements past it that must stay untouched. float64 out, NCHW."""
    g = plan.geometry
    batch = x.shape[0] if x.ndim == 4 else 1
    (ph, pw), size = g.padding, batch * int(np.prod(g.output_shape[1:]))
    flat = np.pad(x.reshape(batch, *g.input_shape[1:]), ((0, 0), (0, 0), (ph, ph), (pw, pw))).reshape(batch, -1)
    # the buffer of shifted copies ConvKernel.bordered fills: copy j at i holds copy 0 at i + j
    bordered = np.zeros((batch, plan.shifts, plan.plane))
    for j in range(plan.shifts):
        bordered[:, j, :plan.plane - j] = flat[:, j:]
    out = _poisoned(size + guard, plan.dtype)
    y = out[:size].reshape(batch, *g.output_memory_shape[1:])
    channels = (slice(None),) * (3 if g.layout == "nhwc" else 1) + (list(plan.partial_rows),)
    y[channels] = _encode(np.zeros(1), plan.dtype)[0]  # ConvKernel's index_fill_ along the channel dimension
    extra = [_encode(in_memory_order(residual, g), plan.dtype)] if plan.residual else []
    launch(render(plan).text, plan.name, (*plan.grid, batch), plan.threads, _encode(bordered, plan.dtype), out, *extra)
    assert np.isnan(_decode(out[size:], plan.dtype)).all(), "the kernel wrote past the output"
    return from_memory_order(_decode(y, plan.dtype), g)


@st.composite
def generated_problems(draw, layout: str = "nchw"):
    """Kernels 1x1 to 7x7 and 1xk / kx1 with odd image sizes, strides 1-3 (equal, and unequal now and then:
    the lane's base is computed, so they work too), padding 0-3, dilation 1-2, groups 1, 2 or depthwise,
    batch 1-2, every dtype, bias / ReLU / residual, any tiling (split K without ReLU or a residual); in
    `layout`."""
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
    geometry = ConvGeometry.of((draw(st.integers(1, 2)), cin, h, w), cout, (kh, kw), stride, padding, dilation, groups,
                               layout)
    return (geometry, draw(st.sampled_from(TILINGS)), draw(st.sampled_from([0.0, 0.3, 0.7, 1.0])),
            draw(st.sampled_from(["float32", "float16", "bfloat16"])), draw(st.integers(0, 2**16)))


@given(generated_problems())
@settings(max_examples=40, deadline=None)
def test_random_generated_convolutions_match_float64_torch(problem):
    plan = _run_drawn(problem, run_generated)
    assert plan.mapping.startswith("conv-") and plan.mapping != "conv-csr-columns"


@given(generated_problems("nhwc"))
@settings(max_examples=40, deadline=None)
def test_random_nhwc_generated_convolutions_match_float64_torch(problem):
    """The generated kernel over the bordered NCHW copy, storing NHWC: a thread's vec pixels Cout elements
    apart, runs of aligned consecutive channels one vector, split K's atomic adds in pairs (16-bit)."""
    plan = _run_drawn(problem, run_generated)
    assert plan.mapping.startswith("conv-") and plan.name.startswith("conv2d_imm_nhwc_")


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


# -- NHWC: channels_last x, output and residual ---------------------------------------------------------------
def _nhwc_case(shape, cout, kernel, padding, dtype, config, density, seed, split=False):
    """A plan in nhwc over a random weight, with bias and (unless split) ReLU and a residual; its kernel run
    against the float64 reference. Returns the plan and its PTX text."""
    rng = np.random.default_rng(seed)
    g = ConvGeometry.of(shape, cout, kernel, 1, padding, layout="nhwc")
    w4 = np.where(rng.random((cout, shape[1], *g.kernel)) < density,
                  rng.standard_normal((cout, shape[1], *g.kernel)), 0).astype(np.float32)
    bias = rng.standard_normal(cout)
    residual = None if split else rng.standard_normal(g.output_shape)
    plan = make_conv_plan(SparseMatrix.from_dense(w4.reshape(cout, -1)).astype(dtype), g, dtype, config, bias,
                          not split, not split)
    x = rng.standard_normal(shape)
    run = run_generated if isinstance(config, TileConfig) else run_conv
    assert_matches(run(plan, x, residual), _reference(x, w4, g, dtype, bias, residual, not split), dtype)
    return plan, render(plan).text


@pytest.mark.parametrize("dtype, rows, store", [("float32", 4, "st.global.v4.b32"), ("float16", 8, "st.global.v4.b32"),
                                                ("bfloat16", 4, "st.global.v2.b32"), ("float16", 2, "st.global.b32")])
def test_nhwc_stores_runs_of_aligned_channels_as_one_vector_per_pixel(dtype, rows, store):
    """Cout = 8, a full W: every group is `rows` consecutive channels from a multiple of `rows`, so each of a
    thread's two pixels (vec 2 over two shifted copies; Cout elements apart in NHWC) stores them as one
    vector, and its residual is one vector load too; the output pointer must be aligned to it."""
    plan, text = _nhwc_case((2, 3, 6, 8), 8, 3, 1, dtype, TileConfig(rows, 1, 2), 1.0, rows)
    assert plan.config.vec == 2 and plan.shifts == 2
    assert all(count == rows for g in plan.groups for _, count in plan.store_runs(g))
    assert store in text and plan.output_alignment == rows * plan.element_bytes


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("config", [TileConfig(3, 2, 4), TileConfig(4, 1, 4, cluster_rows=True),
                                    TileConfig(2, 2, 4, inline=True), TileConfig(4, 1, 2, chunk_k=5, groups_per_block=2)],
                         ids=lambda c: c.short())
def test_nhwc_vectors_of_four_pixels_with_ragged_channel_runs(config, dtype):
    """A 1x1 layer with rows of 8 (four pixels a lane, or two), Cout = 6 (pairs at most), groups of 3 rows
    or clustered ones: runs of every length and alignment, each pixel's stored apart; against float64."""
    plan, _ = _nhwc_case((2, 5, 4, 8), 6, 1, 0, dtype, config, 0.6, 3)
    assert plan.config.vec == config.vec and plan.output_alignment in (plan.element_bytes, 2 * plan.element_bytes)


@pytest.mark.parametrize("dtype, pair", [("float32", None), ("float16", "red.global.add.noftz.f16x2"),
                                         ("bfloat16", "red.global.add.noftz.bf16x2")])
def test_nhwc_split_k_adds_partial_channels_into_the_zeroed_strided_rows(dtype, pair):
    """Split K in nhwc: the launch zeroes the split channels (a strided set of elements in NHWC), the pieces
    add into them atomically, two neighbouring channels at once in 16-bit types."""
    plan, text = _nhwc_case((1, 4, 6, 8), 8, 3, 1, dtype, TileConfig(4, 1, 2, segment_nnz=12), 1.0, 5, split=True)
    assert plan.partial_rows and plan.mapping == "conv-split-k"
    assert pair is None or pair in text
    if pair is None:
        assert "red.global.add.f32" in text


@pytest.mark.parametrize("config", [CsrColumnsConfig(1, 1, 2), CsrColumnsConfig(2, 2, 1)])
def test_nhwc_csr_columns_with_channels_past_the_offsets_of_taps(config):
    """Many channels and a dilated 3x3 kernel in nhwc: each slot's offset is (r*dh*W + s*dw)*Cin + channel
    from a base times Cin; groups of 2 (each group's channels start at g*Cin/2)."""
    rng = np.random.default_rng(7)
    g = ConvGeometry.of((2, 12, 7, 9), 6, 3, 1, 2, 2, 2, layout="nhwc")
    w4 = np.where(rng.random((6, 6, 3, 3)) < 0.5, rng.standard_normal((6, 6, 3, 3)), 0).astype(np.float32)
    residual = rng.standard_normal(g.output_shape)
    plan = make_conv_plan(SparseMatrix.from_dense(w4.reshape(6, -1)), g, "float32", config, None, True, True)
    x = rng.standard_normal(g.input_shape)
    assert_matches(run_conv(plan, x, residual), _reference(x, w4, g, "float32", None, residual, True), "float32")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_nhwc_kernels_of_real_layers_assemble_without_spills(dtype):
    """rn50's 3x3 64-channel layer in nhwc, sm_90: csr-columns (its loads Cin apart) and the generated
    tilings (row groups of 8 channels: vector stores of each pixel's channels; split K's paired adds; pairs
    of pixels over shifted copies); the VGG and text CNN shapes in csr-columns."""
    rng = np.random.default_rng(0)
    plans = []
    for shape, cout, kernel, stride, padding in (((1, 64, 56, 56), 64, 3, 1, 1), ((1, 256, 14, 14), 256, 3, 1, 1),
                                                 ((1, 300, 1, 64), 100, (1, 5), 1, 0)):
        g = ConvGeometry.of(shape, cout, kernel, stride, padding, layout="nhwc")
        w = SparseMatrix.from_dense(np.where(rng.random(g.weight_shape) < 0.1, rng.standard_normal(g.weight_shape),
                                             0).astype(np.float32)).astype(dtype)
        plans += [make_conv_plan(w, g, dtype, c, np.ones(cout), True, True) for c in (CsrColumnsConfig(1, 1, 4),
                                                                                      CsrColumnsConfig(2, 4, 1))]
        if cout == 64:
            plans += [make_conv_plan(w, g, dtype, c, np.ones(cout), not c.segment_nnz, not c.segment_nnz)
                      for c in (TileConfig(8, 8, 1, 16), TileConfig(4, 8, 2, 16), TileConfig(8, 8, 1, 16, segment_nnz=64),
                                TileConfig(1, 4, 2, 16, inline=True))]
    for plan in plans:
        assert plan.geometry.layout == "nhwc"
        _assemble_without_spills_and_link(render(plan), 90)


def _interpreted_conv_kernel(plan):
    """A ConvKernel over `plan` on the CPU whose raw launch runs the PTX interpreter over the torch tensors'
    own memory (found by their pointers): ConvKernel.__call__ end to end, its checks, output allocation,
    bordered copy, split-channel zeroing and in-place residual included."""
    from sparseforge.plan.conv import ConvTilePlan
    from sparseforge.runtime.conv import ConvKernel

    conv = ConvKernel.__new__(ConvKernel)
    conv.plan, conv._data, conv.device_index = plan, None, 0
    conv._dtype, conv._device = getattr(torch, plan.dtype), torch.device("cpu")
    conv._partial = torch.tensor(plan.partial_rows, dtype=torch.long) if plan.partial_rows else None
    conv._init_call_state()  # shapes, the bordered buffer, the lean call's state: as the constructor makes them
    conv.tensors = []  # every tensor a call may hand the launch, to find by pointer

    def memory(t):
        # a dense tensor's storage in memory order, as a numpy view (bf16 as its 16-bit patterns)
        flat = torch.as_strided(t, (t.numel(),), (1,))
        return (flat.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else flat.numpy())

    def launch(x_ptr, y_ptr, batch, stream, *residual_ptr):
        found = {t.data_ptr(): t for t in conv.tensors + [conv._bordered] if t is not None}
        weights = []
        if not isinstance(plan, ConvTilePlan):
            weights = [_encode(a.astype(np.float64), plan.dtype) if kind == "values" else a
                       for a, kind in plan.weight_arrays()]
            weights.append(None if plan.bias is None else np.asarray(plan.bias, np.float32))
        launch_ptx(render(plan).text, plan.name, (*plan.grid, batch), plan.threads, memory(found[x_ptr]),
                   memory(found[y_ptr]), *weights, *(memory(found[p]) for p in residual_ptr))

    conv.launch = launch
    return conv


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("config", [CsrColumnsConfig(2, 1, 2), TileConfig(4, 1, 2), TileConfig(2, 1, 1, segment_nnz=10)],
                         ids=["csr-columns", "generated-vec2", "split-k"])
def test_conv_kernel_calls_run_by_the_interpreter_in_either_layout(config, dtype, layout, monkeypatch):
    """ConvKernel.__call__ as on the GPU: x, out and residual as torch tensors in the layout (channels_last
    for nhwc), a given NaN-poisoned out, and residual as out (an in-place add); every result against the
    float64 reference."""
    import types

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    rng = np.random.default_rng(11)
    split = config.__class__ is TileConfig and config.segment_nnz > 0
    g = ConvGeometry.of((2, 3, 6, 8), 8, 3, 1, 1, layout=layout)
    w4 = np.where(rng.random((8, 3, 3, 3)) < 0.6, rng.standard_normal((8, 3, 3, 3)), 0).astype(np.float32)
    bias = rng.standard_normal(8)
    plan = make_conv_plan(SparseMatrix.from_dense(w4.reshape(8, -1)).astype(dtype), g, dtype, config, bias,
                          not split, not split)
    conv = _interpreted_conv_kernel(plan)
    memory = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    torch_dtype = getattr(torch, dtype)
    x = torch.from_numpy(rng.standard_normal(g.input_shape)).to(torch_dtype).contiguous(memory_format=memory)
    residual = None if split else torch.from_numpy(rng.standard_normal(g.output_shape)).to(torch_dtype).contiguous(
        memory_format=memory)
    ref = _reference(x.double().numpy(), w4, g, dtype, bias, None if split else residual.double().numpy(), not split)
    extra = {} if split else {"residual": residual}
    conv.tensors = [x] + ([] if split else [residual])
    if split:  # a fresh output is zeroed only in the split channels: the others come from the kernel
        out = torch.full(g.output_shape, float("nan"), dtype=torch_dtype).contiguous(memory_format=memory)
        conv.tensors.append(out)
        results = [conv(x, out=out)]
    else:
        out = torch.full(g.output_shape, float("nan"), dtype=torch_dtype).contiguous(memory_format=memory)
        in_place = residual.clone()
        conv.tensors += [out, in_place]
        results = [conv(x, out=out, **extra), conv(x, out=in_place, residual=in_place)]
    for got in results:
        assert got.is_contiguous(memory_format=memory)
        assert_matches(got.double().numpy(), ref, dtype)
    if not split:
        assert torch.equal(results[0], results[1])
