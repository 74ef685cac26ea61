"""GPU numerics of generated SpMM kernels against a float64 reference (run on the device)."""
import numpy as np
import pytest
import torch

from sparseforge import SparseMatrix, compile_spmm, spmm
from sparseforge.mappings.registry import plan_family
from sparseforge.mappings.csr.plan import CsrConfig
from sparseforge.plan import TileConfig
from sparseforge.suite import SAMPLE_DIR, discover

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def random_matrix(m, k, nnz=None, density=None, seed=0, empty_rows=()):
    rng = np.random.default_rng(seed)
    if density is not None:
        nnz = int(round(density * m * k))
    flat = rng.choice(m * k, size=min(nnz, m * k), replace=False)
    dense = np.zeros(m * k, np.float32)
    dense[flat] = rng.standard_normal(len(flat)).astype(np.float32)
    dense = dense.reshape(m, k)
    dense[list(empty_rows)] = 0
    return SparseMatrix.from_dense(dense)


def reference(w, b, layout, bias=None, relu=False):
    wd = torch.from_numpy(w.to_dense().astype(np.float64)).cuda()
    out = wd @ b.double() if layout == "kn" else b.double() @ wd.T
    if bias is not None:
        bias64 = torch.as_tensor(bias, dtype=torch.float64, device="cuda")
        out = out + (bias64[:, None] if layout == "kn" else bias64[None, :])
    return out.clamp_min(0) if relu else out


