"""Bad input to the GPU entry points, on the device: compile_spmm, spmm, a compiled kernel (every
kernel form) and SparseLinear24 refuse wrong shapes, dtypes, devices, strides and an out sharing B's memory
with an error naming the problem and the fix, before anything is launched; an empty batch gives an empty
output without a launch; NaN and inf in B reach exactly the outputs whose row of W uses that column
(tests/cpu/codegen/test_nan_semantics.py runs the same problem on the PTX interpreter; the CPU tests of
SpmmKernel's glue are tests/cpu/runtime/test_kernel_call.py)."""
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparseforge import SparseFormatError, SparseLinear24, SparseMatrix, compile_spmm, spmm
from sparseforge.plan import TileConfig
from sparseforge.mappings.csr.plan import CsrConfig
from sparseforge.prune import nm_mask
from sparseforge.semi import Sparse24Error

pytestmark = pytest.mark.gpu
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")

M = K = 24  # square: an out can have B's shape, so it can be B itself
N = 8
UNUSED = 0  # a column of W no row uses (and where the small-N kernel's padding points)
NAN, INF = float("nan"), float("inf")
DEFAULT = TileConfig(4, 2, 1, 4)  # kn: row groups; nk: X staged through shared memory
FORMS = [
    ("kn", TileConfig(4, 2, 1, 4)),
    ("kn", TileConfig(1, 1, 1, 4)),
    ("kn", TileConfig(2, 1, 1, 4, 1, 6)),
    ("nk", TileConfig(2, 2, 1, 4)),
    ("nk", TileConfig(2, 1, 1, 4, 1, transpose_x=True)),
    ("kn", CsrConfig(8, 4, 1)),
    ("nk", CsrConfig(8, 4, 1)),
]
FORM_IDS = ["row_groups", "row_per_block", "split_k", "nk_staged", "nk_transposed", "small_n_kn", "small_n_nk"]
MAPPINGS = ["row-groups", "row-per-block", "split-k", "staged-x", "row-groups", "csr", "csr"]


def poison_weight() -> SparseMatrix:
    """W (24 x 24): column 0 unused, column 3 used by rows 1, 4, 7, ..., 22, column 7 by rows 2 (+1.0) and
    6 (-2.0), row 5 empty; values exact in bfloat16."""
    rng = np.random.default_rng(7)
    values = rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 1.5], (M, K))
    dense = np.where(rng.random((M, K)) < 0.3, values, 0).astype(np.float32)
    dense[:, UNUSED] = 0
    dense[:, 3] = 0
    dense[1::3, 3] = 1.5
    dense[:, 7] = 0
    dense[[2, 6], 7] = [1.0, -2.0]
    dense[5] = 0
    return SparseMatrix.from_dense(dense)


W = poison_weight()


def poisoned_b() -> np.ndarray:
    """(2, K, N) in kn terms: NaN through all of the unused column; batch 1 a NaN at (3, 2); batch 0 +inf at
    (7, 4)."""
    b = np.random.default_rng(8).standard_normal((2, K, N))
    b[:, UNUSED, :] = NAN
    b[1, 3, 2] = NAN
    b[0, 7, 4] = INF
    return b


def sparse_reference(w: SparseMatrix, b: np.ndarray) -> np.ndarray:
    """[batch,] M x N in float64 from W's stored nonzeros only (IEEE: NaN * w = NaN, inf * w = +-inf)."""
    out = np.zeros((*b.shape[:-2], w.shape[0], b.shape[-1]))
    for i in range(w.shape[0]):
        lo, hi = w.indptr[i], w.indptr[i + 1]
        if hi > lo:
            out[..., i, :] = (w.values[lo:hi, None].astype(np.float64) * b[..., w.indices[lo:hi], :]).sum(-2)
    return out


def reference(b: torch.Tensor, layout: str) -> torch.Tensor:
    wd = torch.from_numpy(W.to_dense().astype(np.float64)).to(b.device)
    return wd @ b.double() if layout == "kn" else b.double() @ wd.T


def assert_close(got: torch.Tensor, b: torch.Tensor, layout: str) -> None:
    torch.cuda.synchronize()
    ref = reference(b, layout)
    assert got.shape == ref.shape and torch.isfinite(got).all()
    assert ((got.double() - ref).norm() / ref.norm()).item() <= 1e-5


