"""SpmmKernel.__call__ without a GPU: its checks and glue run over a kernel whose device is the CPU and whose
launch only records its arguments (tests/gpu/test_errors_gpu.py runs the same inputs on the device)."""
import sys
import types

import numpy as np
import pytest
import torch

from sparseforge import SparseMatrix
from sparseforge.plan import TileConfig, make_plan
from sparseforge.mappings.csr.plan import CsrColumnsConfig
from sparseforge.runtime.kernel import SpmmKernel

M = K = 6  # square: an out can have B's shape, so it can be B
N = 4


def weight() -> SparseMatrix:
    dense = np.zeros((M, K), np.float32)
    dense[[0, 1, 2, 4, 5], [1, 3, 0, 5, 2]] = [1.0, -2.0, 0.5, 3.0, 1.5]
    return SparseMatrix.from_dense(dense)


def cpu_kernel(layout="kn", config=TileConfig(2, 1, 1, 4), dtype="float32", device="cpu") -> SpmmKernel:
    """An SpmmKernel for W (M x K) and N on `device` that loads nothing; .launches records each launch."""
    kernel = SpmmKernel.__new__(SpmmKernel)
    plan = make_plan(weight(), N, dtype, layout, config)
    kernel._launch, kernel._full, kernel._make_full, kernel.device_index = plan, plan, None, 0
    kernel._dtype, kernel._device = getattr(torch, dtype), torch.device(device)
    kernel._partial, kernel._data = None, None
    kernel.launches = []
    kernel.launch = lambda b_ptr, c_ptr, batch, stream, *extra: kernel.launches.append((b_ptr, c_ptr, batch, *extra))
    return kernel


def residual_kernel(layout="kn") -> SpmmKernel:
    """The same CPU kernel over a CSR plan compiled with a residual."""
    from sparseforge.mappings.csr.plan import CsrConfig, make_csr_plan

    kernel = cpu_kernel(layout)
    plan = make_csr_plan(weight(), N, "float32", layout, CsrConfig(8, 4, 1), residual=True)
    kernel._launch, kernel._full = plan, plan
    return kernel


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_a_residual_is_required_checked_and_passed_to_the_launch(layout):
    kernel = residual_kernel(layout)
    b = torch.ones(KN if layout == "kn" else (N, K))
    out_shape = kernel.out_shape
    with pytest.raises(ValueError, match="compiled with residual=True"):
        kernel(b)
    with pytest.raises(ValueError, match="residual has shape"):
        kernel(b, residual=torch.zeros(out_shape[::-1]))
    with pytest.raises(ValueError, match="residual has shape"):
        kernel(b, residual=torch.zeros(2, *out_shape))  # batched residual for an unbatched B
    r = torch.zeros(out_shape)
    out = kernel(b, residual=r)
    assert kernel.launches[-1][3] == r.data_ptr() and out.data_ptr() != r.data_ptr()
    kernel(b, out=r, residual=r)  # in place: allowed
    big = torch.zeros(2 * r.numel())
    with pytest.raises(ValueError, match="partly overlaps residual"):
        kernel(b, out=big[1:1 + r.numel()].view(out_shape), residual=big[:r.numel()].view(out_shape))
    plain = cpu_kernel(layout)
    with pytest.raises(ValueError, match="compiled without a residual"):
        plain(b, residual=r)


@pytest.fixture(autouse=True)
def no_cuda_stream(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))


KN = (K, N)


