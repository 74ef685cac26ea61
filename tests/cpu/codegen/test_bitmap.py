"""The bitmap decode kernel (codegen/bitmap.py) run by the PTX interpreter against float64 into
NaN-poisoned outputs, its NaN/inf semantics, and ptxas for sm_90 and sm_80 without spills."""
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseforge import SparseMatrix
from sparseforge.codegen import render
from sparseforge.plan.bitmap import BitmapConfig, make_bitmap_plan
from sparseforge.tune.space import decode

from .test_interpreted import (TOLERANCE, _decode, _encode, _reference, assert_matches,
                               random_weight_and_epilogue, run_data_kernel)
from .test_ptx import _assemble_without_spills_and_link


run_bitmap = run_data_kernel


@pytest.mark.parametrize("layout,n", [("kn", 5), ("nk", 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bitmap_kernel_adds_a_residual_before_relu(layout, n, dtype):
    rng = np.random.default_rng(8)
    dense = np.where(rng.random((6, 150)) < 0.2, rng.standard_normal((6, 150)), 0).astype(np.float32)
    dense[2] = 0
    weight, bias = SparseMatrix.from_dense(dense), rng.standard_normal(6)
    plan = make_bitmap_plan(weight, n, dtype, layout, BitmapConfig(2, 2), bias=bias, relu=True, residual=True)
    b = rng.standard_normal((2, 150, n) if layout == "kn" else (2, n, 150))
    residual = rng.standard_normal((2, 6, n) if layout == "kn" else (2, n, 6))
    got = run_bitmap(plan, b, residual)
    ref = np.maximum(_reference(weight, b, layout, dtype, bias, False) + _decode(_encode(residual, dtype), dtype), 0)
    assert np.isfinite(got).all() and plan.name.endswith("_res")
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= TOLERANCE[dtype]


@st.composite
def bitmap_kernels(draw):
    """Random decode problems: K across one and two steps (tails in the last word and step), empty rows,
    all-zero, one nonzero, dense rows; N 1..16 (nk at N = 1); every dtype; batch; bias and ReLU."""
    layout = draw(st.sampled_from(["kn", "nk"]))
    n = 1 if layout == "nk" else draw(st.integers(1, 16))
    config = BitmapConfig(draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4])))
    m, k = draw(st.integers(1, 5)), draw(st.sampled_from([1, 63, 64, 65, 200, 2047, 2048, 2100]))
    density = draw(st.sampled_from([0.0, 0.02, 0.3, 1.0]))
    return (layout, config, m, k, n, density, draw(st.integers(0, 2**16)),
            draw(st.sampled_from(["float32", "float16", "bfloat16"])), draw(st.integers(1, 2)))


@given(bitmap_kernels())
@settings(max_examples=30, deadline=None)
def test_random_bitmap_kernels_match_float64_reference(problem):
    layout, config, m, k, n, density, seed, dtype, batch = problem
    rng = np.random.default_rng(seed)
    weight, bias, relu = random_weight_and_epilogue(rng, m, k, density, seed, dense_row=True)
    plan = make_bitmap_plan(weight, n, dtype, layout, config, bias=bias, relu=relu)
    b = rng.standard_normal((batch, k, n) if layout == "kn" else (batch, n, k))
    got = run_bitmap(plan, b)
    ref = _reference(weight, b, layout, dtype, bias, relu)
    assert_matches(got, ref, dtype)


def test_nan_and_inf_reach_exactly_the_rows_that_use_their_column():
    """Only stored nonzeros are multiplied: a NaN at B[k] makes NaN the rows with a nonzero at k, an inf
    +-inf by the weight's sign; rows without one stay finite (dense would give 0 * NaN = NaN)."""
    dense = np.zeros((4, 130), np.float32)
    dense[0, [3, 70]] = [2.0, 1.0]
    dense[1, 70] = -1.0
    dense[2, [3, 129]] = [-0.5, 1.0]
    b = np.ones((130, 2))
    b[70, 0] = np.nan
    b[3, 1] = np.inf
    got = run_bitmap(make_bitmap_plan(SparseMatrix.from_dense(dense), 2, "float32", "kn", BitmapConfig(2, 2)), b)
    assert np.isnan(got[:2, 0]).all() and np.isfinite(got[2:, 0]).all()
    assert got[0, 1] == np.inf and got[2, 1] == -np.inf and np.isfinite(got[[1, 3], 1]).all()
    assert got[3].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_proposed_config_assembles_without_spills(arch, dtype):
    rng = np.random.default_rng(0)
    w = SparseMatrix.from_dense(np.where(rng.random((64, 4096)) < 0.1, rng.standard_normal((64, 4096)), 0)
                                .astype(np.float32))
    for n, layout in ((1, "kn"), (1, "nk"), (6, "kn"), (16, "kn")):
        for config in decode(n, layout):
            plan = make_bitmap_plan(w, n, dtype, layout, config, bias=np.ones(64), relu=True, arch=arch)
            _assemble_without_spills_and_link(render(plan), arch)


def test_source_has_no_atomics_and_walks_bits_from_the_highest():
    w = SparseMatrix.from_dense(np.eye(8, 300, dtype=np.float32))
    text = render(make_bitmap_plan(w, 4, "float16", config=BitmapConfig(4, 2))).text
    assert not re.search(r"^\s*(@%\w+ )?(atom|red)\.", text, re.M)
    assert "popc.b64" in text and text.count("shfl.sync.up.b32") == 5 and "bfind.u64" in text
