"""The delta-runs decode kernel (mappings/delta_runs/render.py) run by the PTX interpreter against float64
into NaN-poisoned outputs, N = 1 and 2..8, and ptxas for sm_90 and sm_80 without spills."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseforge import SparseMatrix
from sparseforge.codegen import render
from sparseforge.mappings.delta_runs.plan import (DeltaRunsConfig, dense_writer_plan, execute_delta_runs,
                                                  gated_delta_runs_plan, make_delta_runs_plan)
from sparseforge.mappings.delta_runs.space import delta_runs_candidates, delta_runs_kept

from .ptx_interp import launch
from .test_interpreted import (TOLERANCE, _decode, _encode, _reference, assert_matches,
                               random_weight_and_epilogue, run_data_kernel)
from .test_ptx import _assemble_without_spills_and_link


@st.composite
def wide_delta_runs_kernels(draw):
    """N = 2..8 (Np = 2, 4, 8 with unused columns where N is not a power of two), kn and nk, X staged 16-byte
    pieces or value by value, as fp32 or, on a GPU of less shared memory (sm_86), in 16 bits."""
    layout = draw(st.sampled_from(["kn", "nk"]))
    config = DeltaRunsConfig(warps_per_block=2, ahead=draw(st.sampled_from([1, 2])), gap_bits=draw(st.sampled_from([8, 4])),
                             overlap=draw(st.booleans()), x_bits=draw(st.sampled_from([32, 16])),
                             ctas=draw(st.sampled_from([0, 1, 2])))
    n, m = draw(st.sampled_from([2, 3, 4, 5, 8])), draw(st.integers(1, 4))
    k = draw(st.sampled_from([1, 24, 33, 300] + ([3208] if n > 4 else [])))
    return (layout, config, m, k, n, draw(st.sampled_from([0.0, 0.01, 0.3])), draw(st.integers(0, 2**16)),
            draw(st.sampled_from(["float16", "bfloat16"])), draw(st.sampled_from([90, 86])))


@given(wide_delta_runs_kernels())
@settings(max_examples=25, deadline=None)
def test_random_wide_delta_runs_kernels_match_float64_reference(problem):
    layout, config, m, k, n, density, seed, dtype, arch = problem
    rng = np.random.default_rng(seed)
    weight, bias, relu = random_weight_and_epilogue(rng, m, k, density, seed)
    plan = make_delta_runs_plan(weight, n, dtype, layout, config, bias=bias, relu=relu, arch=arch)
    b = rng.standard_normal((2, k, n) if layout == "kn" else (2, n, k))
    assert_matches(run_data_kernel(plan, b), _reference(weight, b, layout, dtype, bias, relu), dtype)


def test_x_is_staged_in_16_bits_only_where_fp32_does_not_fit():
    w = SparseMatrix.from_dense(np.eye(8, 14336, dtype=np.float32))
    assert make_delta_runs_plan(w, 8, "float16", "nk").x_bytes == 2  # Llama's down projection at 8 tokens
    assert make_delta_runs_plan(w, 4, "float16", "nk").x_bytes == 4
    assert make_delta_runs_plan(w, 1, "bfloat16", "nk").x_bytes == 4
    assert make_delta_runs_plan(w, 1, "bfloat16", "nk", DeltaRunsConfig(x_bits=16)).x_bytes == 2
    wide = SparseMatrix.from_dense(np.eye(2, 60000, dtype=np.float32))  # fp32 past 227 KB: 16 bits at N = 1 too
    assert make_delta_runs_plan(wide, 1, "float16", "nk").x_bytes == 2


@st.composite
def delta_runs_kernels(draw):
    """Random decode problems: rows of fewer than 32 slots (lanes without a run) and of several slots a lane
    (groups past the first, the last one partial), gaps over 255 or 15 (fillers), 8- and 4-bit gaps, the row's
    first loads before or after X's copy (rows past M then load nothing but still meet the barrier), X staged
    in fp32 or 16 bits, persistent blocks (a warp's later rows), K whose
    bytes are not a multiple of 16 (x staged value by value), empty, all-zero, one-nonzero and dense rows, M not
    a multiple of a block's rows; both 16-bit dtypes; batch; bias, ReLU."""
    layout = draw(st.sampled_from(["kn", "nk"]))
    config = DeltaRunsConfig(warps_per_block=draw(st.sampled_from([2, 4])), ahead=draw(st.sampled_from([1, 2, 4])),
                             gap_bits=draw(st.sampled_from([8, 4])), overlap=draw(st.booleans()),
                             x_bits=draw(st.sampled_from([32, 16])), ctas=draw(st.sampled_from([0, 1, 2])))
    m, k = draw(st.integers(1, 9)), draw(st.sampled_from([1, 7, 33, 200, 600, 1030]))
    density = draw(st.sampled_from([0.0, 0.003, 0.3, 1.0]))
    return (layout, config, m, k, density, draw(st.integers(0, 2**16)), draw(st.sampled_from(["float16", "bfloat16"])),
            draw(st.integers(1, 2)))


@given(delta_runs_kernels())
@settings(max_examples=25, deadline=None)
def test_random_delta_runs_kernels_match_float64_reference(problem):
    layout, config, m, k, density, seed, dtype, batch = problem
    rng = np.random.default_rng(seed)
    weight, bias, relu = random_weight_and_epilogue(rng, m, k, density, seed, dense_row=True)
    plan = make_delta_runs_plan(weight, 1, dtype, layout, config, bias=bias, relu=relu)
    b = rng.standard_normal((batch, k, 1) if layout == "kn" else (batch, 1, k))
    assert_matches(run_data_kernel(plan, b), _reference(weight, b, layout, dtype, bias, relu), dtype)


@pytest.mark.parametrize("gap_bits", [8, 4])
def test_long_runs_and_wide_gaps(gap_bits):
    """Rows of many slots a lane (several groups of `ahead`, a partial last one, lanes of c and c + 1 slots)
    and gaps over 255 and 510 (one and two fillers in 8 bits; many in 4), in one kernel."""
    rng = np.random.default_rng(3)
    dense = np.where(rng.random((3, 1800)) < 0.6, rng.standard_normal((3, 1800)), 0).astype(np.float32)
    dense[1] = 0
    dense[1, [0, 300, 900, 1799]] = [1.0, -2.0, 0.5, 3.0]  # gaps of 300, 600 and 899
    weight = SparseMatrix.from_dense(dense)
    plan = make_delta_runs_plan(weight, 1, "float16", "nk", DeltaRunsConfig(warps_per_block=2, ahead=2,
                                                                            gap_bits=gap_bits))
    assert (plan.format.fillers == 1 + 2 + 3 if gap_bits == 8 else plan.format.fillers > 100)
    assert int(plan.format.rows[0, 1]) > 32 * 2 * 2
    b = rng.standard_normal((1, 1, 1800))
    assert_matches(run_data_kernel(plan, b), _reference(weight, b, "nk", "float16", None, False), "float16")


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 3])
def test_delta_runs_kernel_adds_a_residual_before_relu(layout, dtype, n):
    rng = np.random.default_rng(8)
    dense = np.where(rng.random((6, 150)) < 0.2, rng.standard_normal((6, 150)), 0).astype(np.float32)
    dense[2] = 0
    weight, bias = SparseMatrix.from_dense(dense), rng.standard_normal(6)
    plan = make_delta_runs_plan(weight, n, dtype, layout, DeltaRunsConfig(warps_per_block=4, ahead=2), bias=bias,
                                relu=True, residual=True)
    b = rng.standard_normal((2, 150, n) if layout == "kn" else (2, n, 150))
    residual = rng.standard_normal((2, 6, n) if layout == "kn" else (2, n, 6))
    got = run_data_kernel(plan, b, residual)
    ref = np.maximum(_reference(weight, b, layout, dtype, bias, False) + _decode(_encode(residual, dtype), dtype), 0)
    assert np.isfinite(got).all() and plan.name.endswith("_res")
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_proposed_config_assembles_without_spills(arch, dtype):
    rng = np.random.default_rng(0)
    k = 14336  # Llama's widest K
    w = SparseMatrix.from_dense(np.where(rng.random((64, k)) < 0.1, rng.standard_normal((64, k)), 0)
                                .astype(np.float32))
    configs = delta_runs_candidates(1, "nk", 64, 0.1 * k, False, dtype, 132) + [DeltaRunsConfig(16, 8)] + \
        delta_runs_kept(1, 132) + delta_runs_kept(8, 132) + [DeltaRunsConfig(16, 8, 4)]
    for config in configs:
        for n, residual in ((1, False), (1, True), (2, True), (4, False), (8, True)):
            try:
                plan = make_delta_runs_plan(w, n, dtype, "kn" if n == 4 else "nk", config, bias=np.ones(64),
                                            relu=True, arch=arch, residual=residual)
            except ValueError as err:  # X of 14336 x 8 past sm_80's shared memory; 16 warps of 8 ahead at N = 8
                assert ("K <= " in str(err) and n == 8 and arch == 80) or "registers" in str(err), err
                continue
            _assemble_without_spills_and_link(render(plan), arch)


