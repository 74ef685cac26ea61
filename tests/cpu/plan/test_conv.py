"""The direct convolution plans (plan/conv.py): geometry as torch computes it, the csr-columns slots packed as
input offsets and taps, the generated mapping's groups, offsets into the bordered input, vector widths and
refusals, and the reference executor of both against torch's conv2d in float64, in NCHW and NHWC (the
executor takes and returns the layout's memory order; the tests convert)."""
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sparseforge import SparseMatrix
from sparseforge.plan import TileConfig
from sparseforge.plan.conv import (TAP_SHIFT, ConvGeometry, ConvTilePlan, conv_vector_width, execute_conv,
                                   expand_groups, make_conv_plan)
from sparseforge.mappings.csr.plan import CsrColumnsConfig


def _conv_weight(geometry, density=0.4, seed=0):
    rng = np.random.default_rng(seed)
    shape = (geometry.out_channels, geometry.channels // geometry.groups, *geometry.kernel)
    return np.where(rng.random(shape) < density, rng.standard_normal(shape), 0).astype(np.float32)


def _torch_conv(x, w4, geometry, bias=None, residual=None, relu=False):
    out = F.conv2d(torch.from_numpy(np.asarray(x, np.float64)), torch.from_numpy(w4.astype(np.float64)),
                   None if bias is None else torch.from_numpy(np.asarray(bias, np.float32).astype(np.float64)),
                   geometry.stride, geometry.padding, geometry.dilation, geometry.groups)
    if residual is not None:
        out = out + torch.from_numpy(residual)
    return (out.clamp_min(0) if relu else out).numpy()


@pytest.mark.parametrize("args", [
    ((1, 3, 224, 224), 64, 7, 2, 3, 1, 1), ((2, 64, 56, 56), 64, 3, 1, 1, 1, 1), ((1, 256, 14, 14), 256, 3, 2, 1, 1, 1),
    ((1, 8, 9, 11), 8, 3, 1, 2, 2, 8), ((3, 300, 1, 64), 100, (1, 5), 1, 0, 1, 1), ((1, 6, 10, 7), 4, (5, 1), (2, 1), (2, 0), 1, 2),
])
def test_output_shape_is_torchs(args):
    shape, cout, kernel, stride, padding, dilation, groups = args
    g = ConvGeometry.of(shape, cout, kernel, stride, padding, dilation, groups)
    w = torch.zeros(cout, shape[1] // groups, *g.kernel)
    assert g.output_shape == tuple(F.conv2d(torch.zeros(shape), w, None, stride, padding, dilation, groups).shape)
    assert g.weight_shape == (cout, shape[1] // groups * g.taps)


@pytest.mark.parametrize("bad,message", [
    (dict(input_shape=(1, 3, 8)), "batch, channels, height, width"),
    (dict(groups=2), "must divide channels"),
    (dict(kernel_size=(9, 9)), "81 taps"),
    (dict(kernel_size=(8, 8), input_shape=(1, 4, 16, 16)), "64 taps; the direct convolution takes at most 63"),
    (dict(kernel_size=5, padding=0, input_shape=(1, 4, 3, 3)), "does not fit"),
    (dict(stride=0), "stride must be >= 1"),
    (dict(padding=-1), "padding must be >= 0"),
    (dict(stride=1.5), "stride must be an int or a pair"),
    (dict(input_shape=(70000, 4, 8, 8)), "65535"),
    (dict(input_shape=(1, 1100, 256, 256)), "split the channels"),
    (dict(layout="NHWC"), "layout must be 'nchw' or 'nhwc'"),
    (dict(layout="channels_last"), "layout must be 'nchw' or 'nhwc'"),
    (dict(input_shape=(1, 8200, 300, 1000), kernel_size=1, padding=0, layout="nhwc"), "32-bit pixel base"),
    (dict(input_shape=(1, 4096, 256, 256), dilation=40, layout="nhwc"), "reaches offset"),
])
def test_geometry_refusals_name_the_problem(bad, message):
    args = dict(input_shape=(1, 4, 8, 8), out_channels=6, kernel_size=3, stride=1, padding=1, dilation=1, groups=1)
    args["out_channels"] = 5 if bad.get("groups") == 2 else 6
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=message):
        ConvGeometry.of(args.pop("input_shape"), **args)


def test_slots_pack_offset_and_tap():
    g = ConvGeometry.of((1, 4, 6, 5), 2, 3, padding=1, dilation=(1, 2), groups=2)
    w4 = np.zeros((2, 2, 3, 3), np.float32)
    w4[1, 1, 2, 0] = 3.0  # output channel 1 (group 1), its input channel 1 -> image channel 3; r = 2, s = 0
    plan = make_conv_plan(SparseMatrix.from_dense(w4.reshape(2, -1)), g)
    start, end = plan.rows[1]
    assert end - start == 1
    packed = int(plan.cols.view(np.uint32)[start])
    assert packed >> TAP_SHIFT == 2 * 3 + 0
    assert packed & ((1 << TAP_SHIFT) - 1) == 3 * 6 * 5 + 2 * 1 * 5 + 0 * 2


def _nhwc(a):
    """An NCHW-semantics array in channels_last memory order (batch, H, W, C)."""
    return np.ascontiguousarray(np.asarray(a).transpose(0, 2, 3, 1))


def _execute_in_layout(plan, x, residual=None):
    """execute_conv on NCHW-semantics arrays whatever the plan's layout: converted in, and the result back."""
    if plan.geometry.layout == "nchw":
        return execute_conv(plan, x, residual)
    got = execute_conv(plan, _nhwc(x), None if residual is None else _nhwc(residual))
    assert got.shape == plan.geometry.output_memory_shape[:1] + got.shape[1:] == (x.shape[0], *got.shape[1:])
    return got.transpose(0, 3, 1, 2)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("args", [
    ((2, 4, 7, 6), 6, 3, 1, 1, 1, 1), ((1, 4, 9, 9), 4, 3, 2, 1, 2, 4), ((1, 6, 8, 8), 4, (1, 3), (1, 2), (0, 1), 1, 2),
    ((1, 3, 12, 12), 5, 7, 2, 3, 1, 1),
])
def test_reference_executor_reads_the_packed_plan_back(args, layout):
    shape, cout, kernel, stride, padding, dilation, groups = args
    g = ConvGeometry.of(shape, cout, kernel, stride, padding, dilation, groups, layout)
    w4 = _conv_weight(g, seed=len(shape))
    bias = np.linspace(-1, 1, cout)
    plan = make_conv_plan(SparseMatrix.from_dense(w4.reshape(cout, -1)), g, bias=bias, relu=True, residual=True)
    rng = np.random.default_rng(1)
    x, residual = rng.standard_normal(g.input_shape), rng.standard_normal(g.output_shape)
    assert np.allclose(_execute_in_layout(plan, x, residual), _torch_conv(x, w4, g, bias, residual, relu=True),
                       atol=1e-10)


def test_nhwc_slots_pack_channels_innermost_offsets_and_the_executor_keeps_3d_inputs():
    g = ConvGeometry.of((1, 4, 6, 5), 2, 3, padding=1, dilation=(1, 2), groups=2, layout="nhwc")
    w4 = np.zeros((2, 2, 3, 3), np.float32)
    w4[1, 1, 2, 0] = 3.0  # output channel 1 (group 1), its input channel 1 -> image channel 3; r = 2, s = 0
    plan = make_conv_plan(SparseMatrix.from_dense(w4.reshape(2, -1)), g)
    start, end = plan.rows[1]
    packed = int(plan.cols.view(np.uint32)[start])
    assert end - start == 1 and packed >> TAP_SHIFT == 2 * 3 + 0
    assert packed & ((1 << TAP_SHIFT) - 1) == (2 * 1 * 5 + 0 * 2) * 4 + 3 == g.input_offset(3, 2, 0)
    assert g.pixel_stride == 4 and g.input_memory_shape == (1, 6, 5, 4) and g.output_memory_shape == (1, 6, 3, 2)
    assert plan.name.startswith("conv2d_nhwc_") and "nchw" not in plan.name
    x = np.random.default_rng(0).standard_normal((6, 5, 4))  # one image, H x W x C
    assert execute_conv(plan, x).shape == (6, 3, 2)
    assert np.allclose(execute_conv(plan, x), execute_conv(plan, x[None])[0])


def test_weight_of_the_wrong_shape_and_a_config_the_conv_cannot_take_are_refused():
    g = ConvGeometry.of((1, 4, 8, 8), 6, 3, padding=1)
    with pytest.raises(ValueError, match="needs 6 x 36"):
        make_conv_plan(SparseMatrix.from_dense(np.ones((6, 30), np.float32)), g)
    with pytest.raises(TypeError, match="CsrColumnsConfig"):
        make_conv_plan(SparseMatrix.from_dense(np.ones((6, 36), np.float32)), g, config=object())
    plan = make_conv_plan(SparseMatrix.from_dense(np.ones((6, 36), np.float32)), g, config=CsrColumnsConfig(2, 2, 2))
    assert plan.mapping == "conv-csr-columns" and plan.N == 64 and plan.grid == (1, 3)


def test_offsets_that_would_reach_the_tap_bits_groups_not_int_and_wide_lanes_are_refused():
    with pytest.raises(ValueError, match="reaches offset"):
        ConvGeometry.of((1, 1, 1, 256), 1, (2, 1), stride=2 ** 18, padding=2 ** 18, dilation=2 ** 18)
    with pytest.raises(TypeError, match="groups must be an int"):
        ConvGeometry.of((1, 4, 8, 8), 4, 3, groups=2.5)
    g = ConvGeometry.of((1, 4, 8, 8), 6, 3, padding=1)
    with pytest.raises(ValueError, match="columns .pixels a lane. in"):
        make_conv_plan(SparseMatrix.from_dense(np.ones((6, 36), np.float32)), g, "float16", CsrColumnsConfig(4))
    with pytest.raises(TypeError, match="columns must be an int"):
        CsrColumnsConfig(2.0)


# -- the generated mapping over the zero-bordered input (ConvTilePlan) ----------------------------------------
@pytest.mark.parametrize("args", [
    ((2, 4, 7, 6), 6, 3, 1, 1, 1, 1), ((1, 4, 9, 9), 4, 3, 2, 1, 2, 4), ((1, 6, 8, 8), 4, (1, 3), (1, 2), (0, 1), 1, 2),
    ((1, 3, 12, 12), 5, 7, 2, 3, 1, 1), ((2, 4, 11, 9), 6, (3, 1), (3, 2), (2, 0), (2, 1), 2),
    ((1, 8, 8, 8), 4, 1, 1, 0, 1, 1),
])
@pytest.mark.parametrize("config", [TileConfig(4, 4, 1), TileConfig(1, 2, 4), TileConfig(2, 2, 2, segment_nnz=5)])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_reference_executor_reads_the_generated_plan_through_its_offsets(args, config, layout):
    """Every stride pair (unequal too), padding, dilation and groups: each nonzero read at its constant offset
    from the pixel's base in the bordered input gives torch's convolution (nhwc: the input transposed into
    the bordered NCHW copy, the output laid out NHWC)."""
    shape, cout, kernel, stride, padding, dilation, groups = args
    g = ConvGeometry.of(shape, cout, kernel, stride, padding, dilation, groups, layout)
    w4 = _conv_weight(g, seed=len(shape))
    bias, split = np.linspace(-1, 1, cout), config.segment_nnz > 0
    plan = make_conv_plan(SparseMatrix.from_dense(w4.reshape(cout, -1)), g, config=config, bias=bias,
                          relu=not split, residual=not split)
    assert isinstance(plan, ConvTilePlan) and plan.N == g.out_height * g.out_width and plan.K == g.channels * g.taps
    rng = np.random.default_rng(1)
    x, residual = rng.standard_normal(g.input_shape), rng.standard_normal(g.output_shape) if not split else None
    assert np.allclose(_execute_in_layout(plan, x, residual), _torch_conv(x, w4, g, bias, residual, relu=not split),
                       atol=1e-10)


def test_groups_expand_to_the_input_channels_and_offsets_follow_the_bordered_layout():
    g = ConvGeometry.of((1, 4, 6, 5), 2, 3, padding=(1, 2), dilation=(1, 2), groups=2)
    w4 = np.zeros((2, 2, 3, 3), np.float32)
    w4[1, 1, 2, 0] = 3.0  # output channel 1 (group 1), its input channel 1 -> image channel 3; r = 2, s = 0
    w = SparseMatrix.from_dense(w4.reshape(2, -1))
    wide = expand_groups(w, g)
    assert wide.shape == (2, 36) and wide.indices.tolist() == [(2 + 1) * 9 + 2 * 3 + 0]
    plan = make_conv_plan(w, g, config=TileConfig(2, 1, 1))
    assert g.bordered_shape == (1, 4, 8, 9)
    assert plan.input_offset(int(wide.indices[0])) == 3 * 8 * 9 + 2 * 1 * 9 + 0 * 2
    assert expand_groups(w, ConvGeometry.of((1, 2, 6, 5), 2, 3)) is w


@pytest.mark.parametrize("geometry, wanted, vec, shifts", [
    (((1, 4, 8, 8), 4, 1), 4, 4, 1),                    # 1x1, rows of 8: vectors of 4
    (((1, 4, 8, 6), 4, 1), 4, 2, 1),                    # rows of 6: pairs
    (((1, 4, 8, 8), 4, 3, 1, 1), 4, 2, 2),              # 3x3, Wp = 10: pairs; tap s = 1 reads the copy shifted by 1
    (((1, 4, 8, 8), 4, 5, 1, 2), 4, 4, 4),              # 5x5, Wp = 12, OW = 8: fours, from four copies
    (((1, 4, 8, 8), 4, 1, 2), 4, 1, 1),                 # a stride spreads a lane's pixels apart
    (((1, 4, 8, 8), 4, (3, 1), 1, (1, 0)), 2, 2, 1),    # one column wide: every offset a multiple of Wp
    (((1, 4, 8, 8), 4, 3, 1, 2, 2), 4, 4, 4),           # dilation 2, OW = 8, Wp = 12: fours, offsets 0, 2, 4
])
def test_vector_width_only_where_a_lanes_pixels_are_one_aligned_piece(geometry, wanted, vec, shifts):
    g = ConvGeometry.of(*geometry)
    assert conv_vector_width(g, wanted) == vec
    plan = make_conv_plan(SparseMatrix.from_dense(np.ones(g.weight_shape, np.float32)), g,
                          config=TileConfig(1, 1, wanted))
    assert plan.config.vec == vec and plan.shifts == shifts
    # every column's vector starts aligned in its copy, and that copy holds the right element there
    for k in range(plan.K):
        offset, place = plan.input_offset(k), plan.operand_offset(k)
        assert place % vec == 0 and place // plan.plane == offset % shifts
        assert place % plan.plane + place // plan.plane == offset


def test_generated_plan_refusals_name_the_problem_and_the_fix():
    g = ConvGeometry.of((1, 4, 8, 8), 6, 3, padding=1)
    w = SparseMatrix.from_dense(np.ones((6, 36), np.float32))
    with pytest.raises(ValueError, match="split K .segment_nnz > 0. cannot add a residual.*Use segment_nnz=0"):
        make_conv_plan(w, g, config=TileConfig(segment_nnz=8), residual=True)
    with pytest.raises(ValueError, match="cannot be rectified"):
        make_conv_plan(w, g, config=TileConfig(segment_nnz=8), relu=True)
    with pytest.raises(ValueError, match="transpose_x applies to the SpMM's nk layout"):
        make_conv_plan(w, g, config=TileConfig(transpose_x=True))


def test_generated_plans_name_their_mapping_and_geometry_and_sketch_like_the_full_plan():
    from sparseforge.runtime.kernel import plan_spec

    w = SparseMatrix.from_dense(_conv_weight(ConvGeometry.of((1, 4, 8, 8), 6, 3), 0.5).reshape(6, -1))
    padded, wider = ConvGeometry.of((1, 4, 8, 8), 6, 3, padding=1), ConvGeometry.of((1, 4, 10, 10), 6, 3)
    a, b = (make_conv_plan(w, g, config=TileConfig(2, 2, 1)) for g in (padded, wider))
    assert a.N == b.N == 64 and a.mapping == "conv-row-groups" and a.name != b.name and plan_spec(a) != plan_spec(b)
    assert plan_spec(a) != plan_spec(make_conv_plan(w, padded, config=TileConfig(2, 2, 1), residual=True))
    sketch = make_conv_plan(w, padded, config=TileConfig(2, 2, 1, segment_nnz=20), sketch=True)
    full = make_conv_plan(w, padded, config=TileConfig(2, 2, 1, segment_nnz=20))
    assert sketch.sketch and sketch.mapping == full.mapping == "conv-split-k"
    assert sketch.nnz == full.nnz and sketch.grid == full.grid and sketch.partial_rows == full.partial_rows
    assert make_conv_plan(w, padded, config=TileConfig(1, 2, 1, inline=True)).mapping == "conv-inline"
    assert make_conv_plan(w, padded, config=TileConfig(1, 2, 1)).mapping == "conv-row-per-block"


def test_the_layout_names_the_plans_and_so_keys_their_kernels():
    from sparseforge.runtime.kernel import plan_spec

    w = SparseMatrix.from_dense(_conv_weight(ConvGeometry.of((1, 4, 8, 8), 6, 3), 0.5).reshape(6, -1))
    nchw, nhwc = (ConvGeometry.of((1, 4, 8, 8), 6, 3, padding=1, layout=layout) for layout in ("nchw", "nhwc"))
    assert nchw != nhwc and nchw.short() == nhwc.short()
    for config in (CsrColumnsConfig(1, 1, 4), TileConfig(2, 2, 1)):
        a, b = make_conv_plan(w, nchw, config=config), make_conv_plan(w, nhwc, config=config)
        assert a.name != b.name and plan_spec(a) != plan_spec(b) and f"_{b.geometry.layout}_" in b.name
    assert make_conv_plan(w, nhwc, config=TileConfig(2, 2, 1)).output_strides == (1, 6)
    assert make_conv_plan(w, nchw, config=TileConfig(2, 2, 1)).output_strides == (64, 1)


@pytest.mark.parametrize("dtype, cout, rows, runs, alignment", [
    ("float32", 8, (0, 1, 2, 3), [(0, 4)], 16),
    ("float32", 8, (2, 3, 4, 5), [(0, 2), (2, 2)], 8),         # 4 does not start a run of four: two pairs
    ("float32", 8, (1, 2, 3, 4, 5), [(0, 1), (1, 2), (3, 2)], 8),
    ("float32", 6, (0, 1, 2, 3), [(0, 2), (2, 2)], 8),         # Cout = 6: a pixel's channels start 8-byte aligned
    ("float16", 16, tuple(range(8)), [(0, 8)], 16),            # 8 halves: one 16-byte store
    ("float16", 4, (0, 1, 2, 3), [(0, 4)], 8),
    ("float32", 8, (3, 2, 1, 0), [(0, 1), (1, 1), (2, 1), (3, 1)], 4),  # clustered rows, not ascending
    ("float32", 7, (0, 1, 2, 3), [(0, 1), (1, 1), (2, 1), (3, 1)], 4),  # odd Cout: every pixel misaligned
])
def test_nhwc_store_runs_are_aligned_consecutive_channels(dtype, cout, rows, runs, alignment):
    """store_runs: consecutive output channels of one pixel, starting at a multiple of the run's length,
    at most 16 bytes and dividing Cout; output_alignment the longest run's bytes."""
    from sparseforge.plan import RowGroup

    g = ConvGeometry.of((1, 2, 4, 4), cout, 1, layout="nhwc")
    plan = make_conv_plan(SparseMatrix.from_dense(np.ones(g.weight_shape, np.float32)), g, dtype, TileConfig(8, 1, 1))
    plan = dataclasses.replace(plan, groups=(RowGroup(rows, ()),))
    assert plan.store_runs(plan.groups[0]) == runs and plan.output_alignment == alignment
    split = RowGroup(rows, (), 0, 2)  # atomic adds: pairs in 16-bit, singles in fp32
    assert max(count for _, count in plan.store_runs(split)) == (min(2, max(c for _, c in runs))
                                                               if dtype == "float16" else 1)
    nchw = dataclasses.replace(plan, geometry=dataclasses.replace(g, layout="nchw"))
    assert nchw.store_runs(plan.groups[0]) == [(i, 1) for i in range(len(rows))]
    assert nchw.output_alignment == plan.element_bytes  # vec 1: one element a store
