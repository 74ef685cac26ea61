"""runtime/timing.py on the GPU: host_time_us measures the issuing of calls, not their kernels (a slow kernel
does not make it larger), and refuses a stall the calls outlast; graph_time_us is the GPU's time even while
other Python threads hold the GIL (bench's prebuild compiles beside the measuring thread), and its capture
survives another thread working on the GPU."""
import threading

import pytest
import torch

from sparseforge.runtime.timing import graph_time_us, host_time_us

pytestmark = [pytest.mark.gpu, pytest.mark.serial]  # times kernels: no other test may share the GPU


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


def test_graph_times_ignore_a_host_starved_by_busy_python_threads():
    x = torch.randn(1 << 16, device="cuda")
    quiet = graph_time_us(lambda t: t.add_(1), [x])
    stop = threading.Event()

    def busy():  # pure Python: holds the GIL for its switch interval (5 ms) at a time
        while not stop.is_set():
            sum(range(10_000))

    threads = [threading.Thread(target=busy, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        contended = graph_time_us(lambda t: t.add_(1), [x])
    finally:
        stop.set()
        for t in threads:
            t.join()
    # unheld, a sample spanning a lost GIL slice measured milliseconds for a few-microsecond graph
    assert contended < 1.5 * quiet + 1.0, (quiet, contended)


def test_graph_timing_survives_another_thread_working_on_the_gpu():
    """bench's prebuild packs W with torch ops on the GPU (allocations, copies to the host) beside the timing
    thread's capture: a global-mode capture was invalidated by them (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)."""
    x = torch.randn(1 << 16, device="cuda")
    stop, errors = threading.Event(), []

    def packing():
        try:
            while not stop.is_set():
                a = torch.arange(1 << 20, device="cuda", dtype=torch.float32)  # no RNG: its state is global
                int(torch.cumsum(a, 0)[-1].cpu().isfinite())  # a sync and a device-to-host copy
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    thread = threading.Thread(target=packing, daemon=True)
    thread.start()
    try:
        times = [graph_time_us(lambda t: t.add_(1), [x]) for _ in range(20)]
    finally:
        stop.set()
        thread.join()
    assert not errors and all(t > 0 for t in times), errors