@pytest.mark.parametrize("layout,make,error,match", [
    ("kn", lambda: np.ones(KN, np.float32), TypeError, "B must be a torch.Tensor, got ndarray"),
    ("kn", lambda: torch.ones(K * N), ValueError, r"B has shape \(24,\), 1-D: expected 2-D K x N = 6 x 4 or 3-D"),
    ("kn", lambda: torch.ones(1, 1, K, N), ValueError, r"4-D: expected 2-D K x N = 6 x 4 or 3-D \(batch, 6, 4\)"),
    ("kn", lambda: torch.ones(K + 1, N), ValueError, r"7 along K where W has K = 6 columns"),
    ("kn", lambda: torch.ones(2, K, N + 1), ValueError,
     r"5 along N where the kernel was compiled for N = 4.*compile a kernel for N = 5"),
    ("nk", lambda: torch.ones(N, K + 1), ValueError, r"X has shape \(4, 7\): 7 along K where W has K = 6 columns"),
    ("nk", lambda: torch.ones(N + 1, K), ValueError, r"5 along N where the kernel was compiled for N = 4"),
    ("nk", lambda: torch.ones(N + 1, K + 1), ValueError, r"5 along N .*; 7 along K "),
    ("kn", lambda: torch.ones(KN, dtype=torch.float64), TypeError,
     r"B has dtype torch.float64, the kernel was compiled for torch.float32: convert with B.to\(torch.float32\) "
     r"\(kernels take float32, float16 or bfloat16\)"),
    ("kn", lambda: torch.ones(KN, dtype=torch.int32), TypeError, r"dtype torch.int32.*kernels take"),
    ("kn", lambda: torch.ones(KN, dtype=torch.float16), TypeError,
     r"or compile a kernel for torch.float16"),
    ("kn", lambda: torch.ones(N, K).t(), ValueError, r"B is not contiguous .*strides \(1, 6\).*B.contiguous\(\)"),
    ("kn", lambda: torch.ones(K, 2 * N)[:, ::2], ValueError, r"B is not contiguous"),
    ("kn", lambda: torch.ones(4, K, N)[::2], ValueError, r"B is not contiguous"),
    ("nk", lambda: torch.ones(K, N).t(), ValueError, r"X is not contiguous.*X.contiguous\(\)"),
])
def test_input_problems_are_named(layout, make, error, match):
    kernel = cpu_kernel(layout)
    with pytest.raises(error, match=match):
        kernel(make())
    assert kernel.launches == []


def test_an_unsupported_dtype_is_not_offered_as_a_kernel_dtype():
    with pytest.raises(TypeError) as info:
        cpu_kernel()(torch.ones(KN, dtype=torch.float64))
    assert "compile a kernel for" not in str(info.value)


def test_device_is_named_with_the_move():
    kernel = cpu_kernel(device="cuda:0")  # compares devices only: no CUDA call
    with pytest.raises(ValueError, match=r"B is on cpu, the kernel was compiled for cuda:0: move it with "
                                         r"B.to\('cuda:0'\)"):
        kernel(torch.ones(KN))
    meta = cpu_kernel(device="meta")
    with pytest.raises(ValueError, match=r"out is on cpu, the kernel was compiled for meta: allocate it there"):
        meta(torch.ones(KN, device="meta"), out=torch.ones(M, N))


@pytest.mark.parametrize("make,error,match", [
    (lambda: [[0.0] * N] * M, TypeError, "out must be a torch.Tensor, got list"),
    (lambda: torch.empty(M, N, dtype=torch.float16), TypeError,
     r"out has dtype torch.float16, the kernel was compiled for torch.float32: allocate it as torch.float32"),
    (lambda: torch.empty(M + 1, N), ValueError, r"out has shape \(7, 4\): 7 along M where W has M = 6 rows"),
    (lambda: torch.empty(M, N + 1), ValueError, r"5 along N where the kernel was compiled for N = 4"),
    (lambda: torch.empty(1, M, N), ValueError, r"out has shape \(1, 6, 4\), expected \(6, 4\) for B of shape \(6, 4\)"),
    (lambda: torch.empty(N, M).t(), ValueError, r"out is not contiguous .*pass a contiguous out"),
])
def test_out_problems_are_named(make, error, match):
    kernel = cpu_kernel()
    with pytest.raises(error, match=match):
        kernel(torch.ones(KN), out=make())
    assert kernel.launches == []


def test_out_of_another_batch_is_refused():
    with pytest.raises(ValueError, match=r"expected \(2, 6, 4\) for B of shape \(2, 6, 4\) \(the same batch\)"):
        cpu_kernel()(torch.ones(2, K, N), out=torch.empty(3, M, N))


CONFIGS = [("kn", TileConfig(2, 1, 1, 4)), ("nk", TileConfig(2, 1, 1, 4)),
           ("nk", TileConfig(2, 1, 1, 4, transpose_x=True))]


