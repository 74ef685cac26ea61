"""The bitmap-tc kernel on the GPU (mappings/bitmap_tc/): both 16-bit dtypes x N in 1..16 (to 64 with B staged a
block) x densities {0, one
nonzero, 10%, 50%, 100%} x tails (M, K not multiples of 16 / 128, odd K), both layouts, batches, bias / ReLU /
residual, through compile_spmm with a fixed BitmapTcConfig, fresh inputs into NaN-poisoned outputs against
float64 (fp16 <= 5e-3, bf16 <= 3e-2 relative); the gated MLP kernel over two kernels' arrays; the format packed
on the GPU; densify; the chooser proposing it."""
import numpy as np
import pytest
import torch

from sparseforge import SparseMatrix, compile_spmm
from sparseforge.mappings.bitmap_tc.plan import BitmapTcConfig

pytestmark = pytest.mark.gpu


def _weight(m: int, k: int, density, seed: int) -> SparseMatrix:
    rng = np.random.default_rng(seed)
    dense = np.zeros((m, k), np.float32)
    if density == "one":
        dense[m // 2, k - 1] = 1.5
    elif density != "zero":
        dense = np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0).astype(np.float32)
    return SparseMatrix.from_dense(dense)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", list(range(1, 17)))
def test_every_width_matches_float64(n, dtype, matches_float64):
    layout = "nk" if n % 3 else "kn"
    w = _weight(77, 1000, 0.3, seed=n)  # 5 strips, the last partial; 8 chunks, the last partial
    config = BitmapTcConfig(warps_per_block=2, stages=3, scan_group=(1, 2, 4)[n % 3])
    kernel = compile_spmm(w, n, dtype, layout, config=config, tune_budget=None)
    assert kernel.mapping == "bitmap-tc"
    matches_float64(kernel, w, dtype, layout, seed=n)


@pytest.mark.parametrize("density", ["zero", "one", 0.1, 0.5, 1.0], ids=str)
@pytest.mark.parametrize("m,k", [(16, 128), (33, 70), (130, 1001), (8, 4104), (64, 14336)])
@pytest.mark.parametrize("config", [BitmapTcConfig(8, 2, 1), BitmapTcConfig(16, 2, 1), BitmapTcConfig(4, 4, 1),
                                    BitmapTcConfig(8, 3, 1), BitmapTcConfig(8, 2, 4), BitmapTcConfig(8, 2, 8),
                                    BitmapTcConfig(4, 4, 2), BitmapTcConfig(8, 4, 4), BitmapTcConfig(4, 6, 4),
                                    BitmapTcConfig(8, 3, 4, 2), BitmapTcConfig(8, 2, 4, blocks_per_sm=4),
                                    BitmapTcConfig(4, 2, 4, blocks_per_sm=8)],
                         ids=lambda c: c.short())
def test_densities_and_tails_match_float64(density, m, k, config, matches_float64):
    w = _weight(m, k, density, seed=m + k)
    for n, layout in ((1, "nk"), (8, "nk"), (16, "kn")):
        kernel = compile_spmm(w, n, torch.float16, layout, config=config, tune_budget=None)
        matches_float64(kernel, w, torch.float16, layout, seed=n)


@pytest.mark.parametrize("density", ["zero", "one", 0.1, 0.5, 1.0], ids=str)
@pytest.mark.parametrize("m,k", [(16, 128), (33, 70), (130, 1001), (50, 4104), (64, 14336)])
@pytest.mark.parametrize("config", [BitmapTcConfig(8, 2, 4, strips=2), BitmapTcConfig(4, 2, 4, strips=2),
                                    BitmapTcConfig(4, 3, 2, strips=2), BitmapTcConfig(4, 2, 2, strips=4),
                                    BitmapTcConfig(4, 3, 2, strips=4)],
                         ids=lambda c: c.short())
