"""The bitmap decode kernel (mappings/bitmap/render.py) run by the PTX interpreter against float64 into
NaN-poisoned outputs, its NaN/inf semantics, and ptxas for sm_90 and sm_80 without spills."""
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseforge import SparseMatrix
from sparseforge.codegen import render
from sparseforge.mappings.bitmap.plan import BitmapConfig, make_bitmap_plan
from sparseforge.mappings.bitmap.space import decode

from .test_interpreted import (TOLERANCE, _decode, _encode, _reference, assert_matches,
                               random_weight_and_epilogue, run_data_kernel)
from .test_ptx import _assemble_without_spills_and_link


run_bitmap = run_data_kernel


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bitmap_kernel_adds_a_residual_before_relu(layout, dtype):
    rng = np.random.default_rng(8)
    dense = np.where(rng.random((6, 150)) < 0.2, rng.standard_normal((6, 150)), 0).astype(np.float32)
    dense[2] = 0
    weight, bias = SparseMatrix.from_dense(dense), rng.standard_normal(6)
    config = BitmapConfig(warps_per_block=2, rows_per_warp=2, unroll=2)
    plan = make_bitmap_plan(weight, 1, dtype, layout, config, bias=bias, relu=True, residual=True)
    b = rng.standard_normal((2, 150, 1) if layout == "kn" else (2, 1, 150))
    residual = rng.standard_normal((2, 6, 1) if layout == "kn" else (2, 1, 6))
    got = run_bitmap(plan, b, residual)
    ref = np.maximum(_reference(weight, b, layout, dtype, bias, False) + _decode(_encode(residual, dtype), dtype), 0)
    assert np.isfinite(got).all() and plan.name.endswith("_res")
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= TOLERANCE[dtype]


@st.composite
def bitmap_kernels(draw):
    """Random decode problems: K within one word of every lane and across several (tails in the last word;
    K es not a multiple of 16, so x is staged in narrower pieces), empty, all-zero, one-nonzero and dense rows
    (a full 1024-value block), M not a multiple of the rows a block takes; every dtype; batch; bias, ReLU."""
    layout = draw(st.sampled_from(["kn", "nk"]))
    config = BitmapConfig(warps_per_block=draw(st.sampled_from([1, 2])), rows_per_warp=draw(st.sampled_from([1, 2, 4])),
                          unroll=draw(st.sampled_from([1, 2, 4])))
    m, k = draw(st.integers(1, 6)), draw(st.sampled_from([1, 7, 31, 33, 200, 1023, 1024, 1025, 2100]))
    density = draw(st.sampled_from([0.0, 0.02, 0.3, 1.0]))
    return (layout, config, m, k, density, draw(st.integers(0, 2**16)),
            draw(st.sampled_from(["float32", "float16", "bfloat16"])), draw(st.integers(1, 2)))


@given(bitmap_kernels())
@settings(max_examples=25, deadline=None)
def test_random_bitmap_kernels_match_float64_reference(problem):
    layout, config, m, k, density, seed, dtype, batch = problem
    rng = np.random.default_rng(seed)
    weight, bias, relu = random_weight_and_epilogue(rng, m, k, density, seed, dense_row=True)
    plan = make_bitmap_plan(weight, 1, dtype, layout, config, bias=bias, relu=relu)
    b = rng.standard_normal((batch, k, 1) if layout == "kn" else (batch, 1, k))
    got = run_bitmap(plan, b)
    ref = _reference(weight, b, layout, dtype, bias, relu)
    assert_matches(got, ref, dtype)


def test_nan_and_inf_reach_exactly_the_rows_that_use_their_column():
    """Only stored nonzeros are multiplied: a NaN at x[k] makes NaN the rows with a nonzero at k, an inf
    +-inf by the weight's sign; rows without one stay finite (dense would give 0 * NaN = NaN)."""
    dense = np.zeros((4, 1100), np.float32)
    dense[0, [3, 1070]] = [2.0, 1.0]
    dense[1, 1070] = -1.0
    dense[2, [3, 129]] = [-0.5, 1.0]
    config = BitmapConfig(warps_per_block=2, rows_per_warp=1, unroll=2)
    plan = make_bitmap_plan(SparseMatrix.from_dense(dense), 1, "float32", "kn", config)
    b = np.ones((2, 1100, 1))
    b[0, 1070, 0] = np.nan
    b[1, 3, 0] = np.inf
    got = run_bitmap(plan, b)[..., 0]
    assert np.isnan(got[0, :2]).all() and np.isfinite(got[0, 2:]).all()
    assert got[1, 0] == np.inf and got[1, 2] == -np.inf and np.isfinite(got[1, [1, 3]]).all()
    assert got[:, 3].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_proposed_config_assembles_without_spills(arch, dtype):
    rng = np.random.default_rng(0)
    k = 4096 if dtype == "float32" else 14336  # the largest Llama K that fits shared memory in 16 bits
    w = SparseMatrix.from_dense(np.where(rng.random((64, k)) < 0.1, rng.standard_normal((64, k)), 0)
                                .astype(np.float32))
    for layout in ("kn", "nk"):
        for config in decode(1, layout):
            try:
                plan = make_bitmap_plan(w, 1, dtype, layout, config, bias=np.ones(64), relu=True, arch=arch)
            except ValueError as err:  # 8 warps of fp32 buffers past 48 KB: refused, named
                assert "shared memory" in str(err) and dtype == "float32"
                continue
            _assemble_without_spills_and_link(render(plan), arch)


def test_source_has_no_atomics_and_walks_bits_from_the_highest():
    w = SparseMatrix.from_dense(np.eye(8, 3000, dtype=np.float32))
    text = render(make_bitmap_plan(w, 1, "float16", config=BitmapConfig(warps_per_block=4, rows_per_warp=2,
                                                                         unroll=2))).text
    assert not re.search(r"^\s*(@%\w+ )?(atom|red)\.", text, re.M)
    # three words a lane: one scan (5 shuffles up) and two warp barriers each
    assert text.count("shfl.sync.up.b32") == 15 and text.count("bar.warp.sync") == 6 and "bfind.u32" in text