@pytest.mark.parametrize("layout,config", CONFIGS, ids=["kn", "nk_staged", "nk_transposed"])
def test_out_sharing_memory_with_the_input_is_refused(layout, config):
    kernel = cpu_kernel(layout, config)
    what = "B" if layout == "kn" else "X"
    b = torch.ones(kernel.in_shape)
    with pytest.raises(ValueError, match=f"out shares memory with {what} .*already overwritten"):
        kernel(b, out=b)
    buffer = torch.ones(2 * K * N)
    with pytest.raises(ValueError, match="shares memory"):  # views of one buffer, overlapping by one row
        kernel(buffer[:K * N].view(kernel.in_shape), out=buffer[K * N - N:2 * K * N - N].view(kernel.out_shape))
    with pytest.raises(ValueError, match="shares memory"):  # out's last element is B's first
        kernel(buffer[K * N - 1:2 * K * N - 1].view(kernel.in_shape), out=buffer[:K * N].view(kernel.out_shape))
    with pytest.raises(ValueError, match="shares memory"):  # batched
        batched = torch.ones(2, *kernel.in_shape)
        kernel(batched, out=batched)
    assert kernel.launches == []
    # neighbours that touch without overlapping are fine
    b, out = buffer[:K * N].view(kernel.in_shape), buffer[K * N:].view(kernel.out_shape)
    assert kernel(b, out=out) is out and len(kernel.launches) == 1
    assert kernel.launches[0][1] == out.data_ptr()


@pytest.mark.parametrize("layout,config", CONFIGS, ids=["kn", "nk_staged", "nk_transposed"])
def test_empty_batch_returns_an_empty_output_without_a_launch(layout, config):
    kernel = cpu_kernel(layout, config)
    got = kernel(torch.ones(0, *kernel.in_shape))
    assert got.shape == (0, *kernel.out_shape) and got.dtype == torch.float32
    out = torch.empty(0, *kernel.out_shape)
    assert kernel(torch.ones(0, *kernel.in_shape), out=out) is out
    assert kernel.launches == []
    with pytest.raises(ValueError, match="along K"):  # an empty batch is still checked
        kernel(torch.ones(0, *(d + 1 if d == K else d for d in kernel.in_shape)))
    with pytest.raises(ValueError, match=r"out has shape \(1, "):
        kernel(torch.ones(0, *kernel.in_shape), out=torch.empty(1, *kernel.out_shape))


def test_batch_beyond_the_grid_limit_is_refused():
    kernel = cpu_kernel()
    with pytest.raises(ValueError, match="batch of 65536; one launch takes at most 65535"):
        kernel(torch.empty(65536, K, N))
    assert kernel.launches == []
    kernel(torch.empty(65535, K, N))
    assert kernel.launches[0][2] == 65535


def test_a_kernel_whose_workspace_holds_one_batch_entry_refuses_a_batch():
    """bitmap-tc with k_split: its blocks meet in a workspace of one batch entry, so a batch is refused with the
    fix, by the checked call and by the raw launch alike; one entry goes through."""
    from sparseforge.mappings.bitmap_tc.plan import BitmapTcConfig, make_bitmap_tc_plan

    kernel = cpu_kernel()
    kernel.plan = make_bitmap_tc_plan(weight(), N, "float16", "kn", BitmapTcConfig(k_split=2))
    kernel._dtype = torch.float16
    assert kernel.max_batch == 1
    with pytest.raises(ValueError, match="workspace for 1 batch entry at a time: call it once per entry"):
        kernel(torch.ones(2, K, N, dtype=torch.float16))
    assert kernel.launches == []
    kernel(torch.ones(1, K, N, dtype=torch.float16))
    assert kernel.launches[0][2] == 1
    del kernel.launch  # the raw launch (graph capture, ops) checks it too, before anything reaches the driver
    with pytest.raises(ValueError, match="a launch of 3 batch entries; .* takes 1 at a time"):
        kernel.launch(0, 0, 3, 0)


def test_a_valid_call_launches_once_over_the_batch():
    kernel = cpu_kernel()
    b = torch.ones(3, K, N)
    out = kernel(b)
    assert out.shape == (3, M, N)
    assert kernel.launches == [(b.data_ptr(), out.data_ptr(), 3)]
    misaligned = torch.ones(K * N + 1)[1:].view(K, N)  # 4 bytes past an aligned start
    kernel(misaligned)
    b_ptr = kernel.launches[-1][0]
    assert b_ptr != misaligned.data_ptr() and b_ptr % 16 == 0  # read through an aligned copy
    transposing = cpu_kernel("nk", TileConfig(2, 1, 1, 4, transpose_x=True))
    x = torch.ones(N, K)
    transposing(x)
    assert transposing.launches[0][0] != x.data_ptr()  # X^T, a copy