def test_several_strips_a_warp_match_float64(density, m, k, config, matches_float64):
    """config.strips (N >= 8): M not a multiple of the block's strips, a block past the matrix's last strip."""
    w = _weight(m, k, density, seed=m + k)
    for n, layout, dtype in ((8, "nk", torch.float16), (16, "kn", torch.float16), (9, "nk", torch.bfloat16)):
        kernel = compile_spmm(w, n, dtype, layout, config=config, tune_budget=None)
        matches_float64(kernel, w, dtype, layout, seed=n)


@pytest.mark.parametrize("density", ["zero", "one", 0.1, 0.5, 1.0], ids=str)
@pytest.mark.parametrize("m,k", [(16, 128), (33, 72), (130, 1000), (50, 4104), (64, 14336)])
@pytest.mark.parametrize("config", [BitmapTcConfig(8, 3, 1, b_ahead=1), BitmapTcConfig(8, 2, 4, b_ahead=1),
                                    BitmapTcConfig(4, 4, 1, b_ahead=1),
                                    BitmapTcConfig(8, 2, 4, blocks_per_sm=3, b_ahead=1)],
                         ids=lambda c: c.short())
def test_b_loaded_a_chunk_ahead_matches_float64(density, m, k, config, matches_float64):
    """config.b_ahead (X as N x K, K a multiple of 8): the next chunk's B in the other register set, past K zero
    (two n-tiles with 3 blocks an SM leave too few registers: refused)."""
    w = _weight(m, k, density, seed=m + k)
    for n, dtype in ((1, torch.float16), (8, torch.float16), (9, torch.bfloat16), (16, torch.float16)):
        if config.blocks_per_sm > 1 and n > 8:
            with pytest.raises(ValueError, match="use fewer blocks_per_sm"):
                compile_spmm(w, n, dtype, "nk", config=config, tune_budget=None)
            continue
        kernel = compile_spmm(w, n, dtype, "nk", config=config, tune_budget=None)
        matches_float64(kernel, w, dtype, "nk", seed=n)


@pytest.mark.parametrize("density", ["zero", "one", 0.1, 0.5, 1.0], ids=str)
@pytest.mark.parametrize("m,k", [(16, 128), (33, 72), (130, 1000), (50, 4104), (1030, 4096), (64, 14336)])
@pytest.mark.parametrize("config", [BitmapTcConfig(8, 2, 4, b_shared=1), BitmapTcConfig(8, 3, 4, b_shared=1),
                                    BitmapTcConfig(4, 3, 4, b_shared=1), BitmapTcConfig(4, 4, 2, b_shared=1),
                                    BitmapTcConfig(8, 2, 4, b_shared=1, k_split=4),
                                    BitmapTcConfig(4, 3, 1, b_shared=1, k_split=2)],
                         ids=lambda c: c.short())
def test_b_staged_a_block_matches_float64(density, m, k, config, matches_float64):
    """config.b_shared (X as N x K, K a multiple of 8): a strip a warp, B's chunk staged once a block, N up to
    64 (8 n-tiles), spare warps past the last strip, K split over blocks (a batch entry a launch)."""
    w = _weight(m, k, density, seed=m + k)
    for n, dtype in ((8, torch.float16), (17, torch.bfloat16), (40, torch.float16), (64, torch.bfloat16)):
        kernel = compile_spmm(w, n, dtype, "nk", config=config, tune_budget=None)
        assert kernel.mapping == "bitmap-tc"
        matches_float64(kernel, w, dtype, "nk", batch=() if config.k_split > 1 else (2,), seed=n)


@pytest.mark.parametrize("density", ["zero", "one", 0.1, 0.5, 1.0], ids=str)
@pytest.mark.parametrize("m,k", [(16, 128), (33, 70), (130, 1001), (1024, 4096), (64, 14336)])
@pytest.mark.parametrize("config", [BitmapTcConfig(8, 3, 1, k_split=2), BitmapTcConfig(8, 2, 4, k_split=4),
                                    BitmapTcConfig(4, 4, 1, k_split=4), BitmapTcConfig(8, 2, 4, k_split=8)],
                         ids=lambda c: c.short())
