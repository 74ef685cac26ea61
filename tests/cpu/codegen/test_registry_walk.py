"""Every registered kernel family end to end on the CPU (mappings/registry.py): its hooks resolve, its
design space proposes a config for a small problem, the config plans, the plan renders, assembles with ptxas
for sm_90 and sm_80 (where ptxas is installed), and the PTX interpreter's run and the family's CPU reference
both match a float64 product; the cost model and the operand bytes answer for the plan. A family added to the
registry without a way to run its kernel here fails test_every_family_has_a_runner."""
from __future__ import annotations

import numpy as np
import pytest

from sparseforge import SparseMatrix
from sparseforge.codegen import render
from sparseforge.mappings import registry
from sparseforge.mappings.registry import CONV, FAMILIES, SPMM
from sparseforge.plan.conv import ConvGeometry
from sparseforge.runtime import PtxasCompiler
from sparseforge.tune.cost import estimate

from .test_conv import _reference as conv_reference
from .test_conv import run_conv, run_generated
from .test_interpreted import _reference, assert_matches, run_data_kernel, run_plan

# how the interpreter launches each family's kernel, as the runtime does; None: a composite, nothing of its own
RUNNERS = {"tile": run_plan, "csr": run_data_kernel, "csr-columns": run_data_kernel, "bitmap": run_data_kernel,
           "bitmap-tc": run_data_kernel,
           "tc-scatter": run_data_kernel, "delta-runs": run_data_kernel, "split-24": None, "conv-csr-columns": run_conv, "conv-tile": run_generated}
# small SpMM problems tried in turn until the family's space proposes a config that plans: (n, dtype, layout)
PROBLEMS = [(8, "float16", "kn"), (1, "float16", "nk"), (4, "bfloat16", "kn"), (24, "float32", "kn"), (32, "float16", "nk"),
            (128, "float16", "nk")]
HOOKS = ("config", "plan_class", "plan", "render", "estimate", "candidates", "trials", "execute", "operand_bytes",
         "sketch", "compile_seconds", "check", "verify", "dense_writer")


def _weight(m: int, k: int, seed: int) -> SparseMatrix:
    rng = np.random.default_rng(seed)
    dense = np.where(rng.random((m, k)) < 0.3, rng.standard_normal((m, k)), 0).astype(np.float32)
    dense[1] = 0  # an empty row
    return SparseMatrix.from_dense(dense)


def _spmm_plan(family, arch: int = 90):
    """(plan, W, bias) of the first small problem the family's space proposes a config for that plans."""
    w = _weight(32, 64, 1)  # M and K multiples of 16: split-24 takes them
    bias = np.linspace(-1, 1, 32)
    make = family.hook("plan")
    for n, dtype, layout in PROBLEMS:
        configs = family.hook("candidates")(n, layout, 32, w.nnz / 32, False, dtype, 132)
        for config in configs:
            try:
                return make(w.astype(dtype), n, dtype, layout, config, bias, False, arch), w, bias
            except ValueError:
                continue
    raise AssertionError(f"{family.name}: no proposed config plans any of {PROBLEMS}")


def _conv_plan(family, arch: int = 90):
    """(plan, W, bias) of a small convolution in the family's first proposed config that plans."""
    geometry = ConvGeometry.of((2, 4, 6, 6), 8, 3, padding=1)
    w = _weight(8, 4 * 9, 2)
    bias = np.linspace(-1, 1, 8)
    for config in family.hook("candidates")(geometry, w, True):
        try:
            return family.hook("plan")(w, geometry, "float32", config, bias, True, True, arch, False), w, bias
        except ValueError:
            continue
    raise AssertionError(f"{family.name}: no proposed config plans")


def test_every_family_has_a_runner_and_a_unique_name():
    assert sorted(RUNNERS) == sorted(f.name for f in FAMILIES)
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    for kind in (SPMM, CONV):  # a config names one family of each kind, and the cached-choice name finds it
        assert len(set(registry.config_classes(kind))) == len(registry.families(kind))
        for f in registry.families(kind):
            assert registry.family_recorded(f.choice_name, kind) is f
            assert registry.family_of(f.config_class(), kind) is f


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_hook_resolves(family):
    for part in HOOKS:
        path = getattr(family, part)
        if path is not None:
            assert callable(registry.resolve(path)), f"{family.name}.{part} = {path}"


