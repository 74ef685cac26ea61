"""The direct sparse convolution on the GPU against float64 (torch's conv2d on the dense weight), into
NaN-poisoned outputs: ResNet-50-like 3x3 / 7x7 / strided / depthwise layers, the text CNN's 1-D
convolutions, every dtype, bias / ReLU / residual (in place too), batch; the chooser's path and the cache."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sparseforge import SparseMatrix, compile_conv1d, compile_conv2d
from sparseforge.plan.csr import CsrColumnsConfig

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0][1]}x{c[0][2]}k{c[2]}s{c[3]}g{c[6]}")
def test_convolutions_match_float64(case, dtype):
    shape, cout, kernel, stride, padding, dilation, groups = case
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    w = _pruned((cout, shape[1] // groups, kh, kw), 0.1, seed=shape[1]).to(dtype)
    bias = torch.linspace(-1, 1, cout)
    k = compile_conv2d(w, shape, stride, padding, dilation, groups, dtype, bias=bias, relu=True, residual=True,
                       tune_budget=2.0)
    assert k.mapping == "conv-csr-columns" and k.choice is not None and k.choice.dense_us
    gen = torch.Generator(device="cuda").manual_seed(3)
    for batch in (shape[0], 1):
        x = torch.randn((batch, *shape[1:]), device="cuda", generator=gen).to(dtype)
        residual = torch.randn((batch, *k.out_shape), device="cuda", generator=gen).to(dtype)
        out = torch.full_like(residual, float("nan"))
        k(x, out=out, residual=residual)
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
