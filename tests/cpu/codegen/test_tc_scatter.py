"""The tc-scatter kernel (mappings/tc_scatter/render.py) run by the PTX interpreter (ldmatrix and mma included)
against float64 into NaN-poisoned outputs: random shapes, widths, layouts, dtypes, batches and epilogues; its
non-finite contract (dense within the tensor cores' blocks); ptxas for sm_90 and sm_80 without spills."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseforge import SparseMatrix
from sparseforge.codegen import render
from sparseforge.mappings.tc_scatter.plan import TcScatterConfig, make_tc_scatter_plan

from .test_interpreted import _decode, _encode, _reference, assert_matches, random_weight_and_epilogue, run_data_kernel
from .test_ptx import _assemble_without_spills_and_link


@st.composite
def problems(draw):
    """M past a strip, K past a chunk (and K % 8 != 0: B one element at a time), N across n-tiles and column
    groups; empty, one-nonzero, dense-row weights (random_weight_and_epilogue); every config family."""
    m, k = draw(st.sampled_from([1, 16, 17, 40])), draw(st.sampled_from([8, 64, 70, 136, 200]))
    n = draw(st.sampled_from([1, 2, 8, 9, 17, 33]))
    config = TcScatterConfig(warps_per_block=draw(st.sampled_from([2, 4])), ahead=draw(st.sampled_from([1, 2, 4])))
    return (m, k, n, draw(st.sampled_from(["kn", "nk"])), draw(st.sampled_from(["float16", "bfloat16"])), config,
            draw(st.sampled_from([0.05, 0.3, 1.0])), draw(st.integers(0, 2 ** 16)), draw(st.integers(1, 2)))


@given(problems())
@settings(max_examples=12, deadline=None)
def test_random_tc_scatter_kernels_match_float64(problem):
    m, k, n, layout, dtype, config, density, seed, batch = problem
    rng = np.random.default_rng(seed)
    weight, bias, relu = random_weight_and_epilogue(rng, m, k, density, seed, dense_row=True)
    plan = make_tc_scatter_plan(weight, n, dtype, layout, config, bias=bias, relu=relu)
    shape = (k, n) if layout == "kn" else (n, k)
    b = rng.standard_normal((batch, *shape) if batch > 1 else shape)
    assert_matches(run_data_kernel(plan, b), _reference(weight, b, layout, dtype, bias, relu), dtype)


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_the_residual_is_added_before_relu(layout):
    rng = np.random.default_rng(3)
    dense = np.where(rng.random((20, 100)) < 0.2, rng.standard_normal((20, 100)), 0).astype(np.float32)
    weight, bias = SparseMatrix.from_dense(dense), rng.standard_normal(20)
    plan = make_tc_scatter_plan(weight, 3, "float16", layout, TcScatterConfig(2, 2), bias=bias, relu=True, residual=True)
    b = rng.standard_normal((100, 3) if layout == "kn" else (3, 100))
    residual = rng.standard_normal((20, 3) if layout == "kn" else (3, 20))
    got = run_data_kernel(plan, b, residual)
    want = np.maximum(_reference(weight, b, layout, "float16", bias, False) + _decode(_encode(residual, "float16"),
                                                                                     "float16"), 0)
    assert plan.name.endswith("_res") and np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 5e-3


def test_a_nan_reaches_every_output_of_its_token_as_in_the_dense_product():
    dense = np.zeros((40, 200), np.float32)
    dense[3, 70] = 1.0  # strips 1 and 2 hold nothing near column 150: dense blocks still multiply it
    plan = make_tc_scatter_plan(SparseMatrix.from_dense(dense), 2, "float16", "nk", TcScatterConfig(2, 2))
    x = np.ones((2, 200))
    x[1, 150] = np.nan
    got = run_data_kernel(plan, x)
    assert np.isnan(got[1]).all() and np.isfinite(got[0]).all()


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("n, layout, config", [(1, "nk", TcScatterConfig(8, 2)), (16, "kn", TcScatterConfig(16, 2)),
                                               (32, "nk", TcScatterConfig(8, 4)), (64, "nk", TcScatterConfig(4, 4))])
def test_kernels_assemble_without_spills(n, layout, config, arch):
    rng = np.random.default_rng(0)
    dense = np.where(rng.random((300, 4100)) < 0.1, rng.standard_normal((300, 4100)), 0).astype(np.float32)
    plan = make_tc_scatter_plan(SparseMatrix.from_dense(dense), n, "bfloat16", layout, config, bias=np.ones(300),
                                relu=True, residual=True, arch=arch)
    _assemble_without_spills_and_link(render(plan), arch)