@pytest.mark.parametrize("m, k, density, gap_bits, dtype", [
    (5, 300, 0.3, 8, "float16"),     # runs of several slots
    (33, 1030, 0.05, 4, "bfloat16"),  # fillers past gaps of 15, rows past a block's
    (3, 2000, 0.002, 8, "float16"),  # fillers past gaps of 255, lanes without a run
    (4, 64, 1.0, 4, "float16"),      # full rows
    (2, 10, 0.0, 8, "bfloat16"),     # nothing stored
])
def test_the_dense_writer_writes_w_exactly(m, k, density, gap_bits, dtype):
    """The prefill's densify kernel (dense_writer_plan: the same arrays, a store a nonzero, no X), run by the PTX
    interpreter into a zeroed M x K output: W exactly, fillers and padding writing nothing (the padding repeats
    a real entry's column with a zero value: a store there would erase it)."""
    rng = np.random.default_rng(m + k)
    dense = np.where(rng.random((m, k)) < density, rng.standard_normal((m, k)), 0).astype(np.float32)
    weight = SparseMatrix.from_dense(dense).astype(dtype)
    measured = make_delta_runs_plan(weight, 1, dtype, "kn", DeltaRunsConfig(2, 2, gap_bits, overlap=True, ctas=1),
                                    bias=np.ones(m), relu=True, residual=True)
    plan = dense_writer_plan(measured)
    assert plan.name != measured.name and plan.dynamic_shared_bytes == 0
    assert not plan.config.overlap and plan.config.ctas == 0 and plan.config.x_bits == 32  # a row a warp, no X
    out = _encode(np.zeros((m, k)), dtype)
    arrays = [_encode(a.astype(np.float64), dtype) if kind == "values" else a for a, kind in plan.weight_arrays()]
    launch(render(plan).text, plan.name, (*plan.grid, 1), plan.threads, np.zeros(1, np.float32), out, *arrays, None)
    assert np.array_equal(_decode(out, dtype), weight.to_dense().astype(np.float64))
    _assemble_without_spills_and_link(render(plan), 90)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("n, ctas", [(1, 1), (1, 3), (3, 2)])