@pytest.fixture(scope="module")
def kernels():
    """kernels(layout, config, dtype): one compiled float32 (or dtype) kernel of W per form, built on first use
    and shared by the module's tests (a fixed config: nothing is tuned or timed)."""
    built = {}

    def get(layout="kn", config=DEFAULT, dtype=torch.float32):
        key = (layout, config, dtype)
        if key not in built:
            built[key] = compile_spmm(W, N, dtype, layout, config=config)
        return built[key]

    return get


def names(layout: str) -> str:
    return "B" if layout == "kn" else "X"


# -- SpmmKernel: shapes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,shape,message", [
    ("kn", (K * N,), r"B has shape \(192,\), 1-D: expected 2-D K x N = 24 x 8 or 3-D \(batch, 24, 8\)"),
    ("kn", (1, 2, K, N), r"4-D: expected 2-D K x N = 24 x 8 or 3-D"),
    ("kn", (K + 1, N), r"B has shape \(25, 8\): 25 along K where W has K = 24 columns"),
    ("kn", (3, K, N + 1), r"9 along N where the kernel was compiled for N = 8.*compile a kernel for N = 9"),
    ("nk", (N, K + 1), r"X has shape \(8, 25\): 25 along K where W has K = 24 columns"),
    ("nk", (3, N - 1, K), r"7 along N where the kernel was compiled for N = 8"),
    ("nk", (K, N), r"X has shape \(24, 8\): 24 along N .*; 8 along K "),  # B's layout handed to an nk kernel
])
def test_wrong_shape_names_the_dimension(kernels, layout, shape, message):
    with pytest.raises(ValueError, match=message):
        kernels(layout)(torch.randn(shape, device="cuda"))


def test_an_empty_batch_is_still_checked(kernels):
    with pytest.raises(ValueError, match="25 along K"):
        kernels()(torch.empty(0, K + 1, N, device="cuda"))


# -- dtypes ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,message", [
    (torch.float64, r"B has dtype torch.float64, the kernel was compiled for torch.float32: convert with "
                    r"B.to\(torch.float32\) \(kernels take float32, float16 or bfloat16\)"),
    (torch.int32, r"B has dtype torch.int32, the kernel was compiled for torch.float32"),
    (torch.float16, r"B has dtype torch.float16, .*or compile a kernel for torch.float16"),
    (torch.bfloat16, r"B has dtype torch.bfloat16, .*or compile a kernel for torch.bfloat16"),
])
def test_wrong_dtype_names_both_dtypes(kernels, dtype, message):
    with pytest.raises(TypeError, match=message):
        kernels()(torch.ones(K, N, device="cuda", dtype=dtype))


def test_half_kernel_refuses_bfloat16_input_and_out(kernels):
    kernel = kernels(dtype=torch.float16)
    with pytest.raises(TypeError, match=r"B has dtype torch.bfloat16, the kernel was compiled for torch.float16"):
        kernel(torch.ones(K, N, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"out has dtype torch.bfloat16, the kernel was compiled for torch.float16: "
                                        r"allocate it as torch.float16"):
        kernel(torch.ones(K, N, device="cuda", dtype=torch.float16),
               out=torch.empty(M, N, device="cuda", dtype=torch.bfloat16))


# -- devices --------------------------------------------------------------------------------------------------
def test_cpu_input_and_out_name_the_devices(kernels):
    kernel = kernels()
    here = f"cuda:{kernel.device_index}"
    with pytest.raises(ValueError, match=re.escape(f"B is on cpu, the kernel was compiled for {here}: move it with "
                                                   f"B.to('{here}')")):
        kernel(torch.ones(K, N))
    with pytest.raises(ValueError, match=re.escape(f"out is on cpu, the kernel was compiled for {here}: allocate it "
                                                   "there")):
        kernel(torch.ones(K, N, device=here), out=torch.empty(M, N))


@needs_two_gpus
def test_tensors_on_another_gpu_are_refused(kernels):
    kernel = kernels()
    other = f"cuda:{(kernel.device_index + 1) % torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=f"B is on {other}, the kernel was compiled for cuda:{kernel.device_index}"):
        kernel(torch.ones(K, N, device=other))
    with pytest.raises(ValueError, match=f"out is on {other}"):
        kernel(torch.ones(K, N, device=f"cuda:{kernel.device_index}"), out=torch.empty(M, N, device=other))


@needs_two_gpus
def test_a_kernel_on_the_second_gpu_runs_there_and_refuses_the_first():
    with torch.cuda.device(1):
        kernel = compile_spmm(W, N, torch.float32, config=DEFAULT)
    assert kernel.device_index == 1
    b = torch.randn(K, N, device="cuda:1")
    with torch.cuda.device(0):  # torch's current device is not the kernel's
        got = kernel(b)
    torch.cuda.synchronize(1)
    assert got.device == torch.device("cuda:1")
    assert_close(got, b, "kn")
    with pytest.raises(ValueError, match="B is on cuda:0, the kernel was compiled for cuda:1"):
        kernel(torch.ones(K, N, device="cuda:0"))


def test_compile_spmm_refuses_a_device_that_does_not_exist():
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"device cuda:{count} does not exist: this machine has {count} CUDA device"):
        compile_spmm(W, N, device=f"cuda:{count}", config=DEFAULT)