def test_k_split_over_blocks_matches_float64_call_after_call(density, m, k, config):
    """config.k_split: the strip's blocks meet through the kernel's workspace and counters, which the last block
    re-arms: eager calls and CUDA-graph replays, one after another, each right against float64 (NaN-poisoned
    outputs), bias, ReLU and the residual included; a batch refused with the fix."""
    w = _weight(m, k, density, seed=m + k)
    bias = np.random.default_rng(2).standard_normal(m)
    dense = torch.from_numpy(w.to_dense().astype(np.float64)).cuda()
    for n, layout, dtype in ((8, "nk", torch.float16), (16, "kn", torch.float16), (3, "nk", torch.bfloat16)):
        kernel = compile_spmm(w, n, dtype, layout, bias=bias, relu=True, residual=True, config=config, tune_budget=None)
        gen = torch.Generator(device="cuda").manual_seed(n)
        b = torch.empty(kernel.in_shape, device="cuda", dtype=dtype)
        r = torch.empty(kernel.out_shape, device="cuda", dtype=dtype)
        out = torch.empty(kernel.out_shape, device="cuda", dtype=dtype)
        graph = torch.cuda.CUDAGraph()
        kernel(b.normal_(generator=gen), out=out, residual=r.normal_(generator=gen))  # warm, then captured
        with torch.cuda.graph(graph):
            kernel(b, out=out, residual=r)
        for call in range(6):
            b.normal_(generator=gen)
            r.normal_(generator=gen)
            out.fill_(float("nan"))
            graph.replay() if call % 2 else kernel(b, out=out, residual=r)
            ref = dense @ b.double() if layout == "kn" else b.double() @ dense.T
            bt = torch.as_tensor(bias, dtype=torch.float32, device="cuda").double()
            ref = (ref + (bt[:, None] if layout == "kn" else bt) + r.double()).clamp_min(0)
            err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            assert torch.isfinite(out).all() and err <= {torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype], (n, call)
        with pytest.raises(ValueError, match="workspace for 1 batch entry at a time: call it once per entry"):
            kernel(b.expand(2, *b.shape).contiguous(), residual=r.expand(2, *r.shape).contiguous())


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_batched_bias_relu_and_residual(layout, dtype, matches_float64):
    w = _weight(50, 300, 0.4, seed=3)
    bias = np.random.default_rng(1).standard_normal(50)
    kernel = compile_spmm(w, 6, dtype, layout, bias=bias, relu=True, residual=True,
                          config=BitmapTcConfig(4, 2), tune_budget=None)
    matches_float64(kernel, w, dtype, layout, batch=(3,), bias=bias, relu=True, residual=True, seed=5)
    kernel = compile_spmm(w, 8, dtype, layout, bias=bias, relu=True, residual=True,
                          config=BitmapTcConfig(4, 2, 2, strips=4), tune_budget=None)
    matches_float64(kernel, w, dtype, layout, batch=(3,), bias=bias, relu=True, residual=True, seed=6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, layout, m, k", [(8, "nk", 2000, 4104), (9, "nk", 77, 1001), (16, "kn", 130, 3000),
                                             (8, "kn", 1, 128)])
@pytest.mark.parametrize("config", [BitmapTcConfig(), BitmapTcConfig(8, 3, 1), BitmapTcConfig(4, 4, 1),
                                    BitmapTcConfig(8, 3, 4, 2)], ids=lambda c: c.short())
