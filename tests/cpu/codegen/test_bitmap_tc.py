"""The bitmap-tc kernel (mappings/bitmap_tc/render.py) run by the PTX interpreter (cp.async, shuffles, popc,
mma) against float64 into NaN-poisoned outputs: strips and chunks with tails, a warp's chunks through every
buffer of its ring, N across two n-tiles, both layouts (B value by value where it must), both dtypes,
batches, bias, ReLU, the residual; the gated MLP's kernel (silu(G x) * (U x)); ptxas for sm_90 and sm_80 without
spills; what the plan refuses."""
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseforge import SparseMatrix
from sparseforge.codegen import render
from sparseforge.mappings.bitmap_tc.plan import (BitmapTcConfig, densify_bitmap_tc, execute_bitmap_tc,
                                                 gated_bitmap_tc_plan, make_bitmap_tc_plan)
from sparseforge.mappings.bitmap_tc.space import bitmap_tc_candidates, bitmap_tc_trials

from .ptx_interp import launch
from .test_interpreted import (_decode, _encode, _poisoned, _reference, assert_matches, random_weight_and_epilogue,
                               run_data_kernel)
from .test_ptx import _assemble, _assemble_without_spills_and_link


@st.composite
def problems(draw):
    """M past a strip, K past a chunk (odd K: B one element at a time; K % 8 == 0 in nk: two 16-byte loads a
    tile group; else 32 bits), warps with no chunk, several chunks a warp, scans in groups; empty, one-nonzero,
    dense-row weights (random_weight_and_epilogue). Every buffer of a deep ring: test_every_ring_buffer_..."""
    m, k = draw(st.sampled_from([1, 16, 17, 33])), draw(st.sampled_from([8, 33, 128, 300, 700]))
    n = draw(st.sampled_from([1, 2, 3, 8, 9, 16]))
    strips = draw(st.sampled_from([1, 1, 2, 4])) if n >= 8 else 1
    config = BitmapTcConfig(warps_per_block=draw(st.sampled_from([2, 4])),
                            stages=draw(st.sampled_from([2, 3, 4] if strips < 4 else [2, 3])),
                            scan_group=draw(st.sampled_from([g for g in (1, 2, 4, 8) if g * strips <= 8])),
                            strips=strips)
    return (m, k, n, draw(st.sampled_from(["kn", "nk"])), draw(st.sampled_from(["float16", "bfloat16"])), config,
            draw(st.sampled_from([0.05, 0.5, 1.0])), draw(st.integers(0, 2 ** 16)), draw(st.integers(1, 2)))


@given(problems())
@settings(max_examples=15, deadline=None)
def test_random_bitmap_tc_kernels_match_float64(problem):
    m, k, n, layout, dtype, config, density, seed, batch = problem
    rng = np.random.default_rng(seed)
    weight, bias, relu = random_weight_and_epilogue(rng, m, k, density, seed, dense_row=True)
    plan = make_bitmap_tc_plan(weight, n, dtype, layout, config, bias=bias, relu=relu)
    shape = (k, n) if layout == "kn" else (n, k)
    b = rng.standard_normal((batch, *shape) if batch > 1 else shape)
    assert_matches(run_data_kernel(plan, b), _reference(weight, b, layout, dtype, bias, relu), dtype)


@pytest.mark.parametrize("scan_group", [1, 8])
@pytest.mark.parametrize("k, b_loads", [(264, "wide"), (300, "pair"), (301, "scalar")])
def test_each_way_of_loading_b_matches_float64(k, b_loads, scan_group):
    """X as N x K, 9 tokens (two n-tiles, the second partial): each of plan.b_loads' forms, with a scan group of
    8 tiles (both tile groups' B live at once) and tile by tile."""
    rng = np.random.default_rng(k)
    weight, bias, relu = random_weight_and_epilogue(rng, 33, k, 0.5, k, dense_row=True)
    plan = make_bitmap_tc_plan(weight, 9, "float16", "nk", BitmapTcConfig(2, 2, scan_group), bias=bias, relu=relu)
    assert plan.b_loads == b_loads
    b = rng.standard_normal((9, k))
    assert_matches(run_data_kernel(plan, b), _reference(weight, b, "nk", "float16", bias, relu), "float16")


