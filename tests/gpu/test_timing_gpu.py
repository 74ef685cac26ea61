"""runtime/timing.py on the GPU: host_time_us measures the issuing of calls, not their kernels (a slow kernel
does not make it larger), and refuses a stall the calls outlast."""
import pytest
import torch

from sparseforge.runtime.timing import graph_time_us, host_time_us

pytestmark = pytest.mark.gpu


def test_host_time_counts_issuing_not_the_kernel():
    small = [torch.randn(64, device="cuda") for _ in range(16)]
    big = [torch.randn(4096, 4096, device="cuda") for _ in range(2)]
    cheap = host_time_us(lambda x: x.add_(1), small)
    heavy_gpu = graph_time_us(lambda x: x @ x, big)
    heavy_host = host_time_us(lambda x: x @ x, big * 8)
    assert 0 < cheap < 200 and 0 < heavy_host < 200
    assert heavy_gpu > 5 * heavy_host  # the matmul's kernel time is not in its host time


def test_a_stall_shorter_than_the_calls_is_refused():
    xs = [torch.randn(64, device="cuda") for _ in range(200)]
    with pytest.raises(RuntimeError, match="larger stall_us"):
        host_time_us(lambda x: x.add_(1), xs, repeats=2, stall_us=1.0)
