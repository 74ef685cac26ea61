"""Generated kernels run numerically on the CPU by a small PTX interpreter (ptx_interp.py), against a
float64 reference, into NaN-poisoned outputs (shared memory poisoned too): the launch's own steps (zeroing
split rows, transposing X) done as the runtime does them. Every kernel form the generator emits (direct kn,
split, chunked runs, nk through a transposed X or staged in shared memory), in CI."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseforge import SparseMatrix
from sparseforge.codegen import render
from sparseforge.plan import TileConfig, make_plan

from .ptx_interp import launch

TOLERANCE = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}


def _encode(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return values.astype(np.float32)
    if dtype == "float16":
        return values.astype(np.float16)
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # bf16, round to nearest even


def _decode(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return values.astype(np.float64)


def _poisoned(shape, dtype: str) -> np.ndarray:
    return _encode(np.full(shape, np.nan), dtype)


def assert_matches(got: np.ndarray, ref: np.ndarray, dtype: str) -> None:
    """Every output written (the buffers start NaN-poisoned) and within the dtype's tolerance of float64
    (an all-zero reference must be matched exactly)."""
    assert np.isfinite(got).all(), "an output element was never written"
    scale = max(np.linalg.norm(ref), 1e-30)
    assert np.linalg.norm(got - ref) / scale <= TOLERANCE[dtype] or np.linalg.norm(ref) == np.linalg.norm(got) == 0


def run_plan(plan, b: np.ndarray) -> np.ndarray:
    """The kernel of `plan` on b ([batch,] kn: K x N; nk: N x K), as the runtime launches it; float64 out."""
    source = render(plan)
    batch = b.shape[:-2]
    out = _poisoned((*batch, *((plan.M, plan.N) if plan.layout == "kn" else (plan.N, plan.M))), plan.dtype)
    if plan.partial_rows:  # the launch zeroes the rows split groups add into
        rows = list(plan.partial_rows)
        if plan.layout == "kn":
            out[..., rows, :] = 0
        else:
            out[..., rows] = 0
    operand = _encode(np.swapaxes(b, -1, -2).copy() if plan.config.transpose_x else b, plan.dtype)
    tiles, blocks = plan.grid
    launch(source.text, plan.name, (tiles, blocks, int(np.prod(batch, dtype=int))), plan.config.threads, operand,
           out)
    return _decode(out, plan.dtype)


def random_weight_and_epilogue(rng, m: int, k: int, density: float, seed: int, dense_row: bool = False):
    """(W, bias, relu) of a random data-kernel problem: W at `density`, every 5th seed all zero but one
    nonzero, with dense_row every 7th a fully dense first row; a bias on odd seeds, ReLU on every 3rd."""
    dense = np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0).astype(np.float32)
    if seed % 5 == 0:
        dense[:, :] = 0
        dense[m // 2, k // 2] = 1.5  # one nonzero
    if dense_row and seed % 7 == 0:
        dense[0] = rng.standard_normal(k)  # one dense row
    return SparseMatrix.from_dense(dense), (rng.standard_normal(m) if seed % 2 else None), seed % 3 == 0


def _reference(weight: SparseMatrix, b: np.ndarray, layout: str, dtype: str, bias, relu) -> np.ndarray:
    w = _decode(_encode(weight.to_dense(), dtype), dtype)
    b = _decode(_encode(b, dtype), dtype)
    out = w @ b if layout == "kn" else np.swapaxes(w @ np.swapaxes(b, -1, -2), -1, -2)
    if bias is not None:
        out = out + (bias[:, None] if layout == "kn" else bias[None, :])
    return np.maximum(out, 0) if relu else out


def _matrix(m, k, density, seed):
    rng = np.random.default_rng(seed)
    dense = np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0).astype(np.float32)
    dense[min(3, m - 1)] = 0  # an empty row
    return SparseMatrix.from_dense(dense)


CONFIGS = [
    ("plain", "kn", TileConfig(2, 1, 1, 4)),
    ("vec2_2warps", "kn", TileConfig(4, 2, 2, 8)),
    ("split", "kn", TileConfig(2, 1, 2, 4, 1, 6)),
    ("chunked_run", "kn", TileConfig(2, 1, 2, 4, 3, 0, 16)),
    ("chunked_split", "kn", TileConfig(3, 1, 1, 8, 2, 7, 24)),
    ("chunked_vec4", "kn", TileConfig(2, 2, 4, 8, 4, 0, 8)),
    ("clustered", "kn", TileConfig(3, 1, 2, 4, 2, 0, 16, cluster_rows=True)),
    ("nk_transposed", "nk", TileConfig(2, 1, 1, 4, 1, transpose_x=True)),
    ("nk_transposed_split", "nk", TileConfig(4, 1, 1, 4, 2, 5, 16, transpose_x=True)),
    ("inline_row_per_block", "kn", TileConfig(1, 1, 1, 4, inline=True)),
    ("inline_split_run", "kn", TileConfig(3, 2, 2, 8, 2, 6, cluster_rows=True, inline=True)),
    ("nk_transposed_inline", "nk", TileConfig(2, 1, 1, 4, transpose_x=True, inline=True)),
    ("nk_staged", "nk", TileConfig(2, 2, 1, 4)),
    ("nk_staged_split", "nk", TileConfig(3, 2, 1, 8, 1, 6)),
]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name,layout,config", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_kernel_matches_float64_reference(name, layout, config, dtype):
    weight = _matrix(13, 70, 0.15, seed=len(name)).astype(dtype)  # rounded as compile_spmm rounds it
    n = 36  # not a multiple of 32 * vec: tail lanes exit
    rng = np.random.default_rng(1)
    b = rng.standard_normal((70, n) if layout == "kn" else (n, 70))
    bias = np.linspace(-1, 1, 13)
    relu = not config.segment_nnz  # split rows cannot fuse ReLU
    plan = make_plan(weight, n, dtype, layout, config, bias=bias, relu=relu)
    _check(plan, weight, b, bias, relu)


def _check(plan, weight, b, bias, relu) -> None:
    got = run_plan(plan, b)
    ref = _reference(weight, b, plan.layout, plan.dtype, bias, relu)
    assert np.isfinite(got).all(), "an output element was never written"
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= TOLERANCE[plan.dtype]


@pytest.mark.parametrize("name,layout,config", CONFIGS[2:4] + CONFIGS[-1:], ids=["split", "chunked_run", "nk"])
def test_batched_kernel_reads_and_writes_each_batch_entry(name, layout, config):
    weight = _matrix(9, 40, 0.2, seed=3)
    b = np.random.default_rng(2).standard_normal((2, 40, 20) if layout == "kn" else (2, 20, 40))
    plan = make_plan(weight, 20, "float32", layout, config)
    _check(plan, weight, b, None, False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_staged_nk_over_several_chunks_of_k(dtype):
    """K beyond one shared-memory stage: the block stages chunk after chunk between barriers, and the
    sections carry their accumulators from one chunk to the next."""
    weight = _matrix(6, 900, 0.03, seed=5).astype(dtype)  # rounded as compile_spmm rounds it
    b = np.random.default_rng(3).standard_normal((33, 900))
    plan = make_plan(weight, 33, dtype, "nk", TileConfig(2, 2, 1, 4), bias=np.arange(6.0), relu=True)
    assert plan.K > 400 and "bar.sync" in render(plan).text
    _check(plan, weight, b, np.arange(6.0), True)


def test_single_nonzero_and_all_zero_matrices():
    for dense in (np.zeros((5, 9), np.float32), np.eye(1, 9, 4, dtype=np.float32).repeat(5, 0) * [[1], [0], [0], [0], [0]]):
        weight = SparseMatrix.from_dense(dense.astype(np.float32))
        b = np.random.default_rng(0).standard_normal((9, 8))
        plan = make_plan(weight, 8, "float32", "kn", TileConfig(2, 1, 1, 4), bias=np.ones(5))
        got = run_plan(plan, b)
        assert np.allclose(got, dense @ b + 1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n,bias,k,unroll", [(1, False, 96, None), (3, True, 96, None), (16, True, 96, None),
                                             (1, False, 2720, 4), (5, True, 1600, 2), (2, False, 2080, 3),
                                             (1, False, 2720, 1), (3, True, 4128, 2)])
def test_packed_24_gemv_matches_float64_reference(dtype, n, bias, k, unroll):
    """The packed 2:4 GEMV (codegen/gemv24.py): two register sets of chunks, prmt selection, warp shuffle
    reduction. K = 96: 6 chunks over 32 lanes (most lanes none, the rest one); 2720 = 170 chunks: 5 or 6 a
    lane (sets of 4: the second set partly the lane's; sets of 1: three trips round the loop); 1600 = 100
    chunks: 3 or 4 a lane in sets of 2; 2080 = 130 chunks: 4 or 5 in sets of 3; 4128 = 258 chunks: 8 or 9 in
    sets of 2 (the loop twice, then a first set of one chunk)."""
    import torch

    from sparseforge.codegen.gemv24 import WARPS, render_gemv24
    from sparseforge.prune import nm_mask
    from sparseforge.semi.packed import pack_24

    m = 11 if k == 96 else 3  # M not a multiple of the warps per block
    w = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    w = (w * nm_mask(w)).to(getattr(torch, dtype))
    w[0, :4] = 0  # a 2:4 group with no nonzero
    packed = pack_24(w)
    x = np.random.default_rng(n).standard_normal((n, k))
    b = np.linspace(-1, 1, m) if bias else None
    as_np = {"float16": lambda t: t.numpy(), "bfloat16": lambda t: t.view(torch.int16).numpy().view(np.uint16)}[dtype]
    y = _poisoned((n, m), dtype)
    source = render_gemv24(dtype, n, bias, unroll=unroll)
    launch(source.text, source.name, (-(-m // WARPS), 1, 1), WARPS * 32, as_np(packed.values), packed.meta.numpy(),
           _encode(x, dtype), y, None if b is None else _encode(b, dtype), m, k)
    ref = _decode(_encode(x, dtype), dtype) @ w.double().numpy().T
    if bias:
        ref += _decode(_encode(b, dtype), dtype)
    got = _decode(y, dtype)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= TOLERANCE[dtype]


@st.composite
def kernels(draw):
    """A random small problem and any tile configuration the generator accepts for it."""
    layout = draw(st.sampled_from(["kn", "nk"]))
    staged = layout == "nk" and draw(st.booleans())
    config = TileConfig(draw(st.integers(1, 5)), draw(st.sampled_from([1, 2])),
                        1 if layout == "nk" else draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 8)),
                        1 if staged else draw(st.integers(1, 3)), draw(st.sampled_from([0, 0, 3, 9])),
                        0 if staged else draw(st.sampled_from([0, 0, 5, 16])), transpose_x=layout == "nk" and not staged,
                        cluster_rows=draw(st.booleans()))
    if not staged and not config.chunk_k and draw(st.booleans()):
        config = dataclasses.replace(config, inline=True)
    m, k, n = draw(st.integers(1, 10)), draw(st.integers(1, 40)), draw(st.integers(1, 40))
    density = draw(st.sampled_from([0.0, 0.1, 0.3, 1.0]))
    seed = draw(st.integers(0, 2**16))
    return layout, config, m, k, n, density, seed, draw(st.sampled_from(["float32", "float16", "bfloat16"]))


@given(kernels())
@settings(max_examples=60, deadline=None)  # 300 passed locally; 60 keep CI quick
def test_random_kernels_match_float64_reference(problem):
    layout, config, m, k, n, density, seed, dtype = problem
    rng = np.random.default_rng(seed)
    # W rounded to the kernel's dtype first, as compile_spmm gives it to the planner (and as the reference
    # takes it): with cancellation, fp32 immediates against an fp16-rounded reference differ past tolerance
    weight = SparseMatrix.from_dense(np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0)
                                     .astype(np.float32)).astype(dtype)
    bias = rng.standard_normal(m) if seed % 2 else None
    relu = not config.segment_nnz and seed % 3 == 0
    plan = make_plan(weight, n, dtype, layout, config, bias=bias, relu=relu)
    b = rng.standard_normal((k, n) if layout == "kn" else (n, k))
    got = run_plan(plan, b)
    ref = _reference(weight, b, layout, dtype, bias, relu)
    assert_matches(got, ref, dtype)


# -- the small-N kernel over padded CSR (mappings/csr/render.py) ---------------------------------------------------
def run_data_kernel(plan, b: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    """A kernel that reads W as data (CSR, csr-columns, bitmap) on b, as the runtime launches it: its
    plan.weight_arrays() (values in the kernel's dtype), the bias, then the residual where the plan adds
    one; float64 out."""
    from sparseforge.codegen import render

    batch = b.shape[:-2]
    out = _poisoned((*batch, *((plan.M, plan.N) if plan.layout == "kn" else (plan.N, plan.M))), plan.dtype)
    arrays = [_encode(a.astype(np.float64), plan.dtype) if kind == "values" else a for a, kind in plan.weight_arrays()]
    arrays += [np.zeros(size, np.int32) for size in getattr(plan, "workspace_sizes", tuple)()]  # the kernel's own
    bias = None if plan.bias is None else np.asarray(plan.bias, np.float32)
    extra = [_encode(residual, plan.dtype)] if plan.residual else []
    launch(render(plan).text, plan.name, (*plan.grid, int(np.prod(batch, dtype=int))), plan.threads,
           _encode(b, plan.dtype), out, *arrays, bias, *extra, shared_bytes=getattr(plan, "dynamic_shared_bytes", 0))
    return _decode(out, plan.dtype)


run_csr = run_data_kernel


@pytest.mark.parametrize("layout,config", [("kn", "small_n"), ("nk", "small_n"), ("kn", "columns"), ("nk", "prefetch")])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_csr_kernels_add_a_residual_before_relu(layout, config, dtype):
    """Y = relu(W B + bias + R), R laid out as the output (kn: M x N; nk: N x M), batched."""
    from sparseforge.mappings.csr.plan import CsrColumnsConfig, CsrConfig, make_csr_plan

    rng = np.random.default_rng(5)
    dense = np.where(rng.random((7, 40)) < 0.3, rng.standard_normal((7, 40)), 0).astype(np.float32)
    dense[3] = 0  # an empty row: its output is bias + R only
    weight, bias, n = SparseMatrix.from_dense(dense), rng.standard_normal(7), 11
    cfg = {"small_n": CsrConfig(8, 4, 2), "prefetch": CsrConfig(4, 4, 2, 2, prefetch=True),
           "columns": CsrColumnsConfig(1, 2, 2)}[config]
    plan = make_csr_plan(weight, n, dtype, layout, cfg, bias=bias, relu=True, residual=True)
    assert plan.name.endswith("_res")
    b = rng.standard_normal((2, 40, n) if layout == "kn" else (2, n, 40))
    residual = rng.standard_normal((2, 7, n) if layout == "kn" else (2, n, 7))
    got = run_csr(plan, b, residual)
    rounded = _decode(_encode(residual, dtype), dtype)
    ref = _reference(weight, b, layout, dtype, bias, False) + rounded
    ref = np.maximum(ref, 0)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= TOLERANCE[dtype]


@st.composite
def csr_kernels(draw):
    """A random small problem (tails, empty rows, all-zero, one nonzero, dense rows) and any small-N config."""
    from sparseforge.mappings.csr.plan import CsrConfig

    columns = draw(st.integers(1, 9))
    config = CsrConfig(draw(st.sampled_from([4, 8, 16, 32])), columns, draw(st.sampled_from([1, 2])),
                       draw(st.sampled_from([1, 2])) if columns <= 8 else 1, prefetch=draw(st.booleans()))
    m, k, n = draw(st.integers(1, 12)), draw(st.integers(1, 48)), draw(st.integers(1, 20))
    density = draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]))
    return (draw(st.sampled_from(["kn", "nk"])), config, m, k, n, density, draw(st.integers(0, 2**16)),
            draw(st.sampled_from(["float32", "float16", "bfloat16"])), draw(st.integers(1, 2)))


@given(csr_kernels())
@settings(max_examples=50, deadline=None)
def test_random_small_n_kernels_match_float64_reference(problem):
    from sparseforge.mappings.csr.plan import make_csr_plan

    layout, config, m, k, n, density, seed, dtype, batch = problem
    rng = np.random.default_rng(seed)
    weight, bias, relu = random_weight_and_epilogue(rng, m, k, density, seed)
    plan = make_csr_plan(weight, n, dtype, layout, config, bias=bias, relu=relu)
    b = rng.standard_normal((batch, k, n) if layout == "kn" else (batch, n, k))
    got = run_csr(plan, b)
    ref = _reference(weight, b, layout, dtype, bias, relu)
    assert_matches(got, ref, dtype)


@st.composite
def staged_kernels(draw):
    """A random small problem for csr-staged: N in one column tile, 1-3 persistent blocks (fewer than the
    row blocks, so a block takes several in turn), either layout, batch 1-2."""
    from sparseforge.mappings.csr.plan import CsrConfig

    n = draw(st.integers(1, 16))
    columns = 1 << (n - 1).bit_length()
    config = CsrConfig(draw(st.sampled_from([4, 8, 32])), columns, draw(st.sampled_from([1, 2])),
                       draw(st.sampled_from([1, 2])) if columns <= 8 else 1, stage_b=True,
                       ctas=draw(st.integers(1, 3)), prefetch=draw(st.booleans()))
    m, k = draw(st.integers(1, 20)), draw(st.integers(1, 48))
    density = draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]))
    return (draw(st.sampled_from(["kn", "nk"])), config, m, k, n, density, draw(st.integers(0, 2**16)),
            draw(st.sampled_from(["float32", "float16", "bfloat16"])), draw(st.integers(1, 2)))


@given(staged_kernels())
@settings(max_examples=35, deadline=None)
def test_random_staged_kernels_match_float64_reference(problem):
    """csr-staged reads B from its shared copy (poisoned by the interpreter before the copy: a row it did
    not stage would show as NaN), blocks striding over the row blocks."""
    from sparseforge.mappings.csr.plan import make_csr_plan

    layout, config, m, k, n, density, seed, dtype, batch = problem
    rng = np.random.default_rng(seed)
    weight, bias, relu = random_weight_and_epilogue(rng, m, k, density, seed)
    plan = make_csr_plan(weight, n, dtype, layout, config, bias=bias, relu=relu)
    assert plan.mapping == "csr-staged" and plan.grid[0] == 1 and plan.dynamic_shared_bytes >= k * n * 2
    b = rng.standard_normal((batch, k, n) if layout == "kn" else (batch, n, k))
    got = run_csr(plan, b)
    ref = _reference(weight, b, layout, dtype, bias, relu)
    assert_matches(got, ref, dtype)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_staged_kernel_adds_a_residual_over_rows_taken_in_turn(layout, dtype, prefetch):
    """One persistent block over 4 row blocks (M = 13, 4 rows a block): bias, residual and ReLU on each."""
    from sparseforge.mappings.csr.plan import CsrConfig, make_csr_plan

    rng = np.random.default_rng(8)
    dense = np.where(rng.random((13, 37)) < 0.3, rng.standard_normal((13, 37)), 0).astype(np.float32)
    dense[5] = 0
    weight, bias, n = SparseMatrix.from_dense(dense), rng.standard_normal(13), 6
    config = CsrConfig(16, 8, 2, stage_b=True, ctas=1, prefetch=prefetch)
    plan = make_csr_plan(weight, n, dtype, layout, config, bias=bias,
                         relu=True, residual=True)
    assert plan.grid == (1, 1) and plan.config.rows_per_block == 4
    b = rng.standard_normal((2, 37, n) if layout == "kn" else (2, n, 37))
    residual = rng.standard_normal((2, 13, n) if layout == "kn" else (2, n, 13))
    got = run_csr(plan, b, residual)
    ref = np.maximum(_reference(weight, b, layout, dtype, bias, False) + _decode(_encode(residual, dtype), dtype), 0)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_prefetching_kernels_carry_steps_and_rows_across_iterations(staged, dtype):
    """prefetch: rows of 0, 1, a step's nonzeros - 1, + 1 and up to 3 steps (the loads a step issues
    for the next one, guarded by the row's end, and for csr-staged the next row's range) against float64;
    csr-staged: blocks of 2 rows (16 lanes a row), 2 persistent blocks over the 4 row blocks, so a block's
    second row block takes its range from the prefetch issued during its first."""
    from sparseforge.mappings.csr.plan import CsrConfig, make_csr_plan

    rng = np.random.default_rng(11)
    k, n = 300, 5  # a step of 16 lanes x 2 x 4 is 128 nonzeros: rows of 0 to 3 steps
    dense = rng.standard_normal((7, k))
    for row, count in enumerate([0, 1, 127, 128, 129, 200, 300]):
        dense[row, rng.permutation(k)[count:]] = 0
    weight = SparseMatrix.from_dense(dense.astype(np.float32))
    config = CsrConfig(16, 8, 1, 2, stage_b=staged, ctas=2 if staged else 0, prefetch=True)
    bias = rng.standard_normal(7)
    plan = make_csr_plan(weight, n, dtype, "kn", config, bias=bias, relu=False)
    assert plan.config.rows_per_block == 2 and plan.grid == ((1, 2) if staged else (1, 4))
    b = rng.standard_normal((2, k, n))
    assert_matches(run_csr(plan, b), _reference(weight, b, "kn", dtype, bias, False), dtype)


def test_small_n_kernel_never_multiplies_padding():
    """Rows are padded to 4 slots; a padded slot must not be read as a weight even where B holds inf there
    (column 0 is what padding points at)."""
    from sparseforge.mappings.csr.plan import CsrConfig, make_csr_plan

    dense = np.zeros((3, 6), np.float32)
    dense[0, [1, 2, 3]] = [1.0, -2.0, 0.5]  # 3 nonzeros: one padded slot
    dense[2, 5] = 4.0
    plan = make_csr_plan(SparseMatrix.from_dense(dense), 4, "float32", "kn", CsrConfig(4, 4, 1))
    b = np.random.default_rng(0).standard_normal((6, 4))
    b[0] = np.inf
    got = run_csr(plan, b)
    assert np.isfinite(got).all()
    assert np.allclose(got, dense.astype(np.float64) @ np.where(np.isinf(b), 0, b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("k, index_bytes", [(65536, 2), (65537, 4)])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_small_n_kernel_reads_16_bit_indices_up_to_k_65536_and_32_bit_past_it(k, index_bytes, layout):
    """The last columns of K (65535 is the largest 16-bit index) must be read from the right B rows: a
    truncated or sign-extended index would read column 0's or fault."""
    from sparseforge.mappings.csr.plan import CsrConfig, make_csr_plan

    rng = np.random.default_rng(k)
    dense = np.zeros((5, k), np.float32)
    for r in range(5):
        dense[r, rng.choice(k, 7, replace=False)] = rng.standard_normal(7)
    dense[1, [0, 65535, k - 1]] = [1.5, -2.0, 3.0]
    weight = SparseMatrix.from_dense(dense)
    plan = make_csr_plan(weight, 2, "float16", layout, CsrConfig(lanes_per_row=4, columns=2, unroll=2))
    assert plan.index_bytes == index_bytes
    b = rng.standard_normal((k, 2) if layout == "kn" else (2, k))
    assert_matches(run_csr(plan, b), _reference(weight, b, layout, "float16", None, False), "float16")


@st.composite
def csr_columns_kernels(draw):
    """A random small problem and any csr-columns config: rows longer than a chunk of 32 and than the warps
    of a row take together (so chunks are dealt round robin), N with and without vector tails, batch."""
    from sparseforge.mappings.csr.plan import CsrColumnsConfig

    warps = draw(st.sampled_from([1, 2, 4]))
    m, k, n = draw(st.integers(1, 5)), draw(st.integers(1, 140)), draw(st.integers(1, 40))
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    # 8 columns a lane only as one 16-byte vector (make_csr_plan refuses the rest: they spill)
    eight = [8] if dtype != "float32" and n % 8 == 0 else []
    config = CsrColumnsConfig(draw(st.sampled_from([1, 2, 4, *eight])), warps, draw(st.sampled_from([1, 2])))
    density = draw(st.sampled_from([0.0, 0.1, 0.6, 1.0]))
    return config, m, k, n, density, draw(st.integers(0, 2**16)), dtype, draw(st.integers(1, 2))


@given(csr_columns_kernels())
@settings(max_examples=25, deadline=None)
def test_random_csr_columns_kernels_match_float64_reference(problem):
    from sparseforge.mappings.csr.plan import make_csr_plan

    config, m, k, n, density, seed, dtype, batch = problem
    rng = np.random.default_rng(seed)
    weight, bias, relu = random_weight_and_epilogue(rng, m, k, density, seed)
    plan = make_csr_plan(weight, n, dtype, "kn", config, bias=bias, relu=relu)
    b = rng.standard_normal((batch, k, n))
    got = run_csr(plan, b)
    ref = _reference(weight, b, "kn", dtype, bias, relu)
    assert_matches(got, ref, dtype)


@pytest.mark.parametrize("warps_per_row", [1, 2])
def test_csr_columns_kernel_never_multiplies_padding_or_other_lanes_slots(warps_per_row):
    """Slots past a row's end (the padding to 4, and the rest of its last chunk of 32: index 0, value 0)
    must not become FMAs, even where B's row 0 holds inf; rows use every warp's share."""
    from sparseforge.mappings.csr.plan import CsrColumnsConfig, make_csr_plan

    dense = np.zeros((3, 80), np.float32)
    dense[0, [1, 2, 3]] = [1.0, -2.0, 0.5]
    dense[1, 1::2] = np.linspace(-1, 1, 40)  # 40 nonzeros: two chunks
    dense[2, 79] = 4.0
    plan = make_csr_plan(SparseMatrix.from_dense(dense), 5, "float32", "kn", CsrColumnsConfig(1, warps_per_row, 2))
    b = np.random.default_rng(0).standard_normal((80, 5))
    b[0] = np.inf
    got = run_csr(plan, b)
    assert np.isfinite(got).all()
    assert np.allclose(got, dense.astype(np.float64) @ np.where(np.isinf(b), 0, b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("config", [TileConfig(1, 1, 1, 4), TileConfig(1, 2, 2, 8, 2), TileConfig(2, 1, 4, 4)],
                         ids=["row_per_block", "two_rows_per_block_run", "two_rows_vec4"])
def test_row_per_block_kernels_match_float64_reference(config):
    weight = _matrix(11, 50, 0.2, seed=9)
    b = np.random.default_rng(4).standard_normal((50, 44))
    plan = make_plan(weight, 44, "float32", "kn", config, bias=np.ones(11), relu=True)
    assert plan.mapping == ("row-per-block" if config.rows_per_group == 1 else "row-groups")
    _check(plan, weight, b, np.ones(11), True)


@pytest.mark.parametrize("form", ["row_groups", "small_n", "csr_columns"])
def test_fused_relu_keeps_nan(form):
    """ReLU is max.NaN(x, 0): a NaN reaching a row's sum stays NaN, as torch.relu keeps it."""
    from sparseforge.mappings.csr.plan import CsrConfig, make_csr_plan

    dense = np.zeros((4, 6), np.float32)
    dense[0, 2], dense[1, 2], dense[2, 4] = -1.0, 2.0, 3.0  # rows 0 and 1 read column 2; row 3 is empty
    weight = SparseMatrix.from_dense(dense)
    b = np.ones((6, 4))
    b[2, 1] = np.nan
    if form == "small_n":
        got = run_csr(make_csr_plan(weight, 4, "float32", "kn", CsrConfig(4, 4, 1), relu=True), b)
    elif form == "csr_columns":
        from sparseforge.mappings.csr.plan import CsrColumnsConfig

        got = run_csr(make_csr_plan(weight, 4, "float32", "kn", CsrColumnsConfig(1, 2, 2), relu=True), b)
    else:
        got = run_plan(make_plan(weight, 4, "float32", "kn", TileConfig(2, 1, 1, 4), relu=True), b)
    assert np.isnan(got[:2, 1]).all() and not np.isnan(np.delete(got, 1, axis=1)).any()
    assert not np.isnan(got[2:]).any() and got[0, 0] == 0.0 and got[1, 0] == 2.0


def test_packed_24_gemv_propagates_nan_and_inf_through_kept_weights_only():
    """x[t, k] = inf makes y[t, i] +-inf exactly where W[i, k] is kept; NaN likewise; the rest stay finite.
    (SparseLinear24's cuSPARSELt path read NaN for some of those infinities on the H200: docs/history.md.)"""
    import torch

    from sparseforge.codegen.gemv24 import WARPS, render_gemv24
    from sparseforge.prune import nm_mask
    from sparseforge.semi.packed import pack_24

    m, k, n = 11, 64, 6
    w = torch.randn(m, k, generator=torch.Generator().manual_seed(0))
    w = (w * nm_mask(w)).to(torch.float16)
    packed = pack_24(w)
    x = np.random.default_rng(0).standard_normal((n, k))
    x[4, 17], x[2, 5] = np.inf, np.nan
    y = _poisoned((n, m), "float16")
    source = render_gemv24("float16", n, False)
    launch(source.text, source.name, (-(-m // WARPS), 1, 1), WARPS * 32, packed.values.numpy(), packed.meta.numpy(),
           _encode(x, "float16"), y, None, m, k)
    got, dense = _decode(y, "float16"), w.double().numpy()
    uses17, uses5 = dense[:, 17] != 0, dense[:, 5] != 0
    assert np.array_equal(got[4, uses17], np.sign(dense[uses17, 17]) * np.inf)
    assert np.isnan(got[2, uses5]).all() and np.isfinite(got[2, ~uses5]).all() and np.isfinite(got[4, ~uses17]).all()
    assert np.isfinite(np.delete(got, [2, 4], axis=0)).all()



@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_packed_24_dense_writer_gives_the_weight_bit_for_bit(dtype):
    """The packed 2:4 dense writer (codegen/gemv24.py render_unpack24): every element written over a
    NaN-poisoned output, the kept values' bits at their positions (the extremes of the dtype and a kept -0.0
    included), zeros elsewhere; groups with fewer than two nonzeros, and a chunk count that leaves most of
    the block idle."""
    import torch

    from sparseforge.codegen.gemv24 import UNPACK_NAME, UNPACK_THREADS, render_unpack24
    from sparseforge.prune import nm_mask
    from sparseforge.semi.packed import pack_24, unpack_24

    torch_dtype = getattr(torch, dtype)
    info = torch.finfo(torch_dtype)
    m, k = 5, 64  # 20 chunks
    w = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    w = (w * nm_mask(w)).to(torch_dtype)
    w[0, :4] = 0                                                             # no nonzero
    w[1, 4:8] = torch.tensor([0.0, 0.0, 0.0, 1.5])                           # one, at the last position
    w[2, 8:12] = torch.tensor([0.0, info.max, 0.0, -info.tiny / 4])          # the largest and a subnormal
    w[3, 12:16] = torch.tensor([-0.0, 0.0, 2.0, 0.0])                        # a -0.0 kept beside the 2.0
    packed = pack_24(w)
    bits = lambda t: t.contiguous().view(torch.int16).numpy().view(np.uint16)  # noqa: E731
    out = np.full((m, k), 0xFFFF, np.uint16)  # NaN in both dtypes
    chunks = m * k // 16
    launch(render_unpack24().text, UNPACK_NAME, (-(-chunks // UNPACK_THREADS), 1, 1), UNPACK_THREADS,
           bits(packed.values), packed.meta.numpy(), out, chunks)
    assert np.array_equal(out, bits(unpack_24(packed)))
    assert torch.equal(torch.from_numpy(out.view(np.int16)).view(torch_dtype), w)
    assert out[3, 12] == 0x8000  # the kept -0.0's sign bit