# -- strides --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("view", ["transposed", "column_slice", "batch_slice"])
def test_non_contiguous_input_is_refused_and_the_fix_works(kernels, layout, view):
    kernel = kernels(layout)
    rows, cols = kernel.in_shape
    b = {"transposed": lambda: torch.randn(cols, rows, device="cuda").t(),
         "column_slice": lambda: torch.randn(rows, 2 * cols, device="cuda")[:, ::2],
         "batch_slice": lambda: torch.randn(4, rows, cols, device="cuda")[::2]}[view]()
    assert not b.is_contiguous()
    what = names(layout)
    with pytest.raises(ValueError, match=rf"{what} is not contiguous .*call {what}\.contiguous\(\) first"):
        kernel(b)
    assert_close(kernel(b.contiguous()), b, layout)


@pytest.mark.parametrize("case,make,error,message", [
    ("transposed", lambda: torch.empty(N, M, device="cuda").t(), ValueError,
     r"out is not contiguous .*pass a contiguous out"),
    ("row_slice", lambda: torch.empty(2 * M, N, device="cuda")[::2], ValueError, r"out is not contiguous"),
    ("float16", lambda: torch.empty(M, N, device="cuda", dtype=torch.float16), TypeError,
     r"out has dtype torch.float16, the kernel was compiled for torch.float32"),
    ("float64", lambda: torch.empty(M, N, device="cuda", dtype=torch.float64), TypeError,
     r"out has dtype torch.float64"),
    ("rows", lambda: torch.empty(M + 1, N, device="cuda"), ValueError, r"25 along M where W has M = 24 rows"),
    ("columns", lambda: torch.empty(M, N + 1, device="cuda"), ValueError,
     r"9 along N where the kernel was compiled for N = 8"),
    ("batched", lambda: torch.empty(1, M, N, device="cuda"), ValueError,
     r"out has shape \(1, 24, 8\), expected \(24, 8\) for B of shape \(24, 8\)"),
    ("cpu", lambda: torch.empty(M, N), ValueError, r"out is on cpu"),
])
def test_bad_out_is_refused_before_anything_is_written(kernels, case, make, error, message):
    out = make()
    out.fill_(7)
    with pytest.raises(error, match=message):
        kernels()(torch.randn(K, N, device="cuda"), out=out)
    torch.cuda.synchronize()
    assert (out == 7).all()


def test_out_of_another_batch_is_refused(kernels):
    with pytest.raises(ValueError, match=r"out has shape \(24, 8\), expected \(2, 24, 8\) for B of shape \(2, 24, 8\)"):
        kernels()(torch.randn(2, K, N, device="cuda"), out=torch.empty(M, N, device="cuda"))


def test_misaligned_out_is_written_through_an_aligned_copy():
    kernel = compile_spmm(W, N, torch.float32, config=TileConfig(2, 1, 4, 4))  # vec 4: 16-byte stores
    assert kernel.plan.output_alignment == 16
    storage = torch.full((M * N + 1,), NAN, device="cuda")
    out = storage[1:].view(M, N)  # 4 bytes past an aligned start
    b = torch.randn(K, N, device="cuda")
    assert kernel(b, out=out) is out
    assert_close(out, b, "kn")