def test_misaligned_out_is_written_through_an_aligned_copy():
    kernel = cpu_kernel(config=TileConfig(2, 1, 4, 4))  # vec 4: 16-byte stores
    assert kernel.plan.output_alignment == 16
    out = torch.zeros(M * N + 1)[1:].view(M, N)
    assert kernel(torch.ones(KN), out=out) is out
    c_ptr = kernel.launches[0][1]
    assert c_ptr != out.data_ptr() and c_ptr % 16 == 0


def test_raw_launches_pass_input_output_weight_arrays_then_residual():
    """SpmmKernel.launch and ConvKernel.launch over W as data: the driver gets (input, output, W's arrays,
    residual) as pointers, with the plan's grid (batch as z) and threads."""
    from sparseforge.plan.conv import ConvGeometry, make_conv_plan
    from sparseforge.mappings.csr.plan import CsrColumnsConfig, CsrConfig, make_csr_plan
    from sparseforge.runtime.conv import ConvKernel

    calls = []

    class Recorder:  # driver.PackedLaunch's interface: shape (block, params, shared), called with grid, stream, values
        def __init__(self, block, params, shared_bytes=0):
            self.shape = (block, params, shared_bytes)

        def __call__(self, grid, stream, *values):
            calls.append((grid, self.shape[0], stream, values, self.shape[1]))

    loaded = types.SimpleNamespace(packed=Recorder)
    spmm = SpmmKernel.__new__(SpmmKernel)
    plan = make_csr_plan(weight(), N, "float32", "kn", CsrConfig(8, 4, 1), residual=True)
    spmm._launch, spmm._loaded, spmm._data = plan, loaded, (11, 12, 13, 14)
    spmm.launch(1, 2, 3, 99, 7)
    assert calls[-1] == ((*plan.grid, 3), plan.threads, 99, (1, 2, 11, 12, 13, 14, 7), 7)
    assert spmm._packed.shape[2] == 0  # no dynamic shared memory

    # csr-staged: the launch gives each block its copy of B as dynamic shared memory, the grid its
    # persistent blocks
    staged = make_csr_plan(weight(), N, "float16", "kn", CsrConfig(8, 16, 4, stage_b=True, ctas=3))
    spmm._launch, spmm._packed = staged, None
    spmm.launch(1, 2, 1, 99)
    assert calls[-1][0] == (1, min(3, staged.grid[1]), 1)
    assert spmm._packed.shape == (staged.threads, 6, staged.dynamic_shared_bytes)
    assert staged.dynamic_shared_bytes == -(-staged.K * N * 2 // 16) * 16

    g = ConvGeometry.of((1, 2, 5, 5), 3, 3, padding=1)
    conv_plan = make_conv_plan(SparseMatrix.from_dense(np.ones(g.weight_shape, np.float32)), g,
                               config=CsrColumnsConfig(1, 1, 4))
    conv = ConvKernel.__new__(ConvKernel)
    conv.plan, conv._loaded, conv._data = conv_plan, loaded, (21, 22, 23, 24)
    conv.launch(5, 6, 2, 98)
    assert calls[-1] == ((*conv_plan.grid, 2), conv_plan.threads, 98, (5, 6, 21, 22, 23, 24), 6)


def cpu_conv_kernel(plan):
    """A ConvKernel over `plan` on the CPU that loads nothing; .launches records each raw launch."""
    from sparseforge.runtime.conv import ConvKernel

    conv = ConvKernel.__new__(ConvKernel)
    conv.plan, conv._data, conv.device_index = plan, None, 0
    conv._dtype, conv._device = getattr(torch, plan.dtype), torch.device("cpu")
    conv._partial = torch.tensor(plan.partial_rows, dtype=torch.long) if plan.partial_rows else None
    conv._init_call_state()  # shapes, the bordered buffer, the lean call's state: as the constructor makes them
    conv.launches = []
    conv.launch = lambda *args: conv.launches.append(args)
    return conv


def test_generated_conv_calls_copy_x_inside_a_kept_zero_border_and_launch_without_weight_arrays(monkeypatch):
    """The generated mapping: x lands inside the kernel's persistent zero-bordered buffer (the border never
    written), the launch reads that buffer; split output channels are zeroed first; a larger batch than
    compiled reallocates the buffer; the raw launch passes (input, output, residual), no W arrays."""
    from sparseforge.plan.conv import ConvGeometry, make_conv_plan

    g = ConvGeometry.of((1, 2, 5, 4), 3, 3, padding=(1, 2))
    w = SparseMatrix.from_dense(np.ones(g.weight_shape, np.float32))
    conv = cpu_conv_kernel(make_conv_plan(w, g, config=TileConfig(1, 1, 1, segment_nnz=6)))
    assert conv.plan.partial_rows == (0, 1, 2)
    first = conv._bordered
    x = torch.randn(1, 2, 5, 4)
    out = conv(x, out=torch.full((1, 3, 5, 6), float("nan")))
    x_ptr, y_ptr, batch, _ = conv.launches[-1]
    assert x_ptr == first.data_ptr() and y_ptr == out.data_ptr() and batch == 1
    assert first.shape == (1, 1, 2 * 7 * 8)  # [batch, shifts, plane]: one copy at vector width 1
    image = first.view(1, 2, 7, 8)
    border = image.clone()
    border[:, :, 1:6, 2:6] = 0
    assert torch.equal(image[:, :, 1:6, 2:6], x) and (border == 0).all() and (out == 0).all()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    conv(torch.randn(3, 2, 5, 4))
    assert conv._bordered.shape == (3, 1, 112) and conv.launches[-1][2] == 3
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="before capturing"):  # no allocation may outlive a graph capture
        conv(torch.randn(4, 2, 5, 4))

    # pairs of pixels a lane (3x3, OW = 8, Wp = 10): copy 1 is copy 0 shifted by one element
    pairs = ConvGeometry.of((2, 2, 6, 8), 3, 3, padding=1)
    conv = cpu_conv_kernel(make_conv_plan(SparseMatrix.from_dense(np.ones(pairs.weight_shape, np.float32)), pairs,
                                          config=TileConfig(rows_per_group=1, warps_per_block=1, vec=2)))
    x = torch.randn(2, 2, 6, 8)
    conv(x)
    buffer = conv._bordered
    assert buffer.shape == (2, 2, 2 * 8 * 10) and torch.equal(buffer[:, 0].view(2, 2, 8, 10)[:, :, 1:7, 1:9], x)
    assert torch.equal(buffer[:, 1, :-1], buffer[:, 0, 1:])

    loaded_calls = []
    residual_plan = make_conv_plan(w, g, config=TileConfig(2, 1, 1), residual=True)
    conv = cpu_conv_kernel(residual_plan)
    del conv.launch  # the real raw launch, over a recording driver

    class Recorder:  # driver.PackedLaunch's interface
        def __init__(self, block, params, shared_bytes=0):
            self.shape = (block, params, shared_bytes)

        def __call__(self, grid, stream, *values):
            loaded_calls.append((grid, self.shape[0], stream, values, self.shape[1]))

    conv._loaded = types.SimpleNamespace(packed=Recorder)
    conv.launch(5, 6, 2, 98, 7)
    assert loaded_calls[-1] == ((*residual_plan.grid, 2), residual_plan.threads, 98, (5, 6, 7), 3)


