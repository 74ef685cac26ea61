"""The direct sparse convolution on the GPU against float64 (torch's conv2d on the dense weight), into
NaN-poisoned outputs: ResNet-50-like 3x3 / 7x7 / strided / depthwise layers, the text CNN's 1-D
convolutions, every dtype, bias / ReLU / residual (in place too), batch; the chooser's path and the cache;
the generated mapping over the zero-bordered input forced by a TileConfig, on random geometry; each in NCHW
and NHWC (channels_last x, out and residual), and the layout refusals."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sparseforge import compile_conv1d, compile_conv2d
from sparseforge.plan import TileConfig
from sparseforge.mappings.csr.plan import CsrColumnsConfig

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
LAYOUTS = ["nchw", "nhwc"]
MEMORY = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}

CASES = [  # input shape, Cout, kernel, stride, padding, dilation, groups
    ((1, 64, 56, 56), 64, 3, 1, 1, 1, 1), ((2, 128, 28, 28), 128, 3, 2, 1, 1, 1), ((1, 3, 224, 224), 64, 7, 2, 3, 1, 1),
    ((4, 32, 17, 19), 32, 3, 1, 2, 2, 32), ((1, 48, 15, 15), 24, (1, 5), 1, (0, 2), 1, 2), ((3, 16, 9, 9), 8, 1, 2, 0, 1, 1),
]


def _pruned(shape, density, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    return torch.where(torch.rand(shape, generator=g) < density, w, torch.zeros(()))


def _reference(x, w, bias, stride, padding, dilation, groups, residual, relu):
    out = F.conv2d(x.double(), w.double().cuda(), None if bias is None else bias.float().double().cuda(), stride,
                   padding, dilation, groups)
    if residual is not None:
        out = out + residual.double()
    return out.clamp_min(0) if relu else out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0][1]}x{c[0][2]}k{c[2]}s{c[3]}g{c[6]}")
def test_convolutions_match_float64(case, dtype, layout):
    shape, cout, kernel, stride, padding, dilation, groups = case
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    w = _pruned((cout, shape[1] // groups, kh, kw), 0.1, seed=shape[1]).to(dtype)
    bias = torch.linspace(-1, 1, cout)
    k = compile_conv2d(w, shape, stride, padding, dilation, groups, dtype, bias=bias, relu=True, residual=True,
                       layout=layout, tune_budget=2.0)
    assert k.mapping.startswith("conv-") and k.choice is not None and k.choice.dense_us
    assert {"conv-csr-columns", "conv-row-groups"} <= {r["mapping"] for r in k.choice.records}
    assert k.layout == layout and k.plan.geometry.layout == layout
    gen = torch.Generator(device="cuda").manual_seed(3)
    for batch in (shape[0], 1):
        x = torch.randn((batch, *shape[1:]), device="cuda", generator=gen).to(dtype, memory_format=MEMORY[layout])
        residual = torch.randn((batch, *k.out_shape), device="cuda", generator=gen).to(dtype,
                                                                                         memory_format=MEMORY[layout])
        out = torch.full_like(residual, float("nan"))  # keeps residual's memory format
        k(x, out=out, residual=residual)
        assert k(x, residual=residual).is_contiguous(memory_format=MEMORY[layout])
        ref = _reference(x, w, bias, stride, padding, dilation, groups, residual, True)
        assert torch.isfinite(out).all()
        assert ((out.double() - ref).norm() / ref.norm()).item() <= TOL[dtype]
        in_place = residual.clone()
        k(x, out=in_place, residual=in_place)  # y += conv(x): each element read before it is written
        assert torch.equal(in_place, out)


def test_cached_choice_and_fixed_config_give_the_same_outputs():
    w = _pruned((32, 16, 3, 3), 0.2, seed=1)
    first = compile_conv2d(w, (2, 16, 12, 12), padding=1)
    again = compile_conv2d(w, (2, 16, 12, 12), padding=1)
    fixed = compile_conv2d(w, (2, 16, 12, 12), padding=1, config=CsrColumnsConfig(1, 1, 4))
    x = torch.randn(2, 16, 12, 12, device="cuda")
    assert again.tune_seconds == 0.0 and again.choice.as_dict() == first.choice.as_dict()
    assert torch.equal(first(x), again(x))
    assert ((fixed(x).double() - first(x).double()).norm() / first(x).double().norm()).item() < 1e-6


@pytest.mark.parametrize("width", [3, 4, 5])
def test_text_cnn_conv1d(width):
    """CNN-non-static: 300-dim embeddings over 64 words, 100 maps of width 3, 4, 5, pruned to 90%."""
    w = _pruned((100, 300, width), 0.1, seed=width)
    k = compile_conv1d(w, (8, 300, 64), dtype=torch.float16, bias=torch.zeros(100), relu=True, tune_budget=None)
    x = torch.randn(8, 300, 64, device="cuda").half()
    ref = F.relu(F.conv1d(x.double(), w.double().cuda()))
    out = k(x)
    assert out.shape == (8, 100, 64 - width + 1)
    assert ((out.double() - ref).norm() / ref.norm()).item() <= TOL[torch.float16]


def test_bad_calls_name_the_problem():
    k = compile_conv2d(_pruned((8, 4, 3, 3), 0.5, 0), (1, 4, 8, 8), padding=1, residual=True, tune_budget=None)
    x = torch.randn(1, 4, 8, 8, device="cuda")
    with pytest.raises(ValueError, match="compiled with residual=True"):
        k(x)
    with pytest.raises(ValueError, match="expected \\[batch,\\] 4 x 8 x 8"):
        k(torch.randn(1, 4, 9, 8, device="cuda"), residual=torch.zeros(1, 8, 8, 8, device="cuda"))
    with pytest.raises(ValueError, match="not contiguous"):
        k(x.to(memory_format=torch.channels_last).permute(0, 1, 3, 2), residual=torch.zeros(1, 8, 8, 8, device="cuda"))
    with pytest.raises(TypeError, match="dtype"):
        k(x.half(), residual=torch.zeros(1, 8, 8, 8, device="cuda"))
    with pytest.raises(ValueError, match="x is on cpu, the kernel was compiled for cuda:0: move it"):
        k(x.cpu(), residual=torch.zeros(1, 8, 8, 8, device="cuda"))
    with pytest.raises(ValueError, match="residual is on cpu"):
        k(x, residual=torch.zeros(1, 8, 8, 8))
    with pytest.raises(ValueError, match="out is on cpu"):
        k(x, out=torch.empty(1, 8, 8, 8), residual=torch.zeros(1, 8, 8, 8, device="cuda"))
    with pytest.raises(ValueError, match="shares memory with x"):
        big = torch.zeros(1, 8, 8, 8, device="cuda")
        k(big[:, :4], out=big, residual=torch.zeros(1, 8, 8, 8, device="cuda"))
    assert k(torch.empty(0, 4, 8, 8, device="cuda"), residual=torch.empty(0, 8, 8, 8, device="cuda")).shape == (0, 8, 8, 8)


def test_bench_conv_case_records_cudnn_and_checks_the_output():
    from sparseforge.bench.conv import run_conv_case
    from sparseforge.suite import SAMPLE_DIR
    from sparseforge.suite.conv import discover_conv

    cases = discover_conv("conv:textcnn:0.9")[:1] + discover_conv(f"conv:{SAMPLE_DIR}/rn50/magnitude_pruning/0.9")[:1]
    for case in cases:
        record = run_conv_case(case, "float16", tune_budget=1.0)
        assert record["error_ok"] and record["sparseforge_us"] > 0 and record["cudnn_us"] > 0
        assert record["cudnn_us"] == min(record["cudnn_nchw_us"], record["cudnn_channels_last_us"])
        assert record["speedup_vs_cudnn"] == record["cudnn_us"] / record["sparseforge_us"]


GENERATED = [  # each mapping of the generated kernel over the zero-bordered input
    TileConfig(4, 8, 1, 16, cluster_rows=True), TileConfig(1, 4, 1, 16), TileConfig(4, 4, 4),
    TileConfig(4, 8, 1, 16, segment_nnz=32), TileConfig(1, 4, 1, 16, inline=True),
    TileConfig(2, 4, 1, chunk_k=64, groups_per_block=2),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", GENERATED, ids=lambda c: c.short())
def test_generated_mapping_on_random_geometry_matches_float64(config, dtype, layout):
    """compile_conv2d(config=TileConfig(...)) forces the generated kernel: random kernels (1x1 to 7x7, 1xk,
    kx1), strides 1-3 (unequal too), padding, dilation, groups (depthwise too) and batch, against float64
    into NaN-poisoned outputs; bias / ReLU / residual (in place too) wherever the tiling takes them (split K
    takes neither ReLU nor a residual); a batch larger than compiled goes through a reallocated border."""
    rng = np.random.default_rng(len(config.short()) + 7 * int(dtype.itemsize))
    gen = torch.Generator(device="cuda").manual_seed(5)
    for case in range(6):
        kh, kw = [(1, 1), (3, 3), (5, 5), (7, 7), (1, 5), (3, 1)][int(rng.integers(6))]
        kind = int(rng.integers(3))
        groups = [1, 2, 0][kind]
        cin = int(rng.integers(1, 5)) * 8 if groups != 2 else 2 * int(rng.integers(1, 9))
        groups = groups or cin
        cout = cin if kind == 2 else groups * int(rng.integers(1, 9))
        s = int(rng.integers(1, 4))
        stride = (s, s) if case % 3 else (s, int(rng.integers(1, 4)))
        dilation = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        padding = (int(rng.integers(0, 4)), int(rng.integers(0, 4)))
        h = int(rng.integers(max(1, dilation[0] * (kh - 1) + 1 - 2 * padding[0]), 40))
        w = int(rng.integers(max(1, dilation[1] * (kw - 1) + 1 - 2 * padding[1]), 40))
        batch = int(rng.integers(1, 4))
        weight = _pruned((cout, cin // groups, kh, kw), 0.2, seed=case).to(dtype)
        bias = torch.linspace(-1, 1, cout)
        split = config.segment_nnz > 0
        k = compile_conv2d(weight, (batch, cin, h, w), stride, padding, dilation, groups, dtype, bias=bias,
                           relu=not split, residual=not split, layout=layout, config=config)
        assert k.mapping == make_mapping(config, k.plan) and k.plan.config.short().startswith(f"r{config.rows_per_group}")
        memory = MEMORY[layout]
        for b in (batch, batch + 1):
            x = torch.randn((b, cin, h, w), device="cuda", generator=gen).to(dtype, memory_format=memory)
            residual = torch.randn((b, *k.out_shape), device="cuda", generator=gen).to(dtype, memory_format=memory) \
                if not split else None
            out = torch.full((b, *k.out_shape), float("nan"), device="cuda", dtype=dtype).contiguous(
                memory_format=memory)
            k(x, out=out, **({} if split else {"residual": residual}))
            ref = _reference(x, weight, bias, stride, padding, dilation, groups, residual, not split)
            assert torch.isfinite(out).all(), f"case {case}: an output was never written"
            assert ((out.double() - ref).norm() / ref.norm()).item() <= TOL[dtype], f"case {case}"
            if not split:
                in_place = residual.clone()
                k(x, out=in_place, residual=in_place)
                assert torch.equal(in_place, out)


def make_mapping(config: TileConfig, plan) -> str:
    """The mapping name a forced TileConfig gives (plan.mapping's rules): split K only where some group of
    the plan was long enough to be cut (a small random layer may have none: its groups run whole)."""
    if config.inline:
        return "conv-inline"
    if config.segment_nnz and any(g.partial for g in plan.groups):
        return "conv-split-k"
    return "conv-row-per-block" if config.rows_per_group == 1 else "conv-row-groups"


def test_generated_mapping_in_a_cuda_graph_and_the_chooser_can_pick_it():
    """The bordered copy and the kernel replay in a CUDA graph (the buffer made at compile time; the timing
    the chooser uses captures both); the chooser times the generated candidates beside csr-columns on an
    rn50 3x3 layer."""
    from sparseforge.runtime.timing import graph_time_us

    w = _pruned((64, 64, 3, 3), 0.1, seed=2)
    k = compile_conv2d(w, (1, 64, 56, 56), padding=1, config=TileConfig(4, 8, 1, 16))
    x = torch.randn(1, 64, 56, 56, device="cuda")
    out = torch.full((1, 64, 56, 56), float("nan"), device="cuda")
    assert graph_time_us(lambda image: k(image, out=out), [x]) > 0  # every replay writes conv(x) into out
    ref = _reference(x, w, None, 1, 1, 1, 1, None, False)
    assert ((out.double() - ref).norm() / ref.norm()).item() <= TOL[torch.float32]
    chosen = compile_conv2d(w, (1, 64, 56, 56), padding=1, tune_budget=3.0)
    timed = [r for r in chosen.choice.records if r.get("us") is not None]
    assert {"conv-csr-columns"} < {r["mapping"] for r in timed} and chosen.plan.name in chosen.source


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [TileConfig(rows_per_group=4, warps_per_block=8, vec=2, load_batch=16),
                                    TileConfig(rows_per_group=1, warps_per_block=4, vec=2, load_batch=16, inline=True)],
                         ids=lambda c: c.short())
def test_pairs_of_pixels_over_shifted_copies_on_an_rn50_layer(config, dtype):
    """rn50's 64-channel 3x3 layer at 56 x 56 (Wp = 58): two pixels a lane, each tap from the copy of the
    bordered input shifted by its column offset's remainder; a batch of 2, then 3 (the buffer regrows)."""
    weight = _pruned((64, 64, 3, 3), 0.1, seed=11).to(dtype)
    bias = torch.linspace(-1, 1, 64)
    k = compile_conv2d(weight, (2, 64, 56, 56), 1, 1, 1, 1, dtype, bias=bias, relu=True, config=config)
    assert k.plan.config.vec == 2 and k.plan.shifts == 2
    gen = torch.Generator(device="cuda").manual_seed(3)
    for batch in (2, 3):
        x = torch.randn((batch, 64, 56, 56), device="cuda", generator=gen).to(dtype)
        out = torch.full((batch, 64, 56, 56), float("nan"), device="cuda", dtype=dtype)
        k(x, out=out)
        ref = _reference(x, weight, bias, 1, 1, 1, 1, None, True)
        assert torch.isfinite(out).all()
        assert ((out.double() - ref).norm() / ref.norm()).item() <= TOL[dtype]


@pytest.mark.parametrize("padding, vec, launches", [(1, 2, 2), (1, 1, 2), (0, 1, 1)])
def test_a_generated_conv_call_launches_its_kernel_and_at_most_one_copy(padding, vec, launches):
    """The bordered copy and its shifted twin are one copy_ launch (vector pairs: padding leaves room); without
    padding the kernel reads x in place, no copy at all. Counted by the profiler, outputs checked."""
    from sparseforge.bench.profile import kernel_breakdown

    weight = _pruned((32, 16, 3, 3), 0.2, seed=5)
    k = compile_conv2d(weight, (2, 16, 20, 24), padding=padding, config=TileConfig(2, 4, vec, 16))
    assert k.plan.config.vec == vec and k.reads_x_in_place == (padding == 0)
    x = torch.randn(2, 16, 20, 24, device="cuda")
    out = torch.full(k(x).shape, float("nan"), device="cuda")
    got = kernel_breakdown(lambda: k(x, out=out), calls=3)
    assert got["kernels_per_call"] == pytest.approx(launches)
    ref = _reference(x, weight, None, 1, padding, 1, 1, None, False)
    assert ((out.double() - ref).norm() / ref.norm()).item() <= TOL[torch.float32]


def test_nhwc_and_nchw_kernels_agree_and_their_choices_are_cached_apart():
    """One layer compiled for both layouts: the same outputs on the same values (the NHWC one on channels_last
    tensors), each choice cached under its own key (a second compile of each is a hit with its record)."""
    w = _pruned((32, 16, 3, 3), 0.2, seed=4)
    nchw = compile_conv2d(w, (2, 16, 12, 12), padding=1, tune_budget=1.0)
    nhwc = compile_conv2d(w, (2, 16, 12, 12), padding=1, layout="nhwc", tune_budget=1.0)
    again = compile_conv2d(w, (2, 16, 12, 12), padding=1, layout="nhwc", tune_budget=1.0)
    assert again.tune_seconds == 0.0 and again.choice.as_dict() == nhwc.choice.as_dict() and again.layout == "nhwc"
    x = torch.randn(2, 16, 12, 12, device="cuda")
    y = nhwc(x.contiguous(memory_format=torch.channels_last))
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert ((y.double() - nchw(x).double()).norm() / nchw(x).double().norm()).item() < 1e-6


@pytest.mark.parametrize("config", [CsrColumnsConfig(1, 1, 4), TileConfig(4, 8, 1, 16)], ids=["csr-columns", "generated"])
def test_layout_refusals_name_the_problem_and_the_fix(config):
    w = _pruned((8, 4, 3, 3), 0.5, 0)
    nhwc = compile_conv2d(w, (1, 4, 8, 8), padding=1, layout="nhwc", config=config)
    nchw = compile_conv2d(w, (1, 4, 8, 8), padding=1, config=config)
    x = torch.randn(1, 4, 8, 8, device="cuda")
    last = x.contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="x is NCHW-contiguous; this kernel was compiled with layout='nhwc'"):
        nhwc(x)
    with pytest.raises(ValueError, match="x is 3-D .4, 8, 8.; this kernel was compiled with layout='nhwc'"):
        nhwc(x[0])
    with pytest.raises(ValueError, match="out is NCHW-contiguous.*memory_format=torch.channels_last"):
        nhwc(last, out=torch.empty(1, 8, 8, 8, device="cuda"))
    with pytest.raises(ValueError, match="x is channels_last; this kernel was compiled with layout='nchw'"):
        nchw(last)
    with pytest.raises(ValueError, match="layout must be 'nchw' or 'nhwc'"):
        compile_conv2d(w, (1, 4, 8, 8), padding=1, layout="channels_last", config=config)
    ref = _reference(x, w, None, 1, 1, 1, 1, None, False)
    for got in (nhwc(last), nchw(x)):
        assert ((got.double() - ref).norm() / ref.norm()).item() <= TOL[torch.float32]


def test_bench_conv_case_in_nhwc():
    from sparseforge.bench.conv import run_conv_case
    from sparseforge.suite.conv import discover_conv

    record = run_conv_case(discover_conv("conv:vgg16:0.9")[2], "float16", tune_budget=1.0, layout="nhwc")
    assert record["layout"] == "nhwc" and record["error_ok"] and record["sparseforge_us"] > 0