# -- out sharing memory with the input --------------------------------------------------------------------------
@pytest.mark.parametrize("layout,config", FORMS, ids=FORM_IDS)
def test_out_sharing_memory_with_the_input_is_refused(kernels, layout, config):
    kernel = kernels(layout, config)
    what = names(layout)
    b = torch.randn(kernel.in_shape, device="cuda")
    before = b.clone()
    with pytest.raises(ValueError, match=f"out shares memory with {what} .*already overwritten"):
        kernel(b, out=b)
    buffer = torch.randn(2 * K * N, device="cuda")
    with pytest.raises(ValueError, match=f"out shares memory with {what}"):  # views of one buffer, one row apart
        kernel(buffer[:K * N].view(kernel.in_shape), out=buffer[N:K * N + N].view(kernel.out_shape))
    with pytest.raises(ValueError, match=f"out shares memory with {what}"):  # batched, the same tensor
        batched = torch.randn(2, *kernel.in_shape, device="cuda")
        kernel(batched, out=batched)
    torch.cuda.synchronize()
    assert torch.equal(b, before)  # nothing was launched
    first, second = buffer[:K * N].view(kernel.in_shape), buffer[K * N:].view(kernel.out_shape)
    assert kernel(first, out=second) is second  # neighbours in one buffer, not overlapping: fine
    assert_close(second, first, layout)


def test_spmm_refuses_out_aliasing_b():
    b = torch.randn(K, N, device="cuda")
    with pytest.raises(ValueError, match="out shares memory with B"):
        spmm(W, b, out=b)


# -- empty and over-large batches ------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,config", FORMS, ids=FORM_IDS)
def test_empty_batch_returns_an_empty_output_without_a_launch(kernels, layout, config, monkeypatch):
    kernel = kernels(layout, config)

    def no_launch(*args):
        raise AssertionError("an empty batch was launched")

    monkeypatch.setattr(kernel, "launch", no_launch)
    b = torch.empty(0, *kernel.in_shape, device="cuda")
    got = kernel(b)
    assert got.shape == (0, *kernel.out_shape) and got.dtype == torch.float32 and got.device == b.device
    out = torch.empty(0, *kernel.out_shape, device="cuda")
    assert kernel(b, out=out) is out
    torch.cuda.synchronize()


def test_spmm_of_an_empty_batch():
    got = spmm(W, torch.empty(0, K, N, device="cuda"))
    assert got.shape == (0, M, N) and got.is_cuda


def test_batch_past_the_grid_limit_is_refused_and_the_limit_runs(kernels):
    kernel = kernels()
    with pytest.raises(ValueError, match="B has a batch of 65536; one launch takes at most 65535"):
        kernel(torch.empty(65536, K, N, device="cuda"))
    b = torch.randn(65535, K, N, device="cuda")
    assert_close(kernel(b), b, "kn")


# -- NaN and inf ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", range(len(FORMS)), ids=FORM_IDS)
def test_non_finite_b_reaches_exactly_the_rows_using_its_column(kernels, form, dtype):
    layout, config = FORMS[form]
    kernel = kernels(layout, config, dtype)
    assert kernel.mapping == MAPPINGS[form]
    b = torch.from_numpy(poisoned_b()).to("cuda", dtype)  # kn terms: (2, K, N)
    operand = b if layout == "kn" else b.transpose(-1, -2).contiguous()
    out = torch.full((2, *kernel.out_shape), NAN, device="cuda", dtype=dtype)  # unwritten outputs would read NaN
    kernel(operand, out=out)
    torch.cuda.synchronize()
    got = (out if layout == "kn" else out.transpose(-1, -2)).double().cpu().numpy()
    ref = sparse_reference(W, b.double().cpu().numpy())
    assert not np.isnan(got[0]).any()  # batch 0: NaN only in the column W does not use
    assert np.isnan(got[1, :, 2]).sum() == np.count_nonzero(W.to_dense()[:, 3]) == 8  # rows using column 3
    assert got[0, 2, 4] == INF and got[0, 6, 4] == -INF
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    assert np.array_equal(np.isposinf(got), np.isposinf(ref)) and np.array_equal(np.isneginf(got), np.isneginf(ref))
    finite = np.isfinite(ref)
    tol = {torch.float32: 1e-5, torch.bfloat16: 6e-2}[dtype]
    assert np.allclose(got[finite], ref[finite], rtol=tol, atol=tol)