def test_a_packed_launch_hands_the_driver_pointers_to_each_value(monkeypatch):
    """driver.PackedLaunch builds its parameter block once: cuLaunchKernel gets an array of pointers, pointer i
    at value i, and the values of this call (the leading ones set by the call, the rest as fixed)."""
    import ctypes

    from sparseforge.runtime import launch as driver

    seen = []

    def fake_launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        values = [ctypes.cast(pointers[i], ctypes.POINTER(ctypes.c_uint64))[0] for i in range(4)]
        seen.append((function.value, (gx, gy, gz), (bx, by, bz), shared, stream, values, extra))
        return 0

    monkeypatch.setattr(driver, "_raw_launch", lambda: fake_launch)
    packed = driver.PackedLaunch(0x1234, 128, 4)
    packed.fix(2, 0xAAAA)
    packed.fix(3, 0xBBBB)
    packed((5, 6, 7), 99, 0x1000, 0x2000)
    packed((1, 1, 2), 98, 0x3000, 0x4000, 0xCCCC)
    assert seen[0] == (0x1234, (5, 6, 7), (128, 1, 1), 0, 99, [0x1000, 0x2000, 0xAAAA, 0xBBBB], None)
    assert seen[1][5] == [0x3000, 0x4000, 0xCCCC, 0xBBBB] and seen[1][4] == 98
    assert packed.shape == (128, 4, 0)
    driver.PackedLaunch(0x1234, 256, 4, 131072)((1, 132, 1), 97, 1, 2)  # dynamic shared memory reaches the driver
    assert seen[-1][2:5] == ((256, 1, 1), 131072, 97)
    monkeypatch.setattr(driver, "_raw_launch", lambda: lambda *args: 1)  # CUDA_ERROR_INVALID_VALUE
    failures = []
    fake_driver = types.SimpleNamespace(check=failures.append, CudaError=RuntimeError,
                                        cu=types.SimpleNamespace(CUresult=lambda s: ("status", s)))
    monkeypatch.setitem(sys.modules, "sparseforge.runtime.driver", fake_driver)
    packed((1, 1, 1), 0, 1, 2)
    assert failures == [("status", 1)]  # a failed launch goes to driver.check, which raises CudaError by name

    def unnamed(status):
        raise ValueError(f"{status} is not a valid CUresult")

    fake_driver.cu.CUresult = unnamed  # a status this cuda-python has no name for: still an error, with its number
    with pytest.raises(RuntimeError, match="CUDA driver error 1 from cuLaunchKernel"):
        packed((1, 1, 1), 0, 1, 2)


