"""The bitmap decode kernel on the GPU (mappings/bitmap/plan.py, mappings/bitmap/render.py): LLM-shaped weights magnitude-
pruned to 50-90%, N = 1 (kn and nk), fp16 / bf16 / fp32, through compile_spmm with a fixed BitmapConfig,
several fresh inputs each into NaN-poisoned outputs against float64; the small-N CSR kernel's 16-bit
indices; the rotating-weights timing protocol."""
import numpy as np
import pytest
import torch

from sparseforge import compile_spmm
from sparseforge.mappings.bitmap.plan import BitmapConfig
from sparseforge.suite.llm import magnitude_prune, seeded_weight

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("sparsity", [0.5, 0.9])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("config", [BitmapConfig(warps_per_block=4, rows_per_warp=2, unroll=2),
                                    BitmapConfig(warps_per_block=8, rows_per_warp=4, unroll=4)])
def test_llm_shaped_decode_matches_float64(sparsity, dtype, layout, config):
    n = 1
    k = 4096 + 40 if dtype == torch.float32 else 14336 + 40  # K not a multiple of 1024; a dense row below
    w = magnitude_prune(seeded_weight(1000, k, seed=1), sparsity)
    if dtype == torch.float32 and config.warps_per_block == 8:
        config = BitmapConfig(warps_per_block=4, rows_per_warp=4, unroll=4)  # fp32 buffers: 8 warps exceed 48 KB
    bias = np.linspace(-1, 1, 1000)
    kernel = compile_spmm(w, n, dtype, layout, bias=bias, config=config, tune_budget=None)
    assert kernel.mapping == "bitmap"
    wd = torch.from_numpy(w.astype(str(dtype).replace("torch.", "")).to_dense().astype(np.float64)).cuda()
    gen = torch.Generator(device="cuda").manual_seed(n)
    for i in range(3):
        batch = (2,) if i == 2 else ()
        b = torch.randn((*batch, *kernel.in_shape), device="cuda", generator=gen).to(dtype)
        out = torch.full((*batch, *kernel.out_shape), float("nan"), device="cuda", dtype=dtype)
        kernel(b, out=out)
        torch.cuda.synchronize()
        bias32 = torch.as_tensor(bias, device="cuda").to(torch.float32).double()  # the kernel adds fp32 bias
        ref = wd @ b.double() + bias32[:, None] if layout == "kn" else b.double() @ wd.T + bias32
        assert torch.isfinite(out).all()
        assert ((out.double() - ref).norm() / ref.norm()).item() <= TOL[dtype]


def test_nan_in_b_reaches_only_rows_that_use_its_column():
    w = magnitude_prune(seeded_weight(256, 2048, seed=2), 0.9)
    kernel = compile_spmm(w, 1, torch.float16, config=BitmapConfig(warps_per_block=4, rows_per_warp=2, unroll=4),
                          tune_budget=None)
    b = torch.randn(3, 2048, 1, device="cuda").half()  # a batch: the NaN in entry 1 only
    b[1, 100, 0] = float("nan")
    out = kernel(b)[..., 0]
    uses = torch.from_numpy(w.to_dense()[:, 100] != 0).cuda()
    assert uses.any() and torch.isnan(out[1, uses]).all() and torch.isfinite(out[1, ~uses]).all()
    assert torch.isfinite(out[[0, 2]]).all()


@pytest.mark.parametrize("k", [4096, 65536, 65600])
def test_small_n_csr_reads_16_bit_indices_to_k_65536_and_32_bit_past_it(k):
    """The small-N CSR kernel stores indices in 16 bits where K <= 65536: the last column must still be
    read from its own B row."""
    from sparseforge.mappings.csr.plan import CsrConfig

    w = magnitude_prune(seeded_weight(64, k, seed=3), 0.99)
    kernel = compile_spmm(w, 1, torch.float16, "kn", config=CsrConfig(lanes_per_row=32, columns=1, warps_per_block=4, unroll=2), tune_budget=None)
    assert kernel.plan.index_bytes == (2 if k <= 65536 else 4)
    b = torch.randn(k, 1, device="cuda").half()
    b[-1] = 1000.0  # the last column dominates every row that uses it
    out = torch.full(kernel.out_shape, float("nan"), device="cuda", dtype=torch.float16)
    kernel(b, out=out)
    wd = torch.from_numpy(w.astype("float16").to_dense().astype(np.float64)).cuda()
    ref = wd @ b.double()
    assert ((out.double() - ref).norm() / ref.norm()).item() <= TOL[torch.float16]


def test_a_kernel_with_its_own_weights_computes_the_same_and_owns_new_arrays():
    from sparseforge.mappings.csr.plan import CsrConfig

    w = magnitude_prune(seeded_weight(512, 2048, seed=4), 0.7)
    kernel = compile_spmm(w, 1, torch.float16, "kn", config=CsrConfig(lanes_per_row=32, columns=1, warps_per_block=4, unroll=2), tune_budget=None)
    twin = kernel.with_own_weights()
    assert twin.weight_bytes == kernel.weight_bytes > 0
    assert {t.data_ptr() for t in twin._weight_tensors if t is not None}.isdisjoint(
        t.data_ptr() for t in kernel._weight_tensors if t is not None)
    b = torch.randn(2048, 1, device="cuda").half()
    assert torch.equal(twin(b), kernel(b))


def test_bench_times_llm_cases_with_weights_rotated_through_hbm():
    from sparseforge.bench.gpu import run_case
    from sparseforge.suite.llm import discover_llm

    case = discover_llm("llm:0.9:llama_1024x4096", n=1)[0]
    record = run_case(case, "float16", "kn", 1, None, with_cusparse=False, rotate_weights=True)
    assert record["error_ok"]
    streamed = record["sparse_weight_bytes"] + record["sparse_code_bytes"] + 4096 * 2  # a code kernel: its cubin
    assert record["weight_copies"] * streamed >= 2 * record["l2_bytes"] or record["weight_copies"] == 256
    assert record["dense_weight_copies"] * (1024 * 4096 * 2 + 4096 * 2) >= 2 * record["l2_bytes"]
    assert record["sparseforge_rotating_us"] > 0 and record["cublas_rotating_us"] > 0
    assert record["speedup_vs_cublas_rotating"] == record["cublas_rotating_us"] / record["sparseforge_rotating_us"]