def test_spmm_propagates_nan_the_same_way():
    b = torch.from_numpy(poisoned_b()[1]).to("cuda", torch.float32)
    got = spmm(W, b).cpu().numpy()
    ref = sparse_reference(W, b.double().cpu().numpy())
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.isnan(got).sum() == 8


@pytest.mark.parametrize("config", [DEFAULT, CsrConfig(8, 4, 1)], ids=["row_groups", "small_n"])
def test_fused_relu_keeps_nan_like_torch_relu(config):
    kernel = compile_spmm(W, N, torch.float32, "kn", relu=True, config=config)
    b = torch.from_numpy(poisoned_b()[1]).to("cuda", torch.float32)
    got = kernel(b).cpu().numpy()
    ref = np.maximum(sparse_reference(W, b.double().cpu().numpy()), 0)  # NaN stays NaN, as in torch.relu
    assert np.array_equal(np.isnan(got), np.isnan(ref))


# -- compile_spmm arguments -------------------------------------------------------------------------------------
def test_compile_spmm_refuses_non_finite_weights_and_bias():
    dense = torch.from_numpy(W.to_dense()).cuda()
    dense[2, 3] = NAN
    with pytest.raises(SparseFormatError, match=r"weight\[2, 3\] = nan is not finite"):
        compile_spmm(dense, N, tune_budget=None)
    bias = np.zeros(M)
    bias[4] = INF
    with pytest.raises(ValueError, match=r"bias\[4\] = inf is not finite"):
        compile_spmm(W, N, bias=bias, tune_budget=None)
    with pytest.raises(ValueError, match="bias must have M = 24 entries"):
        compile_spmm(W, N, bias=torch.zeros(M - 1, device="cuda"), tune_budget=None)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, "float8"])
def test_compile_spmm_refuses_unsupported_dtypes(dtype):
    with pytest.raises(TypeError, match="is not supported; use torch.float32, torch.float16 or torch.bfloat16"):
        compile_spmm(W, N, dtype, config=DEFAULT)


# -- SparseLinear24 ---------------------------------------------------------------------------------------------
IN, OUT = 128, 64


