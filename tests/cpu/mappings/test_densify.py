"""Families that can write W dense from the kernel's own device arrays (mappings.registry densify): W comes
back exactly, for every layout of the arrays (16- and 32-bit column indices, empty rows, padding slots), so a
dense prefill needs no other copy of W."""
import numpy as np
import pytest
import torch

from sparseforge import SparseMatrix
from sparseforge.mappings.csr.plan import CsrColumnsConfig, CsrConfig, make_csr_plan
from sparseforge.formats.device import DeviceCsr
from sparseforge.mappings.registry import families, plan_family
from sparseforge.mappings.delta_runs.plan import (DeltaRunsConfig, make_delta_runs_plan,
                                                  make_delta_runs_plan_on_device)
from sparseforge.mappings.bitmap_tc.plan import make_bitmap_tc_plan, make_bitmap_tc_plan_on_device
from sparseforge.mappings.tc_scatter.plan import make_tc_scatter_plan, make_tc_scatter_plan_on_device
from sparseforge.runtime.kernel import weight_data


def _matrix(m, k, density, seed, empty_rows=()):
    rng = np.random.default_rng(seed)
    dense = (rng.standard_normal((m, k)) * (rng.random((m, k)) < density)).astype(np.float32)
    dense[list(empty_rows)] = 0
    return SparseMatrix.from_dense(dense)


@pytest.mark.parametrize("m, k, density, config, layout", [
    (7, 96, 0.3, CsrConfig(), "nk"),                      # 16-bit column indices
    (4, 60_000, 0.002, CsrConfig(), "nk"),                # 16-bit indices past 32767 (stored as int16)
    (33, 70_000, 0.001, CsrConfig(), "nk"),               # K over 65536: 32-bit indices
    (16, 200, 0.5, CsrColumnsConfig(), "kn"),             # csr-columns keeps 32 bits
    (5, 8, 0.0, CsrConfig(), "nk"),                       # nothing stored
    (64, 640, 0.05, CsrConfig(stage_b=True, columns=8, ctas=132), "nk"),
])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_csr_arrays_give_w_back(m, k, density, config, layout, dtype):
    w = _matrix(m, k, density, seed=m + k, empty_rows=(0, m - 1))
    n = 8 if layout == "nk" else 16
    plan = make_csr_plan(w, n, dtype, layout, config)
    arrays, _, _ = weight_data(plan, "cpu")
    out = torch.full((m, k), float("nan"), dtype=getattr(torch, dtype))
    assert plan_family(plan).hook("densify")(plan, arrays, out) is out
    want = torch.from_numpy(w.astype(dtype).to_dense().astype(np.float32)).to(out.dtype)
    assert torch.equal(out, want)


@pytest.mark.parametrize("m, k, density", [
    (16, 64, 0.3),      # one strip, one chunk
    (33, 200, 0.5),     # row and column tails
    (40, 640, 0.02),    # empty tiles and chunks
    (20, 130, 1.0),     # full tiles: rounds past one a chunk
    (5, 8, 0.0),        # nothing stored
    (70, 1000, 0.7),
    (3, 3000, 0.002),   # gaps over 255 (delta-runs' fillers)
])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("built", ["host", "device"])
@pytest.mark.parametrize("family", ["tc-scatter", "delta-runs", "delta-runs 4-bit", "bitmap-tc", "bitmap-tc kn"])
def test_16_bit_decode_arrays_give_w_back(m, k, density, dtype, built, family):
    w = _matrix(m, k, density, seed=m + k, empty_rows=(m - 1,)).astype(dtype)
    layout = "kn" if family.endswith(" kn") else "nk"  # bitmap-tc's natural column order, else its grouped
    family = family.removesuffix(" kn")
    n, config = (8, None) if family in ("tc-scatter", "bitmap-tc") else \
        (1, DeltaRunsConfig(gap_bits=4 if "4" in family else 8))
    host, device = {"tc-scatter": (make_tc_scatter_plan, make_tc_scatter_plan_on_device),
                    "bitmap-tc": (make_bitmap_tc_plan, make_bitmap_tc_plan_on_device)}.get(
        family, (make_delta_runs_plan, make_delta_runs_plan_on_device))
    if built == "host":
        plan = host(w, n, dtype, layout, config)
    else:  # the format made by torch ops where W lies (here the CPU), as a GPU layer packs it
        csr = DeviceCsr(torch.from_numpy(w.indptr.copy()), torch.from_numpy(w.indices.copy()),
                        torch.from_numpy(w.values.astype(np.float32)).to(getattr(torch, dtype)), w.shape, dtype)
        plan = device(csr, 1 if family != "bitmap-tc" else n, dtype, layout, config)
    arrays, _, _ = weight_data(plan, "cpu")
    out = torch.full((m, k), float("nan"), dtype=getattr(torch, dtype))
    assert plan_family(plan).hook("densify")(plan, arrays, out) is out
    assert torch.equal(out, torch.from_numpy(w.to_dense().astype(np.float32)).to(out.dtype))


def test_densify_is_declared_only_where_the_arrays_hold_w():
    for family in families():
        assert family.densify is None or not family.weight_in_code, family.name