def _nhwc_conv(config, residual=False, **geometry):
    from sparseforge.plan.conv import ConvGeometry, make_conv_plan

    g = ConvGeometry.of(geometry.get("shape", (2, 3, 5, 4)), geometry.get("cout", 4), 3, padding=1,
                        layout=geometry.get("layout", "nhwc"))
    w = SparseMatrix.from_dense(np.ones(g.weight_shape, np.float32))
    return cpu_conv_kernel(make_conv_plan(w, g, config=config, residual=residual))


@pytest.mark.parametrize("padding, layout, one_copy_call", [(1, "nchw", True), (1, "nhwc", True),
                                                          (0, "nchw", False), ((0, 1), "nchw", True)])
def test_shifted_copies_are_filled_in_one_copy_where_the_padding_leaves_room(padding, layout, one_copy_call):
    """Vector pairs (vec 2) read two copies of the bordered image, copy 1 being copy 0 shifted by one element:
    with the first interior element at least one element in, one copy_ writes both copies' interiors
    (every copy's view at once); without padding, copy 1 is filled from copy 0 after. Either way the buffer
    is the bordered image and its shift, border zero."""
    from sparseforge.plan.conv import ConvGeometry, make_conv_plan

    g = ConvGeometry.of((2, 3, 6, 8), 4, 3, padding=padding, layout=layout)
    plan = make_conv_plan(SparseMatrix.from_dense(np.ones(g.weight_shape, np.float32)), g,
                          config=TileConfig(rows_per_group=1, warps_per_block=1, vec=2))
    assert plan.shifts == 2
    conv = cpu_conv_kernel(plan)
    x = torch.randn(2, 3, 6, 8)
    x = x.contiguous(memory_format=torch.channels_last) if layout == "nhwc" else x
    conv(x)
    _, interior, shifted = conv._views_for(2)
    assert (interior.dim() == 5 and shifted is None) == one_copy_call
    (ph, pw) = g.padding
    xp = torch.nn.functional.pad(x, (pw, pw, ph, ph)).reshape(2, -1)
    buffer = conv._bordered
    assert torch.equal(buffer[:, 0], xp) and torch.equal(buffer[:, 1, :-1], xp[:, 1:])
    conv(x * 2)  # a second call rewrites the interiors, the border stays zero
    assert torch.equal(buffer[:, 0], 2 * xp) and torch.equal(buffer[:, 1, :-1], 2 * xp[:, 1:])