def linear_24(policy: str) -> SparseLinear24:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(OUT, IN, generator=g) / IN ** 0.5
    linear = nn.Linear(IN, OUT, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        linear.weight.copy_((w * nm_mask(w)).to("cuda", torch.float16))
    return SparseLinear24.from_dense(linear, policy=policy)


@pytest.fixture(scope="module")
def layers():
    built = {}

    def get(policy: str = "sparse") -> SparseLinear24:
        if policy not in built:
            built[policy] = linear_24(policy)
        return built[policy]

    return get


def linear_reference(layer: SparseLinear24, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x.double(), layer.weight.double(), layer.bias.double())


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def calling(layer: SparseLinear24, x: torch.Tensor, grad: bool):
    """layer(x) on the 2:4 path (no_grad) or on the dense one (autograd wants a gradient of x)."""
    if not grad:
        with torch.no_grad():
            return layer(x)
    with torch.enable_grad():
        return layer(x.requires_grad_() if x.is_floating_point() else x)


@pytest.mark.parametrize("grad", [False, True], ids=["sparse_path", "dense_path"])
@pytest.mark.parametrize("shape", [(4, IN + 16), (2, 3, IN - 1)])
def test_linear24_wrong_feature_size(layers, grad, shape):
    x = torch.randn(shape, device="cuda").half()
    with pytest.raises(Sparse24Error, match=f"input has {shape[-1]} features in its last dimension; this layer "
                                            f"takes {IN}"):
        calling(layers(), x, grad)


@pytest.mark.parametrize("grad", [False, True], ids=["sparse_path", "dense_path"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_linear24_wrong_dtype(layers, grad, dtype):
    x = torch.randn(4, IN, device="cuda").to(dtype)
    with pytest.raises(Sparse24Error, match=re.escape(f"input dtype {dtype}, layer dtype torch.float16: cast the "
                                                      "input (x.to(torch.float16))")):
        calling(layers(), x, grad)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_linear24_cpu_input(layers, grad):
    layer = layers()
    with pytest.raises(Sparse24Error, match=f"input on cpu, layer on {layer.weight.device}: move one of them"):
        calling(layer, torch.randn(4, IN).half(), grad)


@needs_two_gpus
def test_linear24_input_on_another_gpu(layers):
    layer = layers()
    other = f"cuda:{(layer.weight.device.index + 1) % torch.cuda.device_count()}"
    with pytest.raises(Sparse24Error, match=f"input on {other}, layer on {layer.weight.device}"):
        calling(layer, torch.randn(4, IN, device=other).half(), grad=False)


@pytest.mark.parametrize("view", ["transposed", "column_slice", "permuted_3d", "misaligned"])
def test_linear24_non_contiguous_input_is_right(layers, view):
    x = {"transposed": lambda: torch.randn(IN, 5, device="cuda").half().t(),
         "column_slice": lambda: torch.randn(5, 2 * IN, device="cuda").half()[:, ::2],
         "permuted_3d": lambda: torch.randn(IN, 3, 4, device="cuda").half().permute(1, 2, 0),
         "misaligned": lambda: torch.randn(5 * IN + 1, device="cuda").half()[1:].view(5, IN)}[view]()
    assert not x.is_contiguous() or x.data_ptr() % 16
    layer = layers()
    with torch.no_grad():
        got = layer(x)
    assert got.shape == (*x.shape[:-1], OUT)
    assert rel_err(got, linear_reference(layer, x)) <= 5e-3


def test_linear24_no_tokens_returns_an_empty_output_and_decides_nothing():
    layer = linear_24("sparse")
    with torch.no_grad():
        flat = layer(torch.empty(0, IN, device="cuda", dtype=torch.float16))
        batched = layer(torch.empty(3, 0, IN, device="cuda", dtype=torch.float16))
    assert flat.shape == (0, OUT) and batched.shape == (3, 0, OUT)
    assert flat.dtype == torch.float16 and flat.device == layer.weight.device
    assert layer.decisions == [] and layer._runtime is None  # no plan built, nothing measured or launched


@pytest.mark.parametrize("policy", ["sparse", "dense", "measure"])
def test_linear24_nan_and_inf_input_propagate(layers, policy):
    """A NaN at x[t, k] makes y[t, i] NaN for every i with W[i, k] != 0 on every path; an inf makes them
    +-inf, except on cuSPARSELt's 2:4 kernels, which give NaN for some of them (diagnosed on the H200 with
    cuSPARSELt 0.8.0: the same outputs with the output and the padded rows zeroed or NaN-filled, at every
    padded width 8-32 and in bf16; docs/history.md): there they must be non-finite,
    and +-inf with the weight's sign where they are inf. Dense (cuBLAS) also poisons y[t, i] where
    W[i, k] == 0 (0 * inf); the 2:4 paths need not."""
    layer = layers(policy)
    x = torch.randn(6, IN, device="cuda").half()
    x[2, 5] = NAN
    x[4, 17] = INF
    with torch.no_grad():
        y = layer(x)
    torch.cuda.synchronize()
    weight = layer.weight.detach()
    uses_5, uses_17 = weight[:, 5] != 0, weight[:, 17] != 0
    assert 0 < uses_5.sum() < OUT and 0 < uses_17.sum() < OUT
    assert torch.isnan(y[2, uses_5]).all()
    cusparselt = any(d.path == "2:4" and d.mode in ("eager", "any") for d in layer.decisions if d.n == 6)
    hit = y[4, uses_17]
    if cusparselt:
        assert (~torch.isfinite(hit)).all()
        inf = torch.isinf(hit)
        assert torch.equal(torch.sign(hit[inf]), torch.sign(weight[uses_17, 17][inf]))
    else:
        assert torch.isinf(hit).all()
        assert torch.equal(torch.sign(hit), torch.sign(weight[uses_17, 17]))
    clean = [0, 1, 3, 5]
    assert torch.isfinite(y[clean]).all()
    assert rel_err(y[clean], linear_reference(layer, x[clean])) <= 5e-3
    if policy == "dense":
        assert torch.isnan(y[2]).all() and torch.isnan(y[4, ~uses_17]).all()
