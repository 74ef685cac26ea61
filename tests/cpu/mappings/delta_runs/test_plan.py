"""The delta-runs format: W read back exactly (hypothesis over shapes, densities, tails, wide gaps), the same
format packed by torch ops where W lies (DeviceCsr), its bytes, and the refusals."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseforge import SparseMatrix
from sparseforge.formats.device import DeviceCsr
from sparseforge.mappings.delta_runs.plan import (DeltaRunsConfig, decoded, execute_delta_runs,
                                                  make_delta_runs_plan, make_delta_runs_plan_on_device)
from sparseforge.runtime.kernel import plan_key


def _matrix(m, k, density, seed, dtype="float16", skew=False):
    rng = np.random.default_rng(seed)
    keep = rng.random((m, k)) < density * (np.linspace(0.2, 1.8, k) if skew else 1)  # columns unevenly kept
    dense = (rng.standard_normal((m, k)) * keep).astype(np.float32)
    dense[seed % m] = 0  # an empty row
    if m > 1 and k > 2:
        dense[(seed + 1) % m] = 0
        dense[(seed + 1) % m, [0, k - 1]] = [1.5, -2.0]  # the widest gap a row can have
    return SparseMatrix.from_dense(dense).astype(dtype)


def _read_back(plan) -> np.ndarray:
    rows, cols, vals = decoded(plan)
    w = np.zeros((plan.M, plan.K))
    np.add.at(w, (rows.numpy(), cols.numpy()), vals.double().numpy())
    return w


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 70), k=st.integers(1, 1500), density=st.sampled_from([0.0, 0.002, 0.05, 0.5, 1.0]),
       seed=st.integers(0, 1000), dtype=st.sampled_from(["float16", "bfloat16"]), skew=st.booleans(),
       gap_bits=st.sampled_from([8, 4]))
def test_the_format_reads_back_to_w_and_the_device_packing_is_the_same(m, k, density, seed, dtype, skew, gap_bits):
    w = _matrix(m, k, density, seed, dtype, skew)
    config = DeltaRunsConfig(gap_bits=gap_bits)
    plan = make_delta_runs_plan(w, 1, dtype, "nk", config)
    assert np.array_equal(_read_back(plan), w.to_dense().astype(np.float64))
    f, per = plan.format, 32 // gap_bits
    slots = f.rows[:, 1]
    assert f.gap_bits == gap_bits and f.per_slot == per and f.slots == max(int(slots.sum()), 1)
    # every row's slots are exactly its entries (nonzeros and fillers) rounded up to whole slots
    assert 0 <= int(slots.sum()) * per - (w.nnz + f.fillers) < per * m
    assert f.gaps.dtype == np.int32 and f.bases.dtype == np.int16 and f.values.size == f.slots * per
    csr = DeviceCsr(torch.from_numpy(w.indptr.copy()), torch.from_numpy(w.indices.copy()),
                    torch.from_numpy(w.values.astype(np.float32)).to(getattr(torch, dtype)), w.shape, dtype)
    device = make_delta_runs_plan_on_device(csr, 1, dtype, "nk", config)
    on_host = device.format.on_host()
    for name in ("gaps", "rows", "bases"):
        assert np.array_equal(getattr(f, name), getattr(on_host, name)), name
    assert np.array_equal(f.values.astype(np.float32), on_host.values.astype(np.float32))
    assert device.format.values.dtype == getattr(torch, dtype) and device.format.gaps.dtype == torch.int32
    assert plan_key(plan, "toolkit") == plan_key(device, "toolkit") and plan.bytes_read() == device.bytes_read()


def test_4_bit_gaps_take_fillers_past_15_and_fewer_bytes_where_gaps_are_short():
    rng = np.random.default_rng(2)
    dense = (rng.standard_normal((256, 4096)) * (rng.random((256, 4096)) < 0.5)).astype(np.float32)
    dense[0] = 0
    dense[0, [3, 19, 40]] = 1.0  # gaps of 16 and 21: one filler each in 4 bits, none in 8
    w = SparseMatrix.from_dense(dense).astype("float16")
    eight, four = (make_delta_runs_plan(w, 1, "float16", "nk", DeltaRunsConfig(gap_bits=g)) for g in (8, 4))
    assert eight.format.fillers == 0 and four.format.fillers >= 2
    assert four.bytes_read() < 0.85 * eight.bytes_read()  # 2.5 bytes a nonzero against 3 at 50%
    assert eight.name != four.name  # different kernels


def test_bytes_are_three_a_nonzero_and_the_offsets_small():
    rng = np.random.default_rng(1)
    w = SparseMatrix.from_dense((rng.standard_normal((512, 4096)) * (rng.random((512, 4096)) < 0.5))
                                .astype(np.float32)).astype("float16")
    plan = make_delta_runs_plan(w, 1, "float16", "nk")
    per_weight = plan.bytes_read() / (512 * 4096)
    assert plan.format.fillers == 0 and abs(per_weight - (3 * w.nnz / (512 * 4096) + 72 / 4096)) < 0.002
    assert per_weight < 2 / 1.3  # at 50%: at least 1.3x fewer bytes than dense fp16


def test_the_reference_executor_computes_w_times_x_with_the_epilogue():
    w = _matrix(9, 700, 0.2, 4, "bfloat16")
    rng = np.random.default_rng(0)
    bias = rng.standard_normal(9)
    plan = make_delta_runs_plan(w, 1, "bfloat16", "kn", bias=bias, relu=True)
    x = rng.standard_normal((700, 1))
    want = np.maximum(w.to_dense().astype(np.float64) @ x + bias[:, None], 0)
    assert np.allclose(execute_delta_runs(plan, x), want)


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 9}, "N <= 8"),
    ({"dtype": "float32"}, "16-bit values"),
    ({"k": 70000}, "K <= 65536"),
    ({"k": 60000, "arch": 86}, "K <= 50688"),
    ({"k": 15000, "n": 8}, "K <= 14528"),
    ({"k": 14336, "n": 8, "config": DeltaRunsConfig(warps_per_block=16, ahead=8)}, "registers"),
])
def test_refusals_name_the_reason_and_the_fix(kwargs, message):
    k = kwargs.pop("k", 64)
    w = _matrix(4, k, 0.01, 0, "float32" if kwargs.get("dtype") == "float32" else "float16")
    options = {"n": 1, "dtype": "float16", **kwargs}
    with pytest.raises(ValueError, match=message):
        make_delta_runs_plan(w, options.pop("n"), options.pop("dtype"), "nk", **options)


@pytest.mark.parametrize("fields, error", [({"warps_per_block": 3}, "warps_per_block"), ({"ahead": 3}, "ahead"),
                                           ({"ahead": 2.0}, "int"), ({"gap_bits": 6}, "gap_bits"),
                                           ({"overlap": 1}, "bool"), ({"x_bits": 8}, "x_bits"), ({"ctas": -1}, "ctas")])
def test_configs_validate_themselves(fields, error):
    with pytest.raises((ValueError, TypeError), match=error):
        DeltaRunsConfig(**fields)
