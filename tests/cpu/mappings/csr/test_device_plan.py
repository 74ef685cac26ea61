"""make_csr_plan_on_device: the csr plan packed by torch ops where W lies, slot for slot the plan
make_csr_plan builds on the host (and the same kernel: its cache key), run on the CPU here (the packer is
torch, any device); weight_data takes its arrays as they are, a fresh copy only when asked."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseforge import SparseMatrix
from sparseforge.formats.device import DeviceCsr
from sparseforge.mappings.csr.plan import (CsrColumnsConfig, CsrConfig, execute_csr, make_csr_plan,
                                           make_csr_plan_on_device)
from sparseforge.mappings.registry import families
from sparseforge.runtime.kernel import plan_key, weight_data


def _device_csr(w: SparseMatrix) -> DeviceCsr:
    dtype = getattr(torch, w.dtype)
    return DeviceCsr(torch.from_numpy(w.indptr.copy()), torch.from_numpy(w.indices.copy()),
                     torch.from_numpy(w.values.astype(np.float32)).to(dtype), w.shape, w.dtype)


def _matrix(m, k, density, seed, dtype="float16"):
    rng = np.random.default_rng(seed)
    dense = (rng.standard_normal((m, k)) * (rng.random((m, k)) < density)).astype(np.float32)
    dense[seed % m] = 0  # an empty row
    return SparseMatrix.from_dense(dense).astype(dtype)


def _same_plan(w, n, dtype, layout, config, **options):
    host = make_csr_plan(w, n, dtype, layout, config, **options)
    device = make_csr_plan_on_device(_device_csr(w).astype(dtype), n, dtype, layout, config, **options)
    cols, values = device.host_arrays()
    assert np.array_equal(host.rows, device.rows)
    assert host.cols.dtype == cols.dtype and np.array_equal(host.cols, cols)
    assert np.array_equal(host.values, values)  # float32 on the host: the kernel dtype's values, exactly
    assert (host.nnz, host.slots, host.name, host.grid) == (device.nnz, device.slots, device.name, device.grid)
    assert plan_key(host, "toolkit") == plan_key(device, "toolkit")  # one kernel serves both
    assert isinstance(device.cols, torch.Tensor) and device.values.dtype == getattr(torch, dtype)
    return host, device


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 300), density=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
       seed=st.integers(0, 1000), dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
       config=st.sampled_from([CsrConfig(), CsrConfig(lanes_per_row=8, columns=4),
                               CsrConfig(stage_b=True, columns=8, ctas=4, prefetch=True)]))
def test_the_device_plan_is_the_host_plan(m, k, density, seed, dtype, config):
    w = _matrix(m, k, density, seed, dtype)
    host, device = _same_plan(w, 4, dtype, "nk", config)
    x = np.random.default_rng(seed).standard_normal((4, k))
    assert np.array_equal(execute_csr(host, x), execute_csr(device, x))


@pytest.mark.parametrize("k, config, layout, index", [
    (60_000, CsrConfig(), "nk", np.uint16),        # 16-bit indices past 32767 (int16 on the device)
    (70_000, CsrConfig(), "nk", np.int32),         # K over 65536: 32-bit
    (300, CsrColumnsConfig(columns=2), "kn", np.int32),  # csr-columns keeps 32 bits
])
def test_index_widths(k, config, layout, index):
    host, device = _same_plan(_matrix(5, k, 0.002 if k > 1000 else 0.2, seed=7), 8, "float16", layout, config,
                              bias=np.linspace(-1, 1, 5), relu=True)
    assert host.cols.dtype == index


def test_refusals_are_the_host_plans():
    w = _matrix(8, 64, 0.3, seed=1)
    for config, layout, n in [(CsrColumnsConfig(), "nk", 8), (CsrConfig(stage_b=True, columns=8, ctas=4), "nk", 16)]:
        with pytest.raises(ValueError) as host:
            make_csr_plan(w, n, "float16", layout, config)
        with pytest.raises(ValueError) as device:
            make_csr_plan_on_device(_device_csr(w), n, "float16", layout, config)
        assert str(host.value) == str(device.value)


def test_weight_data_takes_device_arrays_as_they_are():
    w = _matrix(6, 60_000, 0.002, seed=2)
    plan = make_csr_plan_on_device(_device_csr(w), 4, "float16", "nk", CsrConfig())
    arrays, pointers, _ = weight_data(plan, "cpu")
    assert arrays[0] is plan.values and arrays[1] is plan.cols  # no second copy of W
    assert arrays[1].dtype == torch.int16 and torch.equal(arrays[2], torch.from_numpy(plan.rows))
    fresh, _, _ = weight_data(plan, "cpu", fresh=True)  # a timing copy streams its own bytes
    assert fresh[0].data_ptr() != plan.values.data_ptr() and torch.equal(fresh[0], plan.values)
    assert fresh[1].data_ptr() != plan.cols.data_ptr() and torch.equal(fresh[1], plan.cols)
    host = make_csr_plan(w, 4, "float16", "nk", CsrConfig())
    assert torch.equal(weight_data(host, "cpu")[0][1], arrays[1])  # uint16 uploaded as the same int16 bits


def test_weight_data_refuses_a_device_array_of_another_dtype():
    w = _matrix(6, 64, 0.2, seed=2)
    plan = make_csr_plan_on_device(_device_csr(w), 4, "float16", "nk", CsrConfig())
    wrong = make_csr_plan_on_device(_device_csr(w), 4, "float16", "nk", CsrConfig())
    object.__setattr__(wrong, "values", plan.values.float())
    with pytest.raises(TypeError, match="torch.float32 where the kernel reads torch.float16"):
        weight_data(wrong, "cpu")


def test_device_packers_are_declared_only_where_w_is_data():
    declared = [f.name for f in families() if f.device_plan]
    assert declared and all(not f.weight_in_code for f in families() if f.device_plan)


def test_plans_of_one_device_matrix_share_its_arrays():
    """A layer's kernels at several widths read one device copy of W (the packing is keyed by index width and
    dtype, which every csr config of the matrix shares)."""
    w = _device_csr(_matrix(12, 200, 0.2, seed=4))
    one = make_csr_plan_on_device(w, 1, "float16", "nk", CsrConfig())
    eight = make_csr_plan_on_device(w, 8, "float16", "nk", CsrConfig(lanes_per_row=8, columns=8))
    assert one.cols is eight.cols and one.values is eight.values
    wider = make_csr_plan_on_device(w, 8, "float32", "nk", CsrConfig())  # another dtype: its own values
    assert wider.values is not one.values and wider.values.dtype == torch.float32


def test_host_plans_of_one_matrix_share_its_arrays():
    """The chooser plans every csr candidate of a layer: they read one host packing of W (per index width)."""
    w = _matrix(12, 200, 0.2, seed=5)
    one = make_csr_plan(w, 1, "float16", "nk", CsrConfig())
    staged = make_csr_plan(w, 8, "float16", "nk", CsrConfig(stage_b=True, columns=8, ctas=4))
    columns = make_csr_plan(w, 16, "float16", "kn", CsrColumnsConfig())  # 32-bit indices: its own
    assert one.cols is staged.cols and one.values is staged.values
    assert columns.cols is not one.cols and columns.cols.dtype == np.int32
    assert np.array_equal(columns.cols.astype(np.int64), one.cols.astype(np.int64))
