"""The delta-runs decode kernel on the GPU (mappings/delta_runs): LLM-shaped weights magnitude-pruned to
50-98% (fillers past gaps of 255 at the top), N = 1, 3 and 8 (kn and nk), fp16 / bf16, every default and
trial config (X staged in fp32 and 16 bits, persistent blocks over several rows a warp), with
bias and a residual, from a host SparseMatrix and packed on the GPU from a DeviceCsr, several fresh inputs
each into NaN-poisoned outputs against float64; W back dense from the kernel's own arrays."""
import numpy as np
import pytest
import torch

from sparseforge import compile_spmm
from sparseforge.formats.device import DeviceCsr
from sparseforge.mappings.delta_runs.plan import DeltaRunsConfig
from sparseforge.mappings.delta_runs.space import delta_runs_candidates, delta_runs_kept
from sparseforge.suite.llm import magnitude_prune, seeded_weight

pytestmark = pytest.mark.gpu
TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _device_csr(w, dtype) -> DeviceCsr:
    name = str(dtype).replace("torch.", "")
    w = w.astype(name)
    return DeviceCsr(torch.from_numpy(w.indptr.astype(np.int64)).cuda(), torch.from_numpy(w.indices.astype(np.int32)).cuda(),
                     torch.from_numpy(w.values.astype(np.float32)).cuda().to(dtype), w.shape, name)


@pytest.mark.parametrize("sparsity", [0.5, 0.7, 0.98])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("packed", ["host", "device"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_llm_shaped_decode_matches_float64(sparsity, dtype, layout, packed, n):
    k = 14336 + 37  # Llama's widest K and a tail (X staged value by value); rows of many quads a lane
    w = magnitude_prune(seeded_weight(1000, k, seed=1), sparsity)
    bias = np.linspace(-1, 1, 1000)
    wd = torch.from_numpy(w.astype(str(dtype).replace("torch.", "")).to_dense().astype(np.float64)).cuda()
    gen = torch.Generator(device="cuda").manual_seed(1)
    name = str(dtype)[6:]
    # the kept configs with 4 SMs' worth of persistent blocks: a warp takes several of the 1000 rows
    configs = (delta_runs_candidates(1, layout, 1000, w.nnz / 1000, False, name, 132) if n == 1 else
               [DeltaRunsConfig(warps_per_block=8, ahead=4, overlap=False)]) + \
        delta_runs_kept(n, 4)
    for config in configs:
        source = w if packed == "host" else _device_csr(w, dtype)
        kernel = compile_spmm(source, n, dtype, layout, bias=bias, config=config, tune_budget=None, residual=True)
        assert kernel.mapping == "delta-runs"
        for i in range(3):
            batch = (2,) if i == 2 else ()
            b = torch.randn((*batch, *kernel.in_shape), device="cuda", generator=gen).to(dtype)
            r = torch.randn((*batch, *kernel.out_shape), device="cuda", generator=gen).to(dtype)
            out = torch.full((*batch, *kernel.out_shape), float("nan"), device="cuda", dtype=dtype)
            kernel(b, residual=r, out=out)
            torch.cuda.synchronize()
            bias32 = torch.as_tensor(bias, device="cuda").to(torch.float32).double()
            ref = (wd @ b.double() + bias32[:, None] if layout == "kn" else b.double() @ wd.T + bias32) + r.double()
            assert torch.isfinite(out).all()
            assert ((out.double() - ref).norm() / ref.norm()).item() <= TOL[dtype], (config, i)
        dense = torch.full((1000, k), float("nan"), device="cuda", dtype=dtype)
        assert kernel.densify(dense) is dense and torch.equal(dense.double(), wd)
        assert kernel.__dict__.get("_dense_writer")  # by the dense-writer kernel, not the torch fallback


def test_the_chooser_reaches_it_at_one_token_in_16_bits():
    w = magnitude_prune(seeded_weight(4096, 4096, seed=5), 0.7)
    kernel = compile_spmm(w, 1, torch.float16, "nk", tune_budget=2.0)
    tried = {r.get("mapping") for r in kernel.choice.records if r.get("us")}
    assert "delta-runs" in tried, tried
    x = torch.randn(1, 4096, device="cuda").half()
    ref = x.double() @ torch.from_numpy(w.astype("float16").to_dense().astype(np.float64)).cuda().T
    assert ((kernel(x).double() - ref).norm() / ref.norm()).item() <= TOL[torch.float16]


def test_a_config_past_the_shared_memory_of_the_gpu_is_refused_with_the_fix():
    w = magnitude_prune(seeded_weight(64, 15000, seed=2), 0.9)  # X of 15000 x 8 in 16 bits: 240 KB
    with pytest.raises(ValueError, match="K <= 14528"):
        compile_spmm(w, 8, torch.float16, "nk", config=DeltaRunsConfig(), tune_budget=None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 3])
def test_a_gated_mlp_kernel_shares_the_two_kernels_arrays(dtype, n):
    """compile_gated_mlp(gate, up): silu(X G^T) * (X U^T) in one kernel over the two kernels' own device arrays
    (host-packed gate, device-packed up), against float64 into NaN-poisoned outputs."""
    from sparseforge import compile_gated_mlp

    name = str(dtype)[6:]
    gate, up = (magnitude_prune(seeded_weight(2000, 4096 + 8, seed=s), 0.7) for s in (11, 12))
    config = DeltaRunsConfig()
    kg = compile_spmm(gate, n, dtype, "nk", config=config, tune_budget=None)
    ku = compile_spmm(_device_csr(up, dtype), n, dtype, "nk", config=config, tune_budget=None)
    fused = compile_gated_mlp(kg, ku)
    assert fused.plan.name.endswith("_gated")
    shared = {t.data_ptr() for t in (*kg.weight_tensors, *ku.weight_tensors) if t is not None}
    assert {t.data_ptr() for t in fused.weight_tensors if t is not None} <= shared  # nothing copied
    wg, wu = (torch.from_numpy(w.astype(name).to_dense().astype(np.float64)).cuda() for w in (gate, up))
    gen = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(3):
        x = torch.randn(n, 4096 + 8, device="cuda", generator=gen).to(dtype)
        out = torch.full((n, 2000), float("nan"), device="cuda", dtype=dtype)
        fused(x, out=out)
        g, u = x.double() @ wg.T, x.double() @ wu.T
        ref = g * torch.sigmoid(g) * u
        assert torch.isfinite(out).all()
        assert ((out.double() - ref).norm() / ref.norm()).item() <= TOL[dtype]
    with pytest.raises(ValueError, match="one config"):
        compile_gated_mlp(kg, compile_spmm(up, n, dtype, "nk", config=DeltaRunsConfig(gap_bits=4), tune_budget=None))
