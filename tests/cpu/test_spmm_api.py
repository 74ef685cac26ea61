"""Argument errors of the public SpMM API that need no GPU to raise (and the no-GPU error itself)."""
import numpy as np
import pytest
import torch

from sparseforge import SparseFormatError, SparseMatrix, compile_spmm, spmm

W = SparseMatrix.from_dense(np.eye(4, dtype=np.float32))


@pytest.mark.parametrize("kwargs, error, message", [
    ({"dtype": torch.int8}, TypeError, "dtype"),
    ({"layout": "mk"}, ValueError, "layout"),
    ({"n": 0}, ValueError, "positive integer"),
    ({"device": "cpu"}, ValueError, "CUDA device"),
])
def test_bad_arguments(kwargs, error, message):
    args = {"n": 8, **kwargs}
    with pytest.raises(error, match=message):
        compile_spmm(W, **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where no GPU exists")
def test_no_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        compile_spmm(W, 8)


def test_spmm_rejects_non_tensors_and_bad_rank():
    with pytest.raises(TypeError, match="torch.Tensor"):
        spmm(W, np.ones((4, 8)))
    with pytest.raises(ValueError, match="2-D or 3-D"):
        spmm(W, torch.ones(4))


@pytest.fixture
def no_compile(monkeypatch):
    """spmm's own checks come before any compile (seconds, and a GPU): compiling here is a failure."""
    import importlib

    spmm_module = importlib.import_module("sparseforge.spmm")  # the module: the package's `spmm` is the function
    def compile_spmm(*args, **kwargs):
        raise AssertionError("spmm compiled a kernel for an input it should have refused")

    monkeypatch.setattr(spmm_module, "compile_spmm", compile_spmm)


@pytest.mark.parametrize("b, kwargs, error, message", [
    (torch.ones(5, 8), {}, ValueError, r"B has shape \(5, 8\): 5 along K where W \(4 x 4\) has K = 4 columns; "
                                       r"layout 'kn' takes B as \[batch,\] K x N"),
    (torch.ones(2, 8, 5), {"layout": "nk"}, ValueError, r"5 along K where W \(4 x 4\) has K = 4 columns; "
                                                        r"layout 'nk' takes B as \[batch,\] N x K"),
    (torch.ones(4, 0), {}, ValueError, r"N = 0, nothing to multiply.*empty 4 x 0 matrix"),
    (torch.ones(3, 0, 4), {"layout": "nk"}, ValueError, r"N = 0.*empty 0 x 4 matrix"),
    (torch.ones(4, 8), {}, ValueError, r"B is on cpu; sparseforge kernels run on a CUDA device: move it with B.cuda\(\)"),
    (torch.ones(4, 8, dtype=torch.float64), {}, TypeError, r"B has dtype torch.float64; sparseforge kernels take"),
    (torch.ones(4, 8, dtype=torch.int64), {}, TypeError, r"B has dtype torch.int64"),
    (torch.ones(4, 8), {"layout": "mk"}, ValueError, r"layout must be 'kn' or 'nk', got 'mk'"),
    (torch.ones(1, 1, 4, 8), {}, ValueError, r"B must be 2-D or 3-D \(\[batch,\] K x N\), got shape \(1, 1, 4, 8\)"),
])
def test_spmm_checks_b_before_compiling(no_compile, b, kwargs, error, message):
    with pytest.raises(error, match=message):
        spmm(W, b, **kwargs)


def test_spmm_refuses_nan_weights_before_compiling(no_compile):
    dense = np.eye(4, dtype=np.float32)
    dense[1, 2] = np.nan
    with pytest.raises(SparseFormatError, match=r"weight\[1, 2\] = nan is not finite"):
        spmm(dense, torch.ones(4, 8))


@pytest.mark.parametrize("bias, message", [
    ([1.0, np.nan, 0.0, 0.0], r"bias\[1\] = nan is not finite"),
    ([0.0, 0.0, 0.0, np.inf], r"bias\[3\] = inf is not finite"),
    ([1.0, 2.0, 3.0], r"bias must have M = 4 entries \(one per row of W\), got 3"),
    (torch.ones(5), r"bias must have M = 4 entries"),
])
def test_bad_bias_is_named_before_any_plan(bias, message):
    """Every candidate plan refuses such a bias alike; before this check the chooser was left with no plan
    (an IndexError deep inside plan_spmm / compile_spmm)."""
    from sparseforge.spmm import plan_spmm

    with pytest.raises(ValueError, match=message):
        plan_spmm(W, 8, bias=bias)
    with pytest.raises(ValueError, match=message):  # before the GPU is looked for
        compile_spmm(W, 8, bias=bias)


def test_a_problem_every_candidate_refuses_raises_their_reason(monkeypatch):
    import importlib

    from sparseforge.plan import TileConfig

    spmm_module = importlib.import_module("sparseforge.spmm")
    monkeypatch.setattr(spmm_module, "search_space", lambda *args, **kwargs: [TileConfig(transpose_x=True)])
    with pytest.raises(ValueError, match="transpose_x applies to layout 'nk'"):
        spmm_module.plan_spmm(W, 8, layout="kn")


def test_every_config_family_round_trips_through_the_cached_choice_record():
    """A cached choice names its winner by family and fields; each family rebuilds to the same config, and
    a record naming an unknown family or field is not rebuilt (the choice is made again)."""
    from sparseforge.plan import TileConfig
    from sparseforge.mappings.bitmap.plan import BitmapConfig
    from sparseforge.mappings.csr.plan import CsrColumnsConfig, CsrConfig
    from sparseforge.tune.pipeline import config_from_record as _config_from_record, config_record as _config_record

    for config in (TileConfig(2, 4, 2, 16, cluster_rows=True), CsrConfig(8, 4, 2, 2), CsrColumnsConfig(2, 4, 1),
                   BitmapConfig(warps_per_block=8, rows_per_warp=4, unroll=1)):
        assert _config_from_record(_config_record(config)) == config
    assert _config_from_record({"family": "nope", "config": {}}) is None
    assert _config_from_record({"family": "bitmap", "config": {"unroll": 3}}) is None


def test_residual_with_a_kernel_family_that_cannot_add_one_is_named_before_the_gpu():
    from sparseforge import compile_spmm
    from sparseforge.plan import TileConfig

    w = np.eye(8, dtype=np.float32)
    with pytest.raises(ValueError, match="does not add a residual yet"):
        compile_spmm(w, 4, residual=True, config=TileConfig())


def test_generated_candidates_over_the_compile_limit_are_dropped_before_planning():
    """A 29M-nonzero LLM layer's generated candidates would take minutes to compile (and seconds each to
    sketch): they are dropped from W's nonzero count alone; the CSR kernels stay. A small layer keeps all."""
    from sparseforge.plan import TileConfig
    from sparseforge.mappings.csr.plan import CsrConfig
    from sparseforge.tune.pipeline import COMPILE_LIMIT_S, within_compile_limit
    from sparseforge.mappings.tile.cost import tile_compile_seconds
    from sparseforge.tune.space import search_space

    space = search_space(1, "nk", 14336, 2048.0)
    assert any(isinstance(c, TileConfig) for c in space)
    kept = within_compile_limit(space, 29_000_000)
    assert kept and not any(isinstance(c, TileConfig) for c in kept) and any(isinstance(c, CsrConfig) for c in kept)
    assert within_compile_limit(space, 20_000) == space
    assert tile_compile_seconds(29_000_000, 1, False) > COMPILE_LIMIT_S
    only_tiles = [c for c in space if isinstance(c, TileConfig)]
    assert within_compile_limit(only_tiles, 29_000_000) == only_tiles  # none would stay: all kept


def test_compile_calls_leave_no_packing_on_the_callers_matrix():
    """Planning packs W's kernel arrays once for all candidates of a call; the caller's matrix does not keep
    them (host memory the size of W) after the call."""
    from sparseforge import prebuild_spmm

    rng = np.random.default_rng(3)
    w = SparseMatrix.from_dense((rng.standard_normal((32, 64)) * (rng.random((32, 64)) < 0.3)).astype(np.float32))
    from sparseforge.conv import plan_conv2d
    from sparseforge.plan.conv import ConvGeometry
    from sparseforge.spmm import plan_spmm

    prebuild_spmm(w, 4, "float32", "nk", arch=90, tune_budget=None)
    assert w.packed(("csr", True), lambda: "fresh") == "fresh"
    w.drop_packed()
    plan_spmm(w, 4, "float32", "nk")
    assert w.packed(("csr", True), lambda: "fresh") == "fresh"
    g = ConvGeometry.of((1, 16, 14, 14), 16, 3, padding=1)
    conv_w = SparseMatrix.from_dense((rng.random(g.weight_shape) < 0.2).astype(np.float32))
    plan_conv2d(conv_w, g)
    assert conv_w.packed(("csr", False), lambda: "fresh") == "fresh"


def test_a_packing_made_twice_at_once_keeps_the_first():
    """Prebuild threads may pack one matrix at the same time: each gets a whole packing, one is kept."""
    w = SparseMatrix.from_dense(np.eye(4, dtype=np.float32))

    def pack_racing():  # another thread stores its packing while this one packs
        w.packed(("k",), lambda: "theirs")
        return "mine"

    assert w.packed(("k",), pack_racing) == "theirs" and w.packed(("k",), lambda: "later") == "theirs"


def test_compile_gated_mlp_takes_two_compiled_kernels():
    from sparseforge import compile_gated_mlp

    from sparseforge.mappings.csr.plan import CsrConfig, make_csr_plan
    from sparseforge.mappings.delta_runs.plan import make_delta_runs_plan
    from sparseforge.runtime.kernel import SpmmKernel

    with pytest.raises(TypeError, match="gate must be a kernel from compile_spmm"):
        compile_gated_mlp(object(), object())

    def kernel(plan, device_index=0):  # the attributes the refusals read (a GPU would load the module)
        k = SpmmKernel.__new__(SpmmKernel)
        k.plan, k.device_index = plan, device_index
        return k

    w = SparseMatrix.from_dense(np.eye(16, 64, dtype=np.float32))
    runs, csr = make_delta_runs_plan(w, 1, "float16", "nk"), make_csr_plan(w, 1, "float16", "nk", CsrConfig())
    with pytest.raises(ValueError, match="gate is a csr kernel and up a delta-runs kernel"):
        compile_gated_mlp(kernel(csr), kernel(runs))
    with pytest.raises(ValueError, match="the csr family has no gated kernel"):
        compile_gated_mlp(kernel(csr), kernel(csr))
    with pytest.raises(ValueError, match="one device"):
        compile_gated_mlp(kernel(runs, 0), kernel(runs, 1))