def test_persistent_blocks_take_every_later_row(overlap, n, ctas):
    """ctas persistent blocks: each warp's rows b * warps + w + j * ctas * warps, the next row's record loaded
    while one is summed; among them empty, dense and filler-heavy rows, and warps whose first row is W's last
    or past it (19 rows over 2 warps a block)."""
    rng = np.random.default_rng(ctas * 10 + n)
    dense = np.where(rng.random((19, 700)) < 0.3, rng.standard_normal((19, 700)), 0).astype(np.float32)
    dense[[1, 6, 18]] = 0
    dense[9] = rng.standard_normal(700)
    dense[4] = 0
    dense[4, [0, 699]] = [1.0, -1.0]  # a gap of 699: fillers
    weight, bias = SparseMatrix.from_dense(dense), rng.standard_normal(19)
    config = DeltaRunsConfig(warps_per_block=2, ahead=2, overlap=overlap, ctas=ctas)
    plan = make_delta_runs_plan(weight, n, "bfloat16", "nk", config, bias=bias, relu=True)
    assert plan.grid == (1, ctas) and plan.name != make_delta_runs_plan(weight, n, "bfloat16", "nk").name
    b = rng.standard_normal((2, n, 700))
    assert_matches(run_data_kernel(plan, b), _reference(weight, b, "nk", "bfloat16", bias, True), "bfloat16")