def test_generated_conv_without_padding_reads_an_aligned_x_in_place_and_copies_otherwise(monkeypatch):
    """No padding, NCHW, one copy: the bordered image is x byte for byte, so the launch reads x itself (no copy
    launch); a misaligned x (a view into a larger buffer) still goes through the 16-byte aligned buffer, and
    padding, a vector layout needing shifted copies, or nhwc keep the copy."""
    from sparseforge.plan.conv import ConvGeometry, make_conv_plan

    g = ConvGeometry.of((1, 4, 6, 8), 5, 1, stride=2)  # a ResNet projection: 1x1, stride 2, no padding
    w = SparseMatrix.from_dense(np.ones(g.weight_shape, np.float32))
    conv = cpu_conv_kernel(make_conv_plan(w, g, config=TileConfig(1, 1, 1)))
    assert conv.reads_x_in_place
    x = torch.randn(2, 4, 6, 8)
    conv(x)
    assert conv.launches[-1][0] == x.data_ptr() and (conv._bordered == 0).all()  # nothing copied
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # the buffer grows to 2
    base = torch.randn(2 * 4 * 6 * 8 + 1)
    shifted = base[1:].view(2, 4, 6, 8)  # 4 bytes past an aligned start
    conv(shifted)
    x_ptr = conv.launches[-1][0]
    assert x_ptr == conv._bordered.data_ptr() and torch.equal(conv._bordered[:2].view(2, 4, 6, 8), shifted)

    padded = ConvGeometry.of((1, 4, 6, 8), 5, 3, padding=1)
    assert not cpu_conv_kernel(make_conv_plan(SparseMatrix.from_dense(np.ones(padded.weight_shape, np.float32)),
                                              padded, config=TileConfig(1, 1, 1))).reads_x_in_place
    nhwc = ConvGeometry.of((1, 4, 6, 8), 5, 1, layout="nhwc")
    assert not cpu_conv_kernel(make_conv_plan(w, nhwc, config=TileConfig(1, 1, 1))).reads_x_in_place


@pytest.mark.parametrize("config", [TileConfig(2, 1, 1), TileConfig(2, 1, 1, segment_nnz=6)], ids=["whole", "split"])
def test_nhwc_generated_conv_transposes_x_into_the_bordered_buffer_and_writes_a_channels_last_output(config):
    """A channels_last x lands in the NCHW bordered buffer (torch's copy_ transposes); the output is made
    channels_last; a split kernel's channels are zeroed in it (index_fill_ along the logical channel
    dimension, strided in memory)."""
    conv = _nhwc_conv(config)
    assert conv.layout == "nhwc"
    x = torch.randn(2, 3, 5, 4).contiguous(memory_format=torch.channels_last)
    out = conv(x)
    assert out.shape == (2, 4, 5, 4) and out.is_contiguous(memory_format=torch.channels_last)
    assert not out.is_contiguous()
    image = conv._bordered.view(2, 3, 7, 6)
    assert torch.equal(image[:, :, 1:6, 1:5], x) and conv.launches[-1][1] == out.data_ptr()
    if conv.plan.partial_rows:
        given = torch.full((2, 4, 5, 4), float("nan")).contiguous(memory_format=torch.channels_last)
        conv(x, out=given)
        rows = list(conv.plan.partial_rows)
        assert (given[:, rows] == 0).all() and given[:, [r for r in range(4) if r not in rows]].isnan().all()


def test_nhwc_conv_refuses_nchw_and_3d_tensors_naming_the_fix_and_nchw_refuses_channels_last():
    nhwc = _nhwc_conv(CsrColumnsConfig(1, 1, 4), residual=True)
    x = torch.randn(2, 3, 5, 4)
    last = x.contiguous(memory_format=torch.channels_last)
    r = torch.randn(2, 4, 5, 4).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=r"x is NCHW-contiguous; this kernel was compiled with layout='nhwc': pass "
                                         r"x.contiguous\(memory_format=torch.channels_last\) or compile with "
                                         r"layout='nchw'"):
        nhwc(x, residual=r)
    with pytest.raises(ValueError, match=r"residual is NCHW-contiguous.*channels_last"):
        nhwc(last, residual=r.contiguous())
    with pytest.raises(ValueError, match=r"out is NCHW-contiguous.*allocate it with memory_format=torch.channels_last"):
        nhwc(last, out=torch.empty(2, 4, 5, 4), residual=r)
    with pytest.raises(ValueError, match=r"x is 3-D \(3, 5, 4\).*layout='nhwc'.*unsqueeze\(0\)"):
        nhwc(x[0], residual=r[0])
    with pytest.raises(ValueError, match="not channels_last-contiguous"):
        nhwc(last.transpose(2, 3).contiguous().transpose(2, 3)[:, :, :, :], residual=r)  # NCHW with H, W swapped
    with pytest.raises(ValueError, match=r"expected \(batch, 3, 5, 4\) \(channels_last\)"):
        nhwc(torch.randn(2, 3, 5, 5).contiguous(memory_format=torch.channels_last), residual=r)
    nhwc(last, residual=r)
    assert nhwc.launches[-1][0] == last.data_ptr()  # csr-columns reads x where it lies
    nchw = _nhwc_conv(CsrColumnsConfig(1, 1, 4), layout="nchw")
    with pytest.raises(ValueError, match=r"x is channels_last; this kernel was compiled with layout='nchw': pass "
                                         r"x.contiguous\(\) or compile with layout='nhwc'"):
        nchw(last)
    with pytest.raises(ValueError, match=r"out is channels_last.*allocate it NCHW-contiguous"):
        nchw(x, out=torch.empty(2, 4, 5, 4).contiguous(memory_format=torch.channels_last))


