"""The tc-scatter kernel on the GPU (mappings/tc_scatter/plan.py, mappings/tc_scatter/render.py): every 16-bit dtype x N in
1..17, 33, 64 x densities {0, one nonzero, 10%, 30%, 50%, 100%} x tails (M, K not multiples of 16 / 64 / 8),
both layouts, batches, bias / ReLU / residual, through compile_spmm with a fixed TcScatterConfig, fresh inputs
into NaN-poisoned outputs against float64 (fp16 <= 5e-3, bf16 <= 3e-2 relative); LLM-shaped layers; its
non-finite contract; the chooser proposing it."""
import numpy as np
import pytest
import torch

from sparseforge import SparseMatrix, compile_spmm
from sparseforge.mappings.tc_scatter.plan import TcScatterConfig
from sparseforge.suite.llm import magnitude_prune, seeded_weight

pytestmark = pytest.mark.gpu
DENSITIES = ["zero", "one", 0.1, 0.3, 0.5, 1.0]


def _weight(m: int, k: int, density, seed: int) -> SparseMatrix:
    rng = np.random.default_rng(seed)
    if density == "zero":
        return SparseMatrix.from_dense(np.zeros((m, k), np.float32))
    if density == "one":
        dense = np.zeros((m, k), np.float32)
        dense[m // 2, k - 1] = 1.5
        return SparseMatrix.from_dense(dense)
    return SparseMatrix.from_dense(np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0)
                                   .astype(np.float32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", list(range(1, 18)) + [33, 64])
def test_every_width_matches_float64(n, dtype, matches_float64):
    layout = "nk" if n % 2 else "kn"
    w = _weight(77, 200, 0.3, seed=n)  # 5 strips, the last partial; 4 chunks, the last partial
    kernel = compile_spmm(w, n, dtype, layout, config=TcScatterConfig(warps_per_block=2, ahead=2), tune_budget=None)
    assert kernel.mapping == "tc-scatter"
    matches_float64(kernel, w, dtype, layout, seed=n)


@pytest.mark.parametrize("density", DENSITIES, ids=str)
@pytest.mark.parametrize("m,k", [(16, 64), (33, 70), (130, 1000), (8, 4104)])
@pytest.mark.parametrize("config", [TcScatterConfig(8, 4), TcScatterConfig(4, 1), TcScatterConfig(16, 2)],
                         ids=lambda c: c.short())
def test_densities_and_tails_match_float64(density, m, k, config, matches_float64):
    w = _weight(m, k, density, seed=m + k)
    for n, layout in ((1, "kn"), (8, "nk"), (16, "kn")):
        kernel = compile_spmm(w, n, torch.float16, layout, config=config, tune_budget=None)
        matches_float64(kernel, w, torch.float16, layout, seed=n)


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_batched_bias_relu_and_residual(layout, dtype, matches_float64):
    w = _weight(100, 320, 0.2, seed=3)
    bias = np.linspace(-2, 2, 100)
    kernel = compile_spmm(w, 5, dtype, layout, bias=bias, relu=True, residual=True,
                          config=TcScatterConfig(4, 2), tune_budget=None)
    matches_float64(kernel, w, dtype, layout, batch=(3,), bias=bias, relu=True, residual=True)


@pytest.mark.parametrize("sparsity", [0.5, 0.7, 0.9])
@pytest.mark.parametrize("n", [1, 8, 16])
def test_llm_shaped_layers_match_float64(sparsity, n, matches_float64):
    w = magnitude_prune(seeded_weight(1024, 4096 + 40, seed=1), sparsity)  # K: 64 chunks and a partial one
    kernel = compile_spmm(w, n, torch.float16, "nk", config=TcScatterConfig(8, 4), tune_budget=None)
    matches_float64(kernel, w, torch.float16, "nk", seed=n)


def test_nan_reaches_every_row_of_its_column_as_in_the_dense_product():
    """The documented contract: every 16 x 64 block is multiplied densely (an empty one too), so a NaN at
    X[j, k] makes Y[j, :] NaN, as dense W @ X^T does, and leaves the other tokens finite."""
    dense = np.zeros((48, 256), np.float32)
    dense[3, 70] = 1.0    # strip 0, chunk 1 (columns 64..127)
    dense[20, 200] = 2.0  # strip 1, chunk 3; strip 2 is empty
    w = SparseMatrix.from_dense(dense)
    kernel = compile_spmm(w, 3, torch.float16, "nk", config=TcScatterConfig(2, 2), tune_budget=None)
    x = torch.ones(3, 256, device="cuda").half()
    x[1, 100] = float("nan")
    x[2, 5] = float("inf")
    y = kernel(x)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all() and torch.isfinite(y[0]).all()


def test_the_chooser_proposes_it_for_half_precision_from_17_columns_and_names_it(matches_float64):
    w = magnitude_prune(seeded_weight(2048, 2048, seed=5), 0.8)
    kernel = compile_spmm(w, 24, torch.float16, "nk", tune_budget=2.0)
    mappings = {r["mapping"] for r in kernel.choice.records}
    assert "tc-scatter" in mappings and kernel.mapping in mappings
    matches_float64(kernel, w, torch.float16, "nk")
    at_8 = {r["mapping"] for r in compile_spmm(w, 8, torch.float16, "kn", tune_budget=None).choice.records}
    assert "bitmap-tc" in at_8 and "tc-scatter" not in at_8  # bitmap-tc beat it in every measured kn case there
    fp32 = compile_spmm(w, 24, torch.float32, "nk", tune_budget=None)
    assert "tc-scatter" not in {r["mapping"] for r in fp32.choice.records}


def test_float32_is_refused_with_the_reason():
    w = _weight(32, 64, 0.3, seed=1)
    with pytest.raises(ValueError, match="tensor cores in float16 or bfloat16"):
        compile_spmm(w, 1, torch.float32, config=TcScatterConfig(), tune_budget=None)