@given(layout=st.sampled_from(["kn", "nk"]), n=st.sampled_from([1, 2, 3]), m=st.integers(1, 9),
       k=st.sampled_from([7, 33, 600]), density=st.sampled_from([0.0, 0.05, 0.4, 1.0]),
       dtype=st.sampled_from(["float16", "bfloat16"]), overlap=st.booleans(), gap_bits=st.sampled_from([8, 4]),
       seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_a_gated_kernel_computes_silu_of_the_gate_times_up(layout, n, m, k, density, dtype, overlap, gap_bits, seed):
    """The Llama MLP's gate and up projections in one kernel: silu(G x) * (U x), G and U of different patterns
    (a row empty in one and not the other, fillers), X staged once, against float64 on the rounded operands;
    the plan's CPU executor alike."""
    rng = np.random.default_rng(seed)
    gate, _, _ = random_weight_and_epilogue(rng, m, k, density, seed, dense_row=True)
    up, _, _ = random_weight_and_epilogue(rng, m, k, min(1.0, density * 2 + 0.01), seed + 1)
    config = DeltaRunsConfig(warps_per_block=2, ahead=2, gap_bits=gap_bits, overlap=overlap)
    plans = [make_delta_runs_plan(w, n, dtype, layout, config) for w in (gate, up)]
    plan = gated_delta_runs_plan(plans[0], None, plans[1], None)
    assert plan.name.endswith("_gated") and len(plan.weight_arrays()) == 8
    b = rng.standard_normal((2, k, n) if layout == "kn" else (2, n, k))
    g, u = (_reference(w, b, layout, dtype, None, False) for w in (gate, up))
    want = g / (1 + np.exp(-g)) * u
    assert_matches(run_data_kernel(plan, b), want, dtype)
    x = _decode(_encode(b, dtype), dtype)  # the executor: the host format's values as given (not rounded)
    g, u = ((w.to_dense().astype(np.float64) @ x) if layout == "kn" else (x @ w.to_dense().astype(np.float64).T)
            for w in (gate, up))
    assert np.allclose(execute_delta_runs(plan, x), g / (1 + np.exp(-g)) * u, rtol=1e-9, atol=1e-12)


def test_a_gated_kernel_refuses_plans_that_differ_or_carry_an_epilogue():
    rng = np.random.default_rng(1)
    w = SparseMatrix.from_dense(np.where(rng.random((8, 64)) < 0.3, rng.standard_normal((8, 64)), 0).astype(np.float32))
    plain = make_delta_runs_plan(w, 1, "float16", "nk")
    with pytest.raises(ValueError, match="differ in config"):
        four = make_delta_runs_plan(w, 1, "float16", "nk", DeltaRunsConfig(gap_bits=4))
        gated_delta_runs_plan(plain, None, four, None)
    with pytest.raises(ValueError, match="plain product"):
        gated_delta_runs_plan(plain, None, make_delta_runs_plan(w, 1, "float16", "nk", bias=np.ones(8)), None)
    with pytest.raises(ValueError, match="ctas=0"):
        persistent = DeltaRunsConfig(ctas=2)
        plain_persistent = make_delta_runs_plan(w, 1, "float16", "nk", persistent)
        gated_delta_runs_plan(plain_persistent, None, plain_persistent, None)
    with pytest.raises(ValueError, match="writes no W dense"):
        dense_writer_plan(gated_delta_runs_plan(plain, None, plain, None))


@pytest.mark.parametrize("arch", [90, 80])
def test_gated_kernels_assemble_without_spills(arch):
    rng = np.random.default_rng(2)
    w = SparseMatrix.from_dense(np.where(rng.random((64, 4096)) < 0.3, rng.standard_normal((64, 4096)), 0)
                                .astype(np.float32))
    for config in delta_runs_candidates(1, "nk", 64, 0.3 * 4096, False, "float16", 132):
        for n in (1, 8):
            try:
                plans = [make_delta_runs_plan(w, n, "bfloat16", "nk", config, arch=arch) for _ in range(2)]
            except ValueError as err:
                assert "registers" in str(err), err
                continue
            _assemble_without_spills_and_link(render(gated_delta_runs_plan(plans[0], None, plans[1], None)), arch)


def test_a_gated_plan_densifies_to_nothing():
    """Two weights, not one W: the densify hook declines (a caller falls back to its own layers' W)."""
    import torch

    from sparseforge.mappings.delta_runs.plan import densify_delta_runs

    rng = np.random.default_rng(4)
    w = SparseMatrix.from_dense(np.where(rng.random((8, 64)) < 0.3, rng.standard_normal((8, 64)), 0).astype(np.float32))
    plain = make_delta_runs_plan(w, 1, "float16", "nk")
    gated = gated_delta_runs_plan(plain, None, plain, None)
    assert densify_delta_runs(gated, None, torch.zeros(8, 64)) is None
    assert gated.registers == plain.registers + 1
