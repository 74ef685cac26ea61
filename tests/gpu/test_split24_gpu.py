"""The split-24 composite on the GPU (mappings/split24/plan.py, semi/split24.py): W's 2:4 part on Sparse Tensor Cores
(cuSPARSELt) plus the residual's SpMM kernel adding in place, through compile_spmm with Split24Config, fresh
inputs into NaN-poisoned outputs against float64; an empty residual (W already 2:4) and a large one; widths
cuSPARSELt pads; bias; CUDA-graph replay; bench's rotated copies; its refusals."""
import numpy as np
import pytest
import torch

from sparseforge import SparseMatrix, compile_spmm
from sparseforge.mappings.split24.plan import Split24Config, split_24

pytest.importorskip("nvmath", reason="the 2:4 path needs nvmath-python (cuSPARSELt)")
pytestmark = pytest.mark.gpu
TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}
NAME = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _weight(m: int, k: int, density: float, seed: int, two_four: bool = False) -> SparseMatrix:
    rng = np.random.default_rng(seed)
    dense = np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0).astype(np.float32)
    if two_four:  # keep each 4-group's 2 largest: no residual at all
        dense = split_24(SparseMatrix.from_dense(dense)).part24.to_dense()
    return SparseMatrix.from_dense(dense)


def _check(kernel, w: SparseMatrix, dtype, bias=None, seed=0):
    wd = torch.from_numpy(w.astype(NAME[dtype]).to_dense().astype(np.float64)).cuda()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(2):
        x = torch.randn(kernel.in_shape, device="cuda", generator=gen).to(dtype)
        out = torch.full(kernel.out_shape, float("nan"), device="cuda", dtype=dtype)
        ref = x.double() @ wd.T
        if bias is not None:
            ref += torch.tensor(bias, dtype=dtype).double().cuda()
        for got in (kernel(x, out=out), kernel(x)):
            assert torch.isfinite(got).all()
            err = ((got.double() - ref).norm() / ref.norm()).item()
            assert err <= TOL[dtype], err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("density, two_four", [(0.1, False), (0.5, False), (0.3, True)])
@pytest.mark.parametrize("n", [128, 300, 2048])
def test_split24_matches_float64(dtype, density, two_four, n):
    w = _weight(256, 512, density, seed=n, two_four=two_four)
    kernel = compile_spmm(w, n, dtype, "nk", config=Split24Config(), tune_budget=0.5)
    assert kernel.mapping == "split-24" and (kernel.residual_kernel is None) == two_four
    assert kernel.weight_bytes > 0
    _check(kernel, w, dtype)


def test_split24_adds_the_bias_and_replays_in_a_graph():
    w = _weight(128, 256, 0.15, seed=3)
    bias = np.linspace(-1, 1, 128).astype(np.float32)
    kernel = compile_spmm(w, 256, torch.float16, "nk", bias=bias, config=Split24Config(), tune_budget=0.5)
    _check(kernel, w, torch.float16, bias=bias)
    x = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    out = torch.full((256, 128), float("nan"), device="cuda", dtype=torch.float16)
    kernel(x, out=out)  # warm (allocations made before capture)
    want = out.clone()
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernel(x, out=out)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        kernel(x, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    twin = kernel.with_own_weights()
    assert twin.compressed.data.data_ptr() != kernel.compressed.data.data_ptr()
    assert torch.equal(twin(x), want)


def test_split24_refuses_what_it_cannot_take():
    w = _weight(64, 128, 0.2, seed=4)
    with pytest.raises(ValueError, match="layout 'nk'"):
        compile_spmm(w, 256, torch.float16, "kn", config=Split24Config())
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        compile_spmm(w, 256, torch.float32, "nk", config=Split24Config())
    kernel = compile_spmm(w, 256, torch.float16, "nk", config=Split24Config(), tune_budget=None)
    x = torch.randn(256, 128, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="adds no residual"):
        kernel(x, residual=torch.zeros(256, 64, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="N is fixed"):
        kernel(torch.randn(255, 128, device="cuda", dtype=torch.float16))
    with pytest.raises(TypeError, match="dtype"):
        kernel(x.float())
    with pytest.raises(ValueError, match="not contiguous"):
        kernel(torch.randn(128, 256, device="cuda", dtype=torch.float16).t())
    with pytest.raises(ValueError, match="is on cpu"):
        kernel(x.cpu())