def check(kernel, w, b, layout, dtype, bias=None, relu=False):
    out = torch.full((*b.shape[:-2], *kernel.out_shape), float("nan"), device="cuda", dtype=dtype)
    kernel(b, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "unwritten (NaN) outputs"
    wr = w.astype(str(dtype).replace("torch.", ""))
    ref = reference(wr, b, layout, bias, relu)
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    if ref.norm() == 0:
        assert out.abs().max().item() == 0
    else:
        assert err <= TOL[dtype], f"relative error {err:.2e}"


SHAPES = [  # (M, K, N, nnz or density, empty rows)
    (7, 96, 40, dict(nnz=333), ()),
    (1, 1, 1, dict(nnz=1), ()),
    (33, 65, 17, dict(density=0.1), (0, 5, 32)),
    (64, 64, 100, dict(density=0.5), ()),
    (5, 8, 3, dict(nnz=0), ()),
    (130, 300, 257, dict(density=0.05), (7,)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("epilogue", ["none", "bias", "relu", "bias_relu"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_numerics(dtype, layout, epilogue, shape):
    m, k, n, spec, empty = shape
    w = random_matrix(m, k, seed=m * 7 + k, empty_rows=empty, **spec)
    bias = np.linspace(-1, 1, m) if "bias" in epilogue else None
    relu = "relu" in epilogue
    kernel = compile_spmm(w, n, dtype, layout, bias=bias, relu=relu, tune_budget=None)
    b = torch.randn((k, n) if layout == "kn" else (n, k), device="cuda").to(dtype)
    check(kernel, w, b, layout, dtype, bias, relu)


@pytest.mark.parametrize("config", [TileConfig(1, 1, 1), TileConfig(8, 4, 4, 4), TileConfig(3, 16, 2, 16),
                                    TileConfig(2, 2, 4, 1), TileConfig(4, 2, 2, 8, 3)], ids=lambda c: c.short())
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_configs(config, layout):
    w = random_matrix(77, 190, density=0.1, seed=3, empty_rows=(10,))
    for dtype in (torch.float32, torch.float16):
        kernel = compile_spmm(w, 96, dtype, layout, config=config)
        b = torch.randn((190, 96) if layout == "kn" else (96, 190), device="cuda").to(dtype)
        check(kernel, w, b, layout, dtype)


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_batched_input(layout):
    w = random_matrix(40, 72, density=0.1, seed=5)
    kernel = compile_spmm(w, 50, torch.float32, layout, tune_budget=None)
    b = torch.randn((3, 72, 50) if layout == "kn" else (3, 50, 72), device="cuda")
    check(kernel, w, b, layout, torch.float32)


def test_spmm_one_call_and_graph_capture():
    w = random_matrix(48, 64, density=0.1, seed=9)
    b = torch.randn(64, 128, device="cuda")
    c = spmm(w, b)
    check_ref = reference(w, b, "kn")
    assert ((c.double() - check_ref).norm() / check_ref.norm()).item() < 1e-5
    kernel = compile_spmm(w, 128, torch.float32, tune_budget=None)
    out = torch.empty(48, 128, device="cuda")
    graph = torch.cuda.CUDAGraph()
    kernel(b, out=out)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        kernel(b, out=out)
    out.fill_(float("nan"))
    b.copy_(torch.randn_like(b))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(w, b, "kn")
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_tuning_picks_and_persists(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEFORGE_CACHE_DIR", str(tmp_path))
    w = random_matrix(128, 256, density=0.1, seed=11)
    kernel = compile_spmm(w, 512, torch.float32, tune_budget=2.0)
    assert len(kernel.tuning) >= 2
    again = compile_spmm(w, 512, torch.float32, tune_budget=2.0)
    assert again.plan.config == kernel.plan.config and again.cache_hit


def test_bad_inputs_are_clear_errors():
    w = random_matrix(16, 32, density=0.2, seed=1)
    kernel = compile_spmm(w, 8, torch.float32, tune_budget=None)
    with pytest.raises(TypeError, match="dtype"):
        kernel(torch.randn(32, 8, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="is on cpu"):
        kernel(torch.randn(32, 8))
    with pytest.raises(ValueError, match="shape"):
        kernel(torch.randn(31, 8, device="cuda"))
    with pytest.raises(ValueError, match="contiguous"):
        kernel(torch.randn(8, 32, device="cuda").t())
    with pytest.raises(ValueError, match="CUDA device"):
        compile_spmm(w, 8, device="cpu")
    with pytest.raises(TypeError, match="dtype"):
        compile_spmm(w, 8, dtype=torch.int8)


def test_misaligned_input_still_correct():
    w = random_matrix(32, 64, density=0.1, seed=2)
    kernel = compile_spmm(w, 256, torch.float32, config=TileConfig(4, 4, 4))
    storage = torch.randn(64 * 256 + 1, device="cuda")
    b = storage[1:].view(64, 256)
    check(kernel, w, b, "kn", torch.float32)


@pytest.mark.parametrize("case", discover(SAMPLE_DIR), ids=lambda c: c.name)
def test_bundled_dlmc_sample(case):
    w = case.load()
    n = min(case.N, 512)
    for layout in ("kn", "nk"):
        kernel = compile_spmm(w, n, torch.float32, layout, tune_budget=None)
        b = torch.randn((case.K, n) if layout == "kn" else (n, case.K), device="cuda")
        check(kernel, w, b, layout, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("config", [TileConfig(4, 2, 1, 8, 1, 6), TileConfig(2, 4, 4, 16, 2, 20),
                                    TileConfig(1, 1, 2, 4, 1, 3)], ids=lambda c: c.short())
def test_split_rows(dtype, layout, config):
    """Split groups add partial sums atomically into zeroed rows; a long row and bias included."""
    w = random_matrix(45, 300, density=0.08, seed=13, empty_rows=(4,))
    dense = w.to_dense()
    dense[7] = np.random.default_rng(0).standard_normal(300)  # one long row
    w = type(w).from_dense(dense)
    bias = np.linspace(-1, 1, 45)
    kernel = compile_spmm(w, 72, dtype, layout, bias=bias, config=config)
    assert kernel.plan.partial_rows and 7 in kernel.plan.partial_rows
    for batch in ((), (2,)):
        b = torch.randn((*batch, 300, 72) if layout == "kn" else (*batch, 72, 300), device="cuda").to(dtype)
        check(kernel, w, b, layout, dtype, bias)


def test_split_rows_under_graph_replay():
    w = random_matrix(64, 256, density=0.2, seed=21)
    kernel = compile_spmm(w, 128, torch.float32, config=TileConfig(4, 4, 1, 8, 1, 10))
    b = torch.randn(256, 128, device="cuda")
    out = torch.empty(64, 128, device="cuda")
    kernel(b, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel(b, out=out)
    for _ in range(3):  # replays must not keep adding onto the previous result
        b.copy_(torch.randn_like(b))
        graph.replay()
    torch.cuda.synchronize()
    ref = reference(w, b, "kn")
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", [TileConfig(4, 2, 1, 8, 4, 0, 32), TileConfig(2, 4, 4, 16, 3, 0, 100),
                                    TileConfig(4, 1, 2, 8, 2, 12, 50)], ids=lambda c: c.short())
def test_chunked_runs(dtype, config):
    """kn with chunk_k: the run's groups chunk by chunk, accumulators kept across chunks."""
    w = random_matrix(45, 300, density=0.1, seed=17, empty_rows=(0, 44))
    bias = np.linspace(-1, 1, 45)
    relu = not config.segment_nnz
    kernel = compile_spmm(w, 72, dtype, "kn", bias=bias, relu=relu, config=config)
    for batch in ((), (2,)):
        b = torch.randn((*batch, 300, 72), device="cuda").to(dtype)
        check(kernel, w, b, "kn", dtype, bias, relu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("epilogue", ["none", "bias_relu"])
@pytest.mark.parametrize("config", [TileConfig(4, 4, 1, 16, 1, transpose_x=True),
                                    TileConfig(2, 2, 1, 8, 3, 0, 64, transpose_x=True),
                                    TileConfig(4, 8, 1, 16, 1, 15, transpose_x=True)], ids=lambda c: c.short())
def test_nk_with_transposed_x(dtype, epilogue, config):
    """nk read through a transposed copy of X, kn-style, Y written in place; tails, batches, empty rows."""
    if config.segment_nnz and epilogue == "bias_relu":
        epilogue = "bias"  # split rows cannot fuse ReLU (refused by make_plan, tested on the CPU)
    w = random_matrix(70, 190, density=0.1, seed=19, empty_rows=(3, 69))
    bias = np.linspace(-1, 1, 70) if "bias" in epilogue else None
    relu = "relu" in epilogue
    kernel = compile_spmm(w, 77, dtype, "nk", bias=bias, relu=relu, config=config)
    for batch in ((), (3,)):
        x = torch.randn((*batch, 77, 190), device="cuda").to(dtype)
        check(kernel, w, x, "nk", dtype, bias, relu)


@pytest.mark.parametrize("layout,n", [("kn", 49), ("kn", 8), ("nk", 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compile_spmm_adds_a_residual_before_relu(layout, n, dtype):
    """residual=True (the chooser over the families whose record says they add one): C = relu(W B + bias + R),
    in place too."""
    w = random_matrix(96, 300, density=0.1, seed=4)
    bias = np.linspace(-1, 1, 96)
    k = compile_spmm(w, n, dtype, layout, bias=bias, relu=True, residual=True, tune_budget=1.0)
    assert plan_family(k.plan).residual, k.plan
    b = torch.randn(k.in_shape, device="cuda").to(dtype)
    r = torch.randn(k.out_shape, device="cuda").to(dtype)
    out = torch.full(k.out_shape, float("nan"), device="cuda", dtype=dtype)
    k(b, out=out, residual=r)
    ref = (reference(w.astype(str(dtype).replace("torch.", "")), b, layout,
                     torch.as_tensor(bias, dtype=torch.float32).double().numpy()) + r.double()).clamp_min(0)
    assert ((out.double() - ref).norm() / ref.norm()).item() <= TOL[dtype]
    k(b, out=r, residual=r)
    assert torch.equal(r, out)


STAGED = [  # (M, K, N, density, layout): odd tails, an empty matrix, and Llama-sized K whose copy of B is
    # over the 48 KB a launch gets without raising the function's limit (K = 4096, N = 16 in fp16: 128 KB)
    (33, 65, 3, 0.1, "kn"),
    (130, 300, 16, 0.05, "nk"),
    (5, 8, 1, 0.0, "kn"),
    (1024, 4096, 16, 0.1, "kn"),
    (1024, 4096, 8, 0.1, "nk"),
    (512, 14336, 4, 0.1, "kn"),
]


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,n,density,layout", STAGED)
def test_staged_kernels_match_float64(m, k, n, density, layout, dtype, prefetch):
    """csr-staged (B copied into dynamic shared memory, persistent blocks) on the GPU, batched, with bias and
    ReLU, NaN-poisoned outputs; sizes its arch cannot hold are refused by name."""
    from sparseforge.mappings.csr.plan import CsrConfig, staged_fits

    w = random_matrix(m, k, density=density, seed=m + n)
    columns = 1 << (n - 1).bit_length()
    config = CsrConfig(32, columns, 16 if columns >= 16 else 8, 1, stage_b=True, ctas=7, prefetch=prefetch)
    name = str(dtype).replace("torch.", "")
    arch = torch.cuda.get_device_capability()[0] * 10
    if not staged_fits(k, n, name, arch):
        with pytest.raises(ValueError, match="shared memory"):
            compile_spmm(w, n, dtype, layout, config=config, tune_budget=None)
        return
    bias = np.linspace(-1, 1, m)
    kernel = compile_spmm(w, n, dtype, layout, bias=bias, relu=True, config=config, tune_budget=None)
    assert kernel.plan.mapping == "csr-staged"
    gen = torch.Generator(device="cuda").manual_seed(3)
    b = torch.randn((2, k, n) if layout == "kn" else (2, n, k), device="cuda", generator=gen).to(dtype)
    check(kernel, w, b, layout, dtype, bias, relu=True)


PREFETCH = [(33, 65, 3, 0.1, "kn"), (130, 300, 16, 0.05, "nk"), (5, 8, 1, 0.0, "kn"), (1024, 4096, 1, 0.1, "kn"),
            (4096, 4096, 8, 0.1, "kn"), (257, 4096, 16, 0.3, "nk")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,n,density,layout", PREFETCH)
def test_prefetching_small_n_kernels_match_float64(m, k, n, density, layout, dtype):
    """The small-N kernel with the next step's loads issued ahead (CsrConfig.prefetch), two steps of 4 a
    lane where the columns allow it, batched, bias and ReLU, NaN-poisoned outputs."""
    from sparseforge.mappings.csr.plan import CsrConfig

    w = random_matrix(m, k, density=density, seed=m + n + 1)
    columns = min(1 << (n - 1).bit_length(), 8)
    config = CsrConfig(32 if density > 0.05 else 8, columns, 4, 2, prefetch=True)
    bias = np.linspace(-1, 1, m)
    kernel = compile_spmm(w, n, dtype, layout, bias=bias, relu=True, config=config, tune_budget=None)
    assert kernel.plan.mapping == "csr" and kernel.plan.config.prefetch
    gen = torch.Generator(device="cuda").manual_seed(5)
    b = torch.randn((2, k, n) if layout == "kn" else (2, n, k), device="cuda", generator=gen).to(dtype)
    check(kernel, w, b, layout, dtype, bias, relu=True)


@pytest.mark.parametrize("config", [TileConfig(), "csr"])
def test_a_kernels_own_weights_copy_computes_the_same(config):
    """The rotated timing's copies (runtime.kernel.kernel_copies): where W is the code a second load of the
    cubin, unloaded by release_copies; where W is data a second copy of its arrays. Each computes what the
    original does."""
    from sparseforge.mappings.csr.plan import CsrConfig
    from sparseforge.runtime.kernel import kernel_copies, release_copies

    w = random_matrix(96, 160, density=0.2, seed=3)
    kernel = compile_spmm(w, 8, "float16", "nk", config=CsrConfig() if config == "csr" else config, tune_budget=0)
    code = config != "csr"
    twin, = kernel_copies(kernel, 1)
    assert (kernel.code_bytes > 0) == code and (twin._loaded is not kernel._loaded) == code
    assert (twin.weight_bytes > 0) == (not code)
    x = torch.randn(8, 160, device="cuda").half()
    check(twin, w, x, "nk", torch.float16)
    check(kernel, w, x, "nk", torch.float16)
    release_copies([twin])
    assert (twin._loaded.module is None) == code  # the copy's own module unloaded; the kernel's stays
    check(kernel, w, x, "nk", torch.float16)
    if code:
        with pytest.raises(ValueError, match="with_own_weights\\(cubin"):
            kernel.with_own_weights()


def test_decode_widths_are_chosen_with_rotated_weights(tmp_path, monkeypatch):
    """At n <= ROTATED_MAX_N the chooser times dense and every candidate over copies of their weights; above
    it, one copy. The choice runs correctly either way."""
    import sparseforge.runtime.timing as timing

    monkeypatch.setenv("SPARSEFORGE_CACHE_DIR", str(tmp_path))  # nothing chosen before: everything timed
    calls = []
    rotating = timing.rotating_graph_time_us

    def counted(fn, operands, *args, **kwargs):
        calls.append(len(operands))
        return rotating(fn, operands, *args, **kwargs)

    monkeypatch.setattr(timing, "rotating_graph_time_us", counted)
    w = random_matrix(512, 1024, density=0.1, seed=4)
    kernel = compile_spmm(w, 1, "float16", "nk", tune_budget=1.0)
    timed = [r for r in kernel.choice.records if r.get("us") is not None]
    assert len(calls) >= len(timed) + 1 and all(c >= 2 for c in calls)  # each candidate and dense, rotated
    check(kernel, w, torch.randn(1, 1024, device="cuda").half(), "nk", torch.float16)
    calls.clear()
    wide = compile_spmm(w, timing.ROTATED_MAX_N + 1, "float16", "nk", tune_budget=1.0)
    assert calls == []
    check(wide, w, torch.randn(timing.ROTATED_MAX_N + 1, 1024, device="cuda").half(), "nk", torch.float16)


@pytest.mark.parametrize("config, k", [  # 16- and 32-bit column indices; B staged where K x N fits
    (CsrConfig(), 300), (CsrConfig(), 70_000),
    (CsrConfig(lanes_per_row=8, columns=8, stage_b=True, ctas=132, prefetch=True), 300)])
def test_a_device_csr_kernel_runs_its_arrays_where_they_were_packed(config, k):
    """compile_spmm(DeviceCsr, config=csr): the arrays are packed on the GPU and the kernel reads them there
    (no second copy); its output is the host-packed kernel's, bit for bit, and right against float64; a timing
    copy streams its own arrays; densify gives W back."""
    from sparseforge.formats.device import DeviceCsr

    w = random_matrix(96, k, density=0.1 if k < 1000 else 0.002, seed=11, empty_rows=(5,)).astype("float16")
    device_w = DeviceCsr(torch.from_numpy(w.indptr.copy()).cuda(), torch.from_numpy(w.indices.copy()).cuda(),
                         torch.from_numpy(w.values.copy()).cuda(), w.shape, "float16")
    bias = np.linspace(-1, 1, 96)
    kernel = compile_spmm(device_w, 8, torch.float16, "nk", bias=bias, config=config)
    host_kernel = compile_spmm(w, 8, torch.float16, "nk", bias=bias, config=config)
    assert kernel.plan.cols.is_cuda and kernel._weight_tensors[0] is kernel.plan.values
    x = torch.randn(8, k, device="cuda").half()
    check(kernel, w, x, "nk", torch.float16, bias)
    assert torch.equal(kernel(x), host_kernel(x))
    twin = kernel.with_own_weights()
    assert twin._weight_tensors[1].data_ptr() != kernel.plan.cols.data_ptr() and torch.equal(twin(x), kernel(x))
    out = torch.full((96, k), float("nan"), device="cuda", dtype=torch.float16)
    assert kernel.densify(out) is out and torch.equal(out.cpu(), torch.from_numpy(w.to_dense()).half())


def test_a_device_csr_tc_scatter_kernel_reads_the_format_built_on_the_gpu():
    """compile_spmm(DeviceCsr, config=TcScatterConfig): the scatter format is built on the GPU and read there;
    the output is the host-built kernel's, bit for bit, and right against float64."""
    from sparseforge.formats.device import DeviceCsr
    from sparseforge.mappings.tc_scatter.plan import TcScatterConfig

    w = random_matrix(200, 4096, density=0.3, seed=12, empty_rows=(7,)).astype("bfloat16")
    device_w = DeviceCsr(torch.from_numpy(w.indptr.copy()).cuda(), torch.from_numpy(w.indices.copy()).cuda(),
                         torch.from_numpy(w.values.copy()).cuda().bfloat16(), w.shape, "bfloat16")
    kernel = compile_spmm(device_w, 8, torch.bfloat16, "nk", config=TcScatterConfig())
    host_kernel = compile_spmm(w, 8, torch.bfloat16, "nk", config=TcScatterConfig())
    assert kernel.plan.format.values.is_cuda and kernel.plan.format.records.is_cuda
    x = torch.randn(8, 4096, device="cuda").bfloat16()
    check(kernel, w, x, "nk", torch.bfloat16)
    assert torch.equal(kernel(x), host_kernel(x))
