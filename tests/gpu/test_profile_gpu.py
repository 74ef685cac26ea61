"""bench/profile.py on the GPU: the profiler sees each kernel a call launches, with its device time."""
import pytest
import torch

from sparseforge.bench.profile import kernel_breakdown

pytestmark = [pytest.mark.gpu, pytest.mark.serial]  # times kernels: no other test may share the GPU


def test_a_call_of_two_kernels_counts_two_per_call_and_their_time():
    a = torch.randn(2048, 2048, device="cuda")
    b = torch.empty_like(a)

    def run():
        torch.mm(a, a, out=b)
        b.relu_()

    got = kernel_breakdown(run, calls=4)
    assert got["kernels_per_call"] == pytest.approx(2.0)
    assert got["busy_us_per_call"] > 20  # a 2048^3 fp32 product takes ~100 us without TF32
    assert {k["launches_per_call"] for k in got["top"]} == {1.0}
    assert got["top"][0]["us_per_call"] >= got["top"][1]["us_per_call"]