def test_one_channel_or_one_pixel_tensors_are_both_layouts_and_either_kernel_takes_them():
    """C == 1 (or H == W == 1): NCHW- and channels_last-contiguous at once, one memory order."""
    for layout in ("nchw", "nhwc"):
        conv = _nhwc_conv(CsrColumnsConfig(1, 1, 4), shape=(2, 1, 5, 4), cout=1, layout=layout)
        for x in (torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4).contiguous(memory_format=torch.channels_last)):
            out = conv(x)
            assert out.is_contiguous() and out.is_contiguous(memory_format=torch.channels_last)


def test_a_bordered_buffer_made_under_inference_mode_takes_later_calls_outside_it(monkeypatch):
    """The generated mapping's bordered buffer is a normal tensor even when the kernel is built inside
    torch.inference_mode (a SparseConv2d's first call there): a later call outside it writes into it."""
    from sparseforge.plan.conv import ConvGeometry, make_conv_plan

    g = ConvGeometry.of((1, 2, 5, 4), 3, 3, padding=1)
    w = SparseMatrix.from_dense(np.ones(g.weight_shape, np.float32))
    with torch.inference_mode():
        conv = cpu_conv_kernel(make_conv_plan(w, g, config=TileConfig(1, 1, 1)))
    assert not conv._bordered.is_inference()
    with torch.no_grad():
        conv(torch.randn(1, 2, 5, 4))
    conv(torch.randn(1, 2, 5, 4))
    assert len(conv.launches) == 2
    bigger = conv._bordered
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    conv(torch.randn(3, 2, 5, 4))  # a larger batch: a new buffer, the old one kept for graphs captured with it
    assert conv._retired == [bigger] and conv._bordered.shape[0] == 3


def test_check_tensor_names_the_problem_and_the_fix_for_inputs_and_out():
    """The shared first checks of every kernel's call (SpmmKernel, ConvKernel, Split24Kernel)."""
    from sparseforge.runtime.kernel import check_tensor

    cpu = torch.device("cpu")
    check_tensor(torch.zeros(2, dtype=torch.float16), "X", cpu, torch.float16)  # passes
    with pytest.raises(TypeError, match="X must be a torch.Tensor, got ndarray"):
        check_tensor(np.zeros(2), "X", cpu, torch.float16)
    with pytest.raises(ValueError, match=r"X is on meta, the kernel was compiled for cpu: move it with X.to\('cpu'\)"):
        check_tensor(torch.zeros(2, device="meta"), "X", cpu, torch.float32)
    with pytest.raises(ValueError, match=r"out is on meta, .*: allocate it there \(device='cpu'\) or omit out"):
        check_tensor(torch.zeros(2, device="meta"), "out", cpu, torch.float32)
    with pytest.raises(TypeError, match=r"X has dtype torch.bfloat16, .* or compile a kernel for torch.bfloat16"):
        check_tensor(torch.zeros(2, dtype=torch.bfloat16), "X", cpu, torch.float16)
    with pytest.raises(TypeError, match=r"X has dtype torch.int64, .*\(kernels take float32, float16 or bfloat16\)"):
        check_tensor(torch.zeros(2, dtype=torch.int64), "X", cpu, torch.float16)
    with pytest.raises(TypeError, match=r"out has dtype torch.float32, .*: allocate it as torch.float16 or omit out"):
        check_tensor(torch.zeros(2), "out", cpu, torch.float16)