@pytest.mark.parametrize("stages", [4, 5, 6])
def test_every_ring_buffer_is_decoded(stages):
    """K = 1800: 15 chunks, 8 for the first of 2 warps, so a ring of 4-6 buffers wraps and each buffer's
    immediates are used (a buffer reading another's address gives a wrong product)."""
    rng = np.random.default_rng(stages)
    weight, bias, relu = random_weight_and_epilogue(rng, 17, 1800, 0.5, stages, dense_row=True)
    plan = make_bitmap_tc_plan(weight, 8, "float16", "nk", BitmapTcConfig(2, stages, 4), bias=bias, relu=relu)
    assert plan.chunks_per_warp == 8
    b = rng.standard_normal((8, 1800))
    assert_matches(run_data_kernel(plan, b), _reference(weight, b, "nk", "float16", bias, relu), "float16")


@pytest.mark.parametrize("strips, m, layout, n", [(2, 33, "nk", 8), (2, 48, "nk", 9), (4, 40, "kn", 8),
                                                 (4, 70, "nk", 16), (2, 5, "kn", 8)])
def test_several_strips_a_warp_share_b_and_store_only_their_rows(strips, m, layout, n):
    """config.strips: a warp's strips over the same chunk columns, each its own accumulators and epilogue; M
    not a multiple of the block's rows (the last block decodes the last strip again and stores nothing of it),
    fewer strips than a block takes, B shared by 16-byte loads (nk) and at the tile (kn), two n-tiles."""
    rng = np.random.default_rng(m + strips)
    weight, bias, relu = random_weight_and_epilogue(rng, m, 600, 0.5, m, dense_row=True)
    plan = make_bitmap_tc_plan(weight, n, "float16", layout, BitmapTcConfig(2, 3, 2, strips=strips), bias=bias,
                               relu=relu, residual=True)
    assert plan.grid == (1, -(-plan.format.strips // strips))
    shape = (600, n) if layout == "kn" else (n, 600)
    b, residual = rng.standard_normal(shape), rng.standard_normal((m, n) if layout == "kn" else (n, m))
    want = _reference(weight, b, layout, "float16", bias, False) + _decode(_encode(residual, "float16"), "float16")
    assert_matches(run_data_kernel(plan, b, residual), np.maximum(want, 0) if relu else want, "float16")


@pytest.mark.parametrize("stages, scan_group, n, k, dtype", [(2, 4, 8, 1800, "float16"), (3, 1, 9, 1800, "bfloat16"),
                                                            (3, 8, 3, 1000, "float16"), (4, 2, 16, 264, "float16")])
def test_b_loaded_a_chunk_ahead_matches_float64(stages, scan_group, n, k, dtype):
    """config.b_ahead: each chunk loads the next one's B into the other register set (an odd ring unrolled twice,
    so both sets meet every buffer), the last chunk's loads past K zero; warps with 8 chunks and with fewer, K
    past a chunk, one and two n-tiles; the gated kernel alike."""
    rng = np.random.default_rng(k + stages)
    weight, bias, relu = random_weight_and_epilogue(rng, 21, k, 0.5, stages, dense_row=True)
    config = BitmapTcConfig(warps_per_block=2, stages=stages, scan_group=scan_group, b_ahead=1)
    plan = make_bitmap_tc_plan(weight, n, dtype, "nk", config, bias=bias, relu=relu)
    assert plan.b_loads == "wide" and "%bx0_1_7}, [%rdy0+" in render(plan).modules[0]  # set 1 loaded
    b = rng.standard_normal((2, n, k))
    assert_matches(run_data_kernel(plan, b), _reference(weight, b, "nk", dtype, bias, relu), dtype)
    if n >= 8 and scan_group <= 4:
        up, _, _ = random_weight_and_epilogue(rng, 21, k, 0.3, stages + 1)
        plans = [make_bitmap_tc_plan(w, n, dtype, "nk", config) for w in (weight, up)]
        gated = gated_bitmap_tc_plan(plans[0], None, plans[1], None)
        g, u = (_reference(w, b, "nk", dtype, None, False) for w in (weight, up))
        assert_matches(run_data_kernel(gated, b), g / (1 + np.exp(-g)) * u, dtype)


@pytest.mark.parametrize("k_split, layout, n, k, b_ahead", [(4, "nk", 8, 1800, 0), (2, "kn", 3, 701, 0),
                                                             (8, "nk", 9, 1000, 1), (4, "kn", 16, 300, 0)])
def test_k_split_over_blocks_matches_float64_and_rearms_its_counters(k_split, layout, n, k, b_ahead):
    """config.k_split: a strip's chunks over k_split blocks (more blocks than chunks too: K = 300 has 3), each
    storing its partial sums, the last to arrive adding them in block order with bias, residual and ReLU; its
    counters back at zero after each launch, so a second launch on the same workspace is right again."""
    rng = np.random.default_rng(k + k_split)
    weight, bias, relu = random_weight_and_epilogue(rng, 37, k, 0.5, k_split, dense_row=True)
    config = BitmapTcConfig(warps_per_block=2, stages=2, scan_group=2, b_ahead=b_ahead, k_split=k_split)
    plan = make_bitmap_tc_plan(weight, n, "float16", layout, config, bias=bias, relu=relu, residual=True)
    assert plan.grid == (k_split, 3) and plan.max_batch == 1 and plan.name.count(f"k{k_split}") == 1
    arrays = [a for a, _ in plan.weight_arrays()] + [np.zeros(size, np.int32) for size in plan.workspace_sizes()]
    text, out_shape = render(plan).text, (37, n) if layout == "kn" else (n, 37)
    for seed in (1, 2):
        b = np.random.default_rng(seed).standard_normal((k, n) if layout == "kn" else (n, k))
        residual = np.random.default_rng(seed + 9).standard_normal(out_shape)
        out = _poisoned(out_shape, "float16")
        launch(text, plan.name, (*plan.grid, 1), plan.threads, _encode(b, "float16"), out, *arrays,
               np.asarray(plan.bias, np.float32), _encode(residual, "float16"), shared_bytes=plan.dynamic_shared_bytes)
        want = _reference(weight, b, layout, "float16", bias, False) + _decode(_encode(residual, "float16"), "float16")
        assert_matches(_decode(out, "float16"), np.maximum(want, 0) if relu else want, "float16")
        assert not arrays[-1].any()  # every strip's counter re-armed


@given(layout=st.sampled_from(["kn", "nk"]), n=st.sampled_from([8, 9, 16]), m=st.sampled_from([5, 16, 33]),
       k=st.sampled_from([64, 300, 700]), density=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
       dtype=st.sampled_from(["float16", "bfloat16"]), stages=st.sampled_from([2, 3]),
       scan_group=st.sampled_from([1, 2, 4]), l2_ahead=st.sampled_from([0, 0, 2]), seed=st.integers(0, 2 ** 16))
@settings(max_examples=12, deadline=None)
def test_a_gated_kernel_computes_silu_of_the_gate_times_up(layout, n, m, k, density, dtype, stages, scan_group,
                                                          l2_ahead, seed):
    """The Llama MLP's gate and up projections in one kernel: a warp decodes the same strip of G and of U, B
    shared, and the epilogue adds both sets of partial sums and multiplies; G and U of different patterns and
    buffer sizes (empty tiles in one, dense in the other), tails of M, K and N, batched; the plan's CPU executor
    alike."""
    rng = np.random.default_rng(seed)
    gate, _, _ = random_weight_and_epilogue(rng, m, k, density, seed, dense_row=True)
    up, _, _ = random_weight_and_epilogue(rng, m, k, min(1.0, density * 2 + 0.01), seed + 1)
    config = BitmapTcConfig(warps_per_block=2, stages=stages, scan_group=scan_group, l2_ahead=l2_ahead)
    plans = [make_bitmap_tc_plan(w, n, dtype, layout, config) for w in (gate, up)]
    plan = gated_bitmap_tc_plan(plans[0], None, plans[1], None)
    assert plan.name.endswith("_gated") and len(plan.weight_arrays()) == 4 and plan.sources == 2
    assert plan.bytes_read() == plans[0].bytes_read() + plans[1].bytes_read()
    b = rng.standard_normal((2, k, n) if layout == "kn" else (2, n, k))
    g, u = (_reference(w, b, layout, dtype, None, False) for w in (gate, up))
    want = g / (1 + np.exp(-g)) * u
    assert_matches(run_data_kernel(plan, b), want, dtype)
    x = _decode(_encode(b, dtype), dtype)  # the executor: the tiles' rounded values, X as given
    g, u = (_reference(w, x, layout, dtype, None, False) for w in (gate, up))
    assert np.allclose(execute_bitmap_tc(plan, x), g / (1 + np.exp(-g)) * u, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("n, layout, k", [(8, "nk", 4096), (16, "nk", 4096), (8, "kn", 4096), (8, "nk", 14336)])
def test_gated_kernels_assemble_without_spills(arch, n, layout, k):
    """Every proposed config a gated kernel takes (strips 1, scans of at most 4 tiles): two strips a warp, held
    to 128 registers a thread by min_blocks where shared memory takes more blocks."""
    rng = np.random.default_rng(1)
    dense = (rng.standard_normal((32, k)) * (rng.random((32, k)) < 0.5)).astype(np.float32)
    w = SparseMatrix.from_dense(dense)
    built = 0
    for config in bitmap_tc_candidates(n, layout, 32, k / 2, False, "float16", 132):
        if config.strips > 1 or config.scan_group > 4:
            continue
        plan = make_bitmap_tc_plan(w, n, "float16", layout, config, arch=arch)
        try:
            gated = gated_bitmap_tc_plan(plan, None, plan, None)
        except ValueError as err:  # sm_80: a block's shared memory
            assert arch == 80 and "a block has on sm_80" in str(err), str(err)
            continue
        source = render(gated)
        _assemble_without_spills_and_link(source, arch)
        used = int(re.search(r"Used (\d+) registers", _assemble(source.modules[0], arch))[1])
        assert used <= gated.register_cap, (config, used)
        built += 1
    assert built


def test_a_gated_kernel_refuses_plans_that_differ_or_carry_an_epilogue():
    rng = np.random.default_rng(1)
    w = SparseMatrix.from_dense(np.where(rng.random((16, 256)) < 0.3, rng.standard_normal((16, 256)), 0).astype(np.float32))
    plain = make_bitmap_tc_plan(w, 8, "float16", "nk")
    with pytest.raises(ValueError, match="differ in config"):
        gated_bitmap_tc_plan(plain, None, make_bitmap_tc_plan(w, 8, "float16", "nk", BitmapTcConfig(stages=3)), None)
    with pytest.raises(ValueError, match="differ in N"):
        gated_bitmap_tc_plan(plain, None, make_bitmap_tc_plan(w, 9, "float16", "nk"), None)
    with pytest.raises(ValueError, match="plain product"):
        gated_bitmap_tc_plan(plain, None, make_bitmap_tc_plan(w, 8, "float16", "nk", bias=np.ones(16)), None)
    with pytest.raises(ValueError, match="plan the gate and up with strips=1"):
        two = make_bitmap_tc_plan(w, 8, "float16", "nk", BitmapTcConfig(scan_group=2, strips=2))
        gated_bitmap_tc_plan(two, None, two, None)
    with pytest.raises(ValueError, match="scan_group <= 4"):
        eight = make_bitmap_tc_plan(w, 8, "float16", "nk", BitmapTcConfig(scan_group=8))
        gated_bitmap_tc_plan(eight, None, eight, None)
    with pytest.raises(ValueError, match="takes N >= 8, got N = 4"):
        four = make_bitmap_tc_plan(w, 4, "float16", "nk")
        gated_bitmap_tc_plan(four, None, four, None)
    assert densify_bitmap_tc(gated_bitmap_tc_plan(plain, None, plain, None), (), None) is None  # two weights, not W


@pytest.mark.parametrize("l2_ahead", [1, 3])
def test_chunks_prefetched_into_l2_ahead_leave_the_product_and_stay_inside_w(l2_ahead):
    """config.l2_ahead: the interpreter reads every prefetched address (one outside W's arrays fails); dense
    chunks of 4.5 KB take two rounds of lanes; a warp's last chunks have nothing ahead."""
    rng = np.random.default_rng(l2_ahead)
    weight, bias, relu = random_weight_and_epilogue(rng, 20, 1100, 1.0, l2_ahead, dense_row=True)
    plan = make_bitmap_tc_plan(weight, 8, "float16", "nk", BitmapTcConfig(2, 3, 4, l2_ahead), bias=bias, relu=relu)
    assert plan.stage_bytes > 32 * 128 and "prefetch.global.L2" in render(plan).modules[0]
    b = rng.standard_normal((8, 1100))
    assert_matches(run_data_kernel(plan, b), _reference(weight, b, "nk", "float16", bias, relu), "float16")


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_the_residual_is_added_before_relu(layout):
    rng = np.random.default_rng(3)
    dense = np.where(rng.random((20, 300)) < 0.3, rng.standard_normal((20, 300)), 0).astype(np.float32)
    weight, bias = SparseMatrix.from_dense(dense), rng.standard_normal(20)
    plan = make_bitmap_tc_plan(weight, 3, "bfloat16", layout, BitmapTcConfig(2, 3), bias=bias, relu=True,
                               residual=True)
    b = rng.standard_normal((300, 3) if layout == "kn" else (3, 300))
    residual = rng.standard_normal((20, 3) if layout == "kn" else (3, 20))
    got = run_data_kernel(plan, b, residual)
    want = np.maximum(_reference(weight, b, layout, "bfloat16", bias, False)
                      + _decode(_encode(residual, "bfloat16"), "bfloat16"), 0)
    assert plan.name.endswith("_res") and np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 2e-2


@pytest.mark.parametrize("m, k, n, config, dtype, batch", [
    (33, 264, 24, BitmapTcConfig(2, 2, 4, b_shared=1), "float16", 1),     # a spare warp in the last block
    (17, 1800, 64, BitmapTcConfig(2, 3, 1, b_shared=1), "bfloat16", 1),   # 8 n-tiles, 15 chunks through a ring of 3
    (70, 264, 40, BitmapTcConfig(2, 4, 4, b_shared=1, k_split=4), "float16", 1),  # blocks past the last chunk
    (5, 8, 33, BitmapTcConfig(2, 2, 2, b_shared=1), "bfloat16", 2),      # one column of tiles, B's rows past N
    (33, 520, 9, BitmapTcConfig(4, 3, 4, b_shared=1, k_split=8), "float16", 1)])
def test_b_staged_a_block_matches_float64(m, k, n, config, dtype, batch):
    """config.b_shared: each warp its own strip, B's chunk copied once a block (odd rows' pieces swapped, zeros
    past K), the warps' offset tables, the epilogue storing each warp's strip; with K split over blocks, blocks
    with no chunk still meet their strip's others."""
    rng = np.random.default_rng(m + k + n)
    weight, bias, relu = random_weight_and_epilogue(rng, m, k, 0.5, n, dense_row=True)
    plan = make_bitmap_tc_plan(weight, n, dtype, "nk", config, bias=bias, relu=relu)
    assert plan.warp_strips and plan.chunks_per_warp == plan.chunks_per_block
    b = rng.standard_normal((batch, n, k) if batch > 1 else (n, k))
    assert_matches(run_data_kernel(plan, b), _reference(weight, b, "nk", dtype, bias, relu), dtype)


def test_b_staged_a_block_adds_the_residual_and_refuses_what_it_cannot_take():
    rng = np.random.default_rng(3)
    weight, bias, _ = random_weight_and_epilogue(rng, 20, 136, 0.4, 3, dense_row=True)
    plan = make_bitmap_tc_plan(weight, 20, "float16", "nk", BitmapTcConfig(2, 2, 4, b_shared=1), bias=bias,
                               residual=True)
    b, residual = rng.standard_normal((20, 136)), rng.standard_normal((20, 20))
    rounded = _decode(_encode(residual, "float16"), "float16")
    assert_matches(run_data_kernel(plan, b, residual), _reference(weight, b, "nk", "float16", bias, False) + rounded,
                   "float16")
    with pytest.raises(ValueError, match="K a multiple of 8; here layout 'kn'"):
        make_bitmap_tc_plan(weight, 20, "float16", "kn", BitmapTcConfig(b_shared=1))
    with pytest.raises(ValueError, match="X as N x K .*here layout 'kn', K = 136"):  # N = 1: the grouped order too
        make_bitmap_tc_plan(weight, 1, "float16", "kn", BitmapTcConfig(b_shared=1))
    wide = SparseMatrix.from_dense(np.ones((16, 4096), dtype=np.float32))  # dense chunks: 4.5 KB a buffer
    with pytest.raises(ValueError, match="and 4 of B's chunk .16384 bytes at N = 64. need .* use fewer "
                                         "warps_per_block or stages$"):
        make_bitmap_tc_plan(wide, 64, "float16", "nk", BitmapTcConfig(16, 4, b_shared=1))
    odd = SparseMatrix.from_dense(np.eye(16, 300, dtype=np.float32))
    with pytest.raises(ValueError, match="K = 300: use b_shared=0"):
        make_bitmap_tc_plan(odd, 20, "float16", "nk", BitmapTcConfig(b_shared=1))
    with pytest.raises(ValueError, match="N <= 64 in one block with b_shared=1, got N = 65"):
        make_bitmap_tc_plan(weight, 65, "float16", "nk", BitmapTcConfig(b_shared=1))
    with pytest.raises(ValueError, match="got N = 17: use b_shared=1"):
        make_bitmap_tc_plan(weight, 17, "float16", "nk")
    with pytest.raises(ValueError, match="strips=2, b_ahead=1 does not fit"):
        BitmapTcConfig(scan_group=2, strips=2, b_ahead=1, b_shared=1)
    with pytest.raises(ValueError, match="l2_ahead=1 does not fit"):
        BitmapTcConfig(l2_ahead=1, b_shared=1)
    with pytest.raises(ValueError, match="scan_group must be 1, 2 or 4"):
        BitmapTcConfig(scan_group=8, b_shared=1)
    with pytest.raises(ValueError, match="b_shared must be 0 or 1"):
        BitmapTcConfig(b_shared=2)
    with pytest.raises(ValueError, match="plan the gate and up with b_shared=0"):
        shared = make_bitmap_tc_plan(weight, 8, "float16", "nk", BitmapTcConfig(b_shared=1))
        gated_bitmap_tc_plan(shared, None, shared, None)
    long = SparseMatrix.from_dense(np.eye(16, 128 * 70, dtype=np.float32))  # 70 chunks for one warp: its table
    assert make_bitmap_tc_plan(long, 8, "float16", "nk", BitmapTcConfig(2, 2, b_shared=1)).table_bytes == 288


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("n, layout, k", [(1, "nk", 4096), (8, "nk", 4096), (16, "nk", 14336), (8, "kn", 4096),
                                          (16, "kn", 4096), (5, "nk", 4095), (40, "nk", 4096), (64, "nk", 14336)])
def test_every_config_assembles_without_spills(arch, n, layout, k):
    rng = np.random.default_rng(0)
    dense = (rng.standard_normal((32, k)) * (rng.random((32, k)) < 0.5)).astype(np.float32)
    w = SparseMatrix.from_dense(dense)
    configs = {*bitmap_tc_candidates(n, layout, 32, k / 2, False, "float16", 132),
               *bitmap_tc_trials(n, layout, 32, k / 2, False, "float16", 132)}
    # B staged a block: its registers grow with the n-tiles, so N = 8 stands for 2-16 (CI's time) and 40 / 64
    # are the widths that could spill
    configs = {c for c in configs if not c.b_shared or n > 16 or (n, layout, k) == (8, "nk", 4096)}
    assert configs
    built = 0
    for config in configs:
        try:
            plan = make_bitmap_tc_plan(w, n, "float16", layout, config, bias=np.ones(32), relu=True, arch=arch,
                                       residual=True)
        except ValueError as err:  # the chooser drops these: over sm_80's shared memory or registers,
            why = str(err)  # or several strips below a full n-tile, or more blocks an SM than leave registers
            assert ("on sm_80" in why and arch == 80) or (config.strips > 1 and n < 8 and "strips=1" in why) \
                or (config.blocks_per_sm > 1 and "fewer blocks_per_sm" in why) \
                or (config.b_ahead and "use b_ahead=0" in why), why
            continue
        source = render(plan)
        _assemble_without_spills_and_link(source, arch)
        used = int(re.search(r"Used (\d+) registers", _assemble(source.modules[0], arch))[1])
        assert used <= plan.register_cap and (".minnctapersm" in source.modules[0]) == (plan.min_blocks > 1), \
            (config, used)
        built += 1
    assert built


def test_what_the_plan_refuses():
    w = SparseMatrix.from_dense(np.eye(16, 64, dtype=np.float32))
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        make_bitmap_tc_plan(w, 8, "float32", "nk")
    with pytest.raises(ValueError, match="N <= 16 in one block with b_shared=0"):
        make_bitmap_tc_plan(w, 17, "float16", "nk")
    with pytest.raises(ValueError, match="sm_80"):
        make_bitmap_tc_plan(w, 8, "float16", "nk", arch=75)
    long = SparseMatrix.from_dense(np.eye(16, 128 * 70, dtype=np.float32))  # 70 chunks: 35 a warp for 2 warps
    with pytest.raises(ValueError, match="use more warps_per_block"):
        make_bitmap_tc_plan(long, 8, "float16", "nk", BitmapTcConfig(warps_per_block=2))
    longest = SparseMatrix.from_dense(np.eye(16, 128 * 500, dtype=np.float32))  # 500 chunks: 32 a warp of 16
    with pytest.raises(ValueError, match="K <= 63488: use another mapping"):
        make_bitmap_tc_plan(longest, 8, "float16", "nk", BitmapTcConfig(warps_per_block=16))
    big = SparseMatrix.from_dense(np.ones((16, 4096), dtype=np.float32))  # dense chunks: 4.5 KB a buffer
    with pytest.raises(ValueError, match="over the 101376 a block has on sm_86"):
        make_bitmap_tc_plan(big, 16, "float16", "nk", BitmapTcConfig(warps_per_block=16, stages=2), arch=86)
    with pytest.raises(ValueError, match="stages"):
        BitmapTcConfig(stages=7)
    with pytest.raises(ValueError, match="scan_group"):
        BitmapTcConfig(scan_group=3)
    with pytest.raises(ValueError, match="l2_ahead"):
        BitmapTcConfig(l2_ahead=9)
    with pytest.raises(ValueError, match="strips must be"):
        BitmapTcConfig(strips=3)
    with pytest.raises(ValueError, match="scan_group x strips"):
        BitmapTcConfig(scan_group=4, strips=4)
    with pytest.raises(ValueError, match="b_ahead must be 0 or 1"):
        BitmapTcConfig(b_ahead=2)
    with pytest.raises(ValueError, match="B comes by scalar loads .layout 'kn', K = 64.: use b_ahead=0"):
        make_bitmap_tc_plan(w, 8, "float16", "kn", BitmapTcConfig(b_ahead=1))
    with pytest.raises(ValueError, match="k_split must be"):
        BitmapTcConfig(k_split=3)
    with pytest.raises(ValueError, match="takes one strip a warp"):
        BitmapTcConfig(k_split=2, strips=2)
    with pytest.raises(ValueError, match="plan the gate and up with k_split=1"):
        split = make_bitmap_tc_plan(w, 8, "float16", "nk", BitmapTcConfig(k_split=2))
        gated_bitmap_tc_plan(split, None, split, None)
    with pytest.raises(ValueError, match="blocks_per_sm must be"):
        BitmapTcConfig(blocks_per_sm=17)
    with pytest.raises(ValueError, match="5 blocks of 256 threads an SM leave 48 registers a thread, under the 64"):
        make_bitmap_tc_plan(w, 16, "float16", "nk", BitmapTcConfig(blocks_per_sm=5))
    assert ".minnctapersm 5" in render(make_bitmap_tc_plan(w, 8, "float16", "nk", BitmapTcConfig(blocks_per_sm=5))).text
    with pytest.raises(ValueError, match="takes N >= 8, got N = 4: use strips=1"):
        make_bitmap_tc_plan(w, 4, "float16", "nk", BitmapTcConfig(scan_group=2, strips=2))
    wide = SparseMatrix.from_dense(np.eye(16, 256, dtype=np.float32))  # B from L2 at N = 16: 154 registers
    with pytest.raises(ValueError, match="registers a thread on sm_80.*use fewer warps_per_block"):
        make_bitmap_tc_plan(wide, 16, "float16", "kn", BitmapTcConfig(warps_per_block=16), arch=80)
    assert make_bitmap_tc_plan(wide, 16, "float16", "kn", BitmapTcConfig(warps_per_block=16)).registers == 128


def test_a_nan_reaches_every_output_of_its_token_as_in_the_dense_product():
    dense = np.zeros((40, 256), np.float32)
    dense[3, 70] = 1.0  # the tiles around column 150 hold nothing: the tensor cores still multiply them
    for layout in ("nk", "kn"):
        plan = make_bitmap_tc_plan(SparseMatrix.from_dense(dense), 2, "float16", layout, BitmapTcConfig(2, 2))
        x = np.ones((2, 256))
        x[1, 150] = np.nan
        got = run_data_kernel(plan, x if layout == "nk" else x.T)
        got = got if layout == "nk" else got.T
        assert np.isnan(got[1]).all() and np.isfinite(got[0]).all() and got[0, 3] == 1.0


def test_the_buffer_follows_the_density_bucket_not_the_pattern():
    rng = np.random.default_rng(5)
    a, b = ((rng.standard_normal((64, 4096)) * (rng.random((64, 4096)) < 0.5)).astype(np.float32) for _ in range(2))
    plans = [make_bitmap_tc_plan(SparseMatrix.from_dense(x), 8, "float16", "nk") for x in (a, b)]
    assert plans[0].name == plans[1].name and render(plans[0]).text == render(plans[1]).text
    sparse = make_bitmap_tc_plan(SparseMatrix.from_dense(a * (rng.random(a.shape) < 0.2)), 8, "float16", "nk")
    assert sparse.buffer_units < plans[0].buffer_units
