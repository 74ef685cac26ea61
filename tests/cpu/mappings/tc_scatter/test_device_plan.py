"""scatter_format_on_device: the tc-scatter format built by torch ops where W lies, entry for entry and
record for record the host format (and the same kernel: its cache key), run on the CPU here."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseforge import SparseMatrix
from sparseforge.formats.device import DeviceCsr
from sparseforge.mappings.tc_scatter.plan import (TcScatterConfig, decode_dense, execute_tc_scatter,
                                                  make_tc_scatter_plan, make_tc_scatter_plan_on_device)
from sparseforge.runtime.kernel import plan_key, weight_data


def _device_csr(w: SparseMatrix) -> DeviceCsr:
    return DeviceCsr(torch.from_numpy(w.indptr.copy()), torch.from_numpy(w.indices.copy()),
                     torch.from_numpy(w.values.astype(np.float32)).to(getattr(torch, w.dtype)), w.shape, w.dtype)


def _matrix(m, k, density, seed, dtype="float16", skew=False):
    rng = np.random.default_rng(seed)
    keep = rng.random((m, k)) < density * (np.linspace(0.2, 1.8, k) if skew else 1)  # columns unevenly kept
    dense = (rng.standard_normal((m, k)) * keep).astype(np.float32)
    dense[seed % m] = 0  # an empty row
    return SparseMatrix.from_dense(dense).astype(dtype)


def _same(w, n, dtype, layout="nk", config=None):
    host = make_tc_scatter_plan(w, n, dtype, layout, config)
    device = make_tc_scatter_plan_on_device(_device_csr(w), n, dtype, layout, config)
    a, b = host.format, device.format.on_host()
    for name in ("records", "pos", "values", "chunks"):
        assert getattr(a, name).dtype == getattr(b, name).dtype and np.array_equal(getattr(a, name), getattr(b, name)), name
    assert (host.name, host.grid, host.bytes_read()) == (device.name, device.grid, device.bytes_read())
    assert plan_key(host, "toolkit") == plan_key(device, "toolkit")
    assert device.format.values.dtype == getattr(torch, dtype) and device.format.records.dtype == torch.int32
    return host, device


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 70), k=st.integers(1, 400), density=st.sampled_from([0.0, 0.02, 0.3, 1.0]),
       seed=st.integers(0, 1000), dtype=st.sampled_from(["float16", "bfloat16"]), skew=st.booleans())
def test_the_device_format_is_the_host_format(m, k, density, seed, dtype, skew):
    w = _matrix(m, k, density, seed, dtype, skew)
    host, device = _same(w, 8, dtype)
    assert np.array_equal(decode_dense(device), w.to_dense().astype(np.float64))
    x = np.random.default_rng(seed).standard_normal((8, k))
    assert np.array_equal(execute_tc_scatter(host, x), execute_tc_scatter(device, x))


def test_rounds_past_one_a_chunk_and_full_tiles():
    """A dense 64-row block: every tile full, chunks of several rounds."""
    _same(_matrix(64, 256, 1.0, seed=3), 16, "float16", config=TcScatterConfig(warps_per_block=4, ahead=4))


def test_a_record_with_its_top_bit_set_keeps_its_bits():
    """A tile beginning at a round's lane 31 sets bit 31 of the record: uint32 on the host, the same bits as
    int32 on the device."""
    host, _ = _same(_matrix(64, 256, 0.3, seed=0), 16, "float16")
    assert (host.format.records[:, 0] >= 2 ** 31).any()


def test_widths_share_one_format_and_the_kernel_reads_it_in_place():
    w = _device_csr(_matrix(32, 128, 0.3, seed=6))
    one = make_tc_scatter_plan_on_device(w, 1, "float16", "nk")
    eight = make_tc_scatter_plan_on_device(w, 8, "float16", "nk", TcScatterConfig(warps_per_block=4))
    assert one.format is eight.format
    arrays, _, _ = weight_data(one, "cpu")
    assert arrays[0] is one.format.values and arrays[1] is one.format.pos and arrays[2] is one.format.records


def test_refusals_are_the_host_plans():
    w = _matrix(8, 64, 0.3, seed=1)
    for dtype, arch in (("float32", 90), ("float16", 75)):
        with pytest.raises(ValueError) as host:
            make_tc_scatter_plan(w.astype(dtype), 8, dtype, "nk", arch=arch)
        with pytest.raises(ValueError) as device:
            make_tc_scatter_plan_on_device(_device_csr(w.astype(dtype)), 8, dtype, "nk", arch=arch)
        assert str(host.value) == str(device.value)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_host_format_built_by_torch_is_numpys(monkeypatch, dtype):
    """Where a GPU is present the chooser's host format is built there and brought back: the plumbing (dtypes,
    the host copy) run here with torch's CPU standing in for the GPU, against numpy's build."""
    from sparseforge.mappings.tc_scatter import plan as tcs

    w = _matrix(40, 300, 0.3, seed=9, dtype=dtype)
    want = tcs._build(w)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    got = tcs._built_on_gpu(w)
    for name in ("records", "pos", "values", "chunks"):
        assert getattr(got, name).dtype == getattr(want, name).dtype
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tcs._built_on_gpu(w) is None  # no GPU: numpy builds it