def test_a_gated_mlp_kernel_shares_the_two_kernels_arrays(dtype, n, layout, m, k, config):
    """compile_gated_mlp(gate, up) on bitmap-tc kernels (gate packed on the host, up on the GPU, different
    patterns and densities): silu(G x) * (U x) in one kernel over their own device arrays, nothing copied;
    batched, fresh inputs into NaN-poisoned outputs against float64."""
    from sparseforge import compile_gated_mlp
    from sparseforge.formats.device import DeviceCsr

    name = str(dtype)[6:]
    gate, up = _weight(m, k, 0.5, seed=m + 1).astype(name), _weight(m, k, 0.3, seed=m + 2).astype(name)
    device_up = DeviceCsr(torch.from_numpy(up.indptr.astype(np.int64)).cuda(),
                          torch.from_numpy(up.indices.astype(np.int32)).cuda(),
                          torch.from_numpy(up.values.astype(np.float32)).cuda().to(dtype), up.shape, name)
    kg = compile_spmm(gate, n, dtype, layout, config=config, tune_budget=None)
    ku = compile_spmm(device_up, n, dtype, layout, config=config, tune_budget=None)
    fused = compile_gated_mlp(kg, ku)
    assert fused.mapping == "bitmap-tc" and fused.plan.name.endswith("_gated")
    shared = {t.data_ptr() for t in (*kg.weight_tensors, *ku.weight_tensors) if t is not None}
    assert {t.data_ptr() for t in fused.weight_tensors if t is not None} <= shared  # nothing copied
    wg, wu = (torch.from_numpy(w.to_dense().astype(np.float64)).cuda() for w in (gate, up))
    gen = torch.Generator(device="cuda").manual_seed(n)
    for batch in ((), (), (3,)):
        x = torch.randn((*batch, *fused.in_shape), device="cuda", generator=gen).to(dtype)
        out = torch.full((*batch, *fused.out_shape), float("nan"), device="cuda", dtype=dtype)
        fused(x, out=out)
        g, u = (w @ x.double() if layout == "kn" else x.double() @ w.T for w in (wg, wu))
        ref = g * torch.sigmoid(g) * u
        assert torch.isfinite(out).all()
        assert ((out.double() - ref).norm() / ref.norm()).item() <= {torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]


@pytest.mark.parametrize("grouped", [True, False])
def test_the_format_packed_on_the_gpu_gives_the_hosts_bits(grouped):
    from sparseforge.formats.bitmap_tiles import bitmap_tiles, bitmap_tiles_on_device
    from sparseforge.formats.device import DeviceCsr

    w = _weight(4096, 1111, 0.5, seed=9).astype("float16")
    csr = DeviceCsr(torch.from_numpy(w.indptr.astype(np.int64)).cuda(), torch.from_numpy(w.indices.copy()).cuda(),
                    torch.from_numpy(w.values.astype(np.float32)).cuda().half(), w.shape, "float16")
    on_gpu, on_host = bitmap_tiles_on_device(csr, "float16", grouped), bitmap_tiles(w, "float16", grouped)
    assert np.array_equal(on_gpu.on_host().data, on_host.data) and np.array_equal(on_gpu.offsets, on_host.offsets)


@pytest.mark.parametrize("layout", ["nk", "kn"])  # the grouped and the natural column order
def test_densify_gives_w_back_on_the_gpu(layout):
    w = _weight(200, 3000, 0.3, seed=4).astype("bfloat16")
    kernel = compile_spmm(w, 8, torch.bfloat16, layout, config=BitmapTcConfig(), tune_budget=None)
    out = torch.full((200, 3000), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert kernel.densify(out) is out
    assert torch.equal(out.cpu(), torch.from_numpy(w.to_dense().astype(np.float32)).to(torch.bfloat16))


def test_the_chooser_proposes_it_at_n_8():
    from sparseforge.tune.space import search_space

    assert any(isinstance(c, BitmapTcConfig) for c in search_space(8, "nk", 4096, 2048.0, dtype="float16"))
    assert not any(isinstance(c, BitmapTcConfig) for c in search_space(1, "nk", 4096, 2048.0, dtype="float16"))