def test_an_unregistered_config_is_refused_with_the_known_ones_named():
    with pytest.raises(TypeError, match="TileConfig.*CsrColumnsConfig.*got object"):
        registry.family_of(object())
    with pytest.raises(KeyError, match="known: tile"):
        registry.family("nope")


@pytest.mark.parametrize("family", registry.families(SPMM), ids=lambda f: f.name)
def test_each_spmm_family_end_to_end(family):
    plan, w, bias = _spmm_plan(family)
    assert registry.plan_family(plan) is family
    assert estimate(plan).us > 0
    traffic = family.hook("operand_bytes")(plan)
    assert 0 < traffic["floor_bytes"] <= traffic["fetched_bytes"]
    if family.render is None:  # a composite: its parts are families of their own
        with pytest.raises(TypeError, match="generates no kernel of its own"):
            render(plan)
        return
    source = render(plan)
    if family.verify is not None:
        family.hook("verify")(plan, w.astype(plan.dtype))
    # weight_in_code says whether the binary (so the kernel's cache key) depends on W's values
    doubled = family.hook("plan")(SparseMatrix.from_dense(2 * w.to_dense()).astype(plan.dtype), plan.N, plan.dtype,
                                  plan.layout, plan.config, bias, False, plan.arch)
    assert (render(doubled).text != source.text) == family.weight_in_code
    compiler = PtxasCompiler.available()
    if compiler is not None:
        for arch in (90, 80):
            again = plan if arch == plan.arch else family.hook("plan")(
                w.astype(plan.dtype), plan.N, plan.dtype, plan.layout, plan.config, bias, False, arch)
            assert compiler.compile(render(again).modules, arch)[:4] == b"\x7fELF"
    rng = np.random.default_rng(3)
    b = rng.standard_normal((plan.K, plan.N) if plan.layout == "kn" else (plan.N, plan.K))
    ref = _reference(w, b, plan.layout, plan.dtype, bias, False)
    assert_matches(RUNNERS[family.name](plan, b), ref, plan.dtype)
    exact = w.astype(plan.dtype).to_dense().astype(np.float64) @ (b if plan.layout == "kn" else b.T)  # W as planned
    exact = (exact + bias[:, None]) if plan.layout == "kn" else (exact.T + bias[None, :])
    cpu = family.hook("execute")(plan, b)
    assert np.linalg.norm(cpu - exact) <= 1e-6 * np.linalg.norm(exact)
    assert source.name == plan.name


@pytest.mark.parametrize("family", registry.families(CONV), ids=lambda f: f.name)
def test_each_convolution_family_end_to_end(family):
    plan, w, bias = _conv_plan(family)
    assert registry.plan_family(plan) is family
    assert estimate(plan).us > 0
    g = plan.geometry
    doubled = family.hook("plan")(SparseMatrix.from_dense(2 * w.to_dense()), g, plan.dtype, plan.config, bias, True,
                                  True, plan.arch, False)
    assert (render(doubled).text != render(plan).text) == family.weight_in_code
    compiler = PtxasCompiler.available()
    if compiler is not None:
        for arch in (90, 80):
            again = plan if arch == plan.arch else _conv_plan(family, arch)[0]
            assert compiler.compile(render(again).modules, arch)[:4] == b"\x7fELF"
    rng = np.random.default_rng(4)
    x = rng.standard_normal(g.input_shape)
    residual = rng.standard_normal(g.output_shape)
    w4 = w.to_dense().reshape(g.out_channels, g.channels // g.groups, *g.kernel)
    ref = conv_reference(x, w4, g, plan.dtype, bias, residual, True)
    assert_matches(RUNNERS[family.name](plan, x, residual), ref, plan.dtype)
    cpu = family.hook("execute")(plan, x, residual)
    assert np.linalg.norm(cpu - ref) <= 1e-5 * np.linalg.norm(ref)
