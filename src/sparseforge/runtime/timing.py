"""Timing on the GPU: CUDA-graph replay of many calls (launch gaps shrink to what a graph-captured model
sees), medians of repeated replays, fresh random inputs rotated so no call reuses the previous one's.

Every timed replay is queued behind a spin kernel (the stream is "held"): the start event, the replay and the
stop event are all issued while the GPU still spins, so the time between the events is the GPU's alone. Without
the hold a host delay between recording the start event and launching the graph is counted as kernel time:
`sparseforge bench` measures while its prebuild threads compile the later cases, and a timing thread that loses
the GIL for a few milliseconds there recorded a 3 us layer at 400-1400 us (rn50 fp16
results of 2026-12-02, both for the generated kernels and for cuBLAS). A sample whose hold ended before its stop event was
issued may hold such a gap: it is dropped and the next hold is twice as long."""
from __future__ import annotations

import statistics
import sys

# recorded in every results file (bench.report.provenance): files without it were timed unheld, and those of
# `sparseforge bench` runs with a prebuild (prebuild_seconds set, 4fa8f14 to fc6bf5d) may hold host stalls
TIMING_PROTOCOL = "graph replay, stream held by a spin kernel (runtime/timing.py)"


def graph_time_us(fn, inputs: list, calls_per_graph: int = 20, repeats: int = 25) -> float:
    """Median microseconds per call of fn(x), x cycling through `inputs`, timed by graph replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in inputs:
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        # thread-local: `sparseforge bench` prebuilds later cases on other threads while it times one (compiling,
        # loading modules, packing W with torch ops on the GPU); in the default global mode their calls
        # invalidate this capture (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for i in range(calls_per_graph):
                fn(inputs[i % len(inputs)])
        graph.replay()
        torch.cuda.synchronize()
        return _median_of(lambda: graph.replay(), repeats, hold=True) / calls_per_graph
    finally:  # freed now, also on an error: a caller may unload what the graph launches (kernel_copies)
        graph.reset()


ROTATE_L2_MULTIPLE = 2    # copies of a weight together hold at least this many L2s (the protocol)
MAX_WEIGHT_COPIES = 256
# Up to this many tokens a product is memory-bound (decode), and a model of many layers streams each weight
# from HBM: the chooser times candidates and dense that way there (weights rotated), not with one copy held in
# the L2, which flatters whichever reads more bytes.
ROTATED_MAX_N = 64


def l2_bytes(device=None) -> int:
    """The GPU's L2 cache in bytes (torch reports it; H200: 60 MiB)."""
    import torch

    return int(getattr(torch.cuda.get_device_properties(device or torch.cuda.current_device()), "L2_cache_size",
                       0) or 60 << 20)


def weight_copies(weight_bytes: int, l2: int) -> int:
    """How many copies of a weight a timing loop rotates through so that every call streams it from HBM:
    together at least ROTATE_L2_MULTIPLE L2s, and at least 2 (the previous call's copy is never reused)."""
    if weight_bytes <= 0:
        return 2
    return max(2, min(MAX_WEIGHT_COPIES, -(-ROTATE_L2_MULTIPLE * l2 // weight_bytes)))


def rotating_graph_time_us(fn, operands: list, repeats: int = 25) -> float:
    """graph_time_us over `operands` (each call's (weight copy, input)), every operand once per replay at
    least: with enough copies (weight_copies) nothing the call reads is still in L2 from an earlier call."""
    calls = max(20, len(operands))
    calls -= calls % len(operands)
    return graph_time_us(fn, operands, calls_per_graph=calls, repeats=repeats)


def eager_time_us(fn, inputs: list, repeats: int = 25) -> float:
    """Median microseconds per call without a graph (host overhead included), for code graphs refuse."""
    import torch

    for x in inputs:
        fn(x)
    torch.cuda.synchronize()
    calls = len(inputs)
    return _median_of(lambda: [fn(x) for x in inputs], repeats) / calls


def host_time_us(fn, inputs: list, repeats: int = 15, stall_us: float = 20_000.0) -> float:
    """Median host microseconds per call of fn(x): the CPU time to issue it (argument checks, allocation,
    the launch), not the kernel's. The stream is held by a spin kernel (torch.cuda._sleep) while the calls
    are issued, so no call waits for the GPU; the spin must outlast them (stall_us; raise it where a
    call's host time times len(inputs) comes near it: the result is then flagged by a RuntimeError)."""
    import time

    import torch

    for x in inputs:
        fn(x)
    torch.cuda.synchronize()
    cycles = int(stall_us * _clock_khz() / 1e3)  # a clock above the one reported only shortens it: checked below
    times = []
    for _ in range(repeats):
        torch.cuda._sleep(cycles)
        slept = torch.cuda.Event()
        slept.record()
        start = time.perf_counter()
        for x in inputs:
            fn(x)
        elapsed = (time.perf_counter() - start) * 1e6
        if slept.query():  # the spin ended before the calls were issued: some of them may have waited
            raise RuntimeError(f"the stall ({stall_us:.0f} us) ended before {len(inputs)} calls were issued "
                               f"({elapsed:.0f} us): pass a larger stall_us or fewer inputs")
        torch.cuda.synchronize()
        times.append(elapsed / len(inputs))
    return statistics.median(times)


class TimingContention(RuntimeError):
    """A held measurement dropped too many samples: the host could not issue a replay within the longest hold.
    Not a refusal of graph capture: callers that fall back to eager timing on errors re-raise it (an eager
    figure taken on the same starved host would count the stalls the hold exists to exclude)."""


HOLD_START_US = 200.0         # the first hold of a timed replay; doubled after every sample it did not cover
                              # and kept for the rest of the measurement (halving it after a covered sample,
                              # f8ae4cb, dropped every other sample beside busy threads and gave up: H200,
                              # 2026-12-02)
HELD_SWITCH_INTERVAL_S = 5e-4  # the GIL switch interval while a held measurement runs (Python's default 5 ms
                               # lets each busy thread keep the GIL that long at every handoff: six threads
                               # stalled the timing thread past 100 ms a sample)
HOLD_MAX_US = 200_000.0       # a host that cannot issue three calls in 0.2 s is not timing anything
HOLD_RETRIES = 24             # dropped samples a measurement may have before it gives up (the hold reaches
                              # its cap after 10: a host stalled past that is not a timing host)


def _median_of(run, repeats: int, hold: bool = False, own_stream: bool = True) -> float:
    """Median over `repeats` samples of the GPU time between events around run(). hold=True (graph replay):
    each sample queued behind a spin kernel, kept only if the spin was still running when its stop event
    was issued (module docstring); eager timing leaves the host's time in, so it is not held.

    A held measurement runs on a non-blocking stream of its own (own_stream): the spin then delays nothing
    another thread issues on the default stream. On the legacy default stream a thread's synchronous copy to
    the host waited behind each 0.2 s spin, and on one H100 host this thread could not issue its replay until
    the spin ended, so every sample was dropped (TimingContention)."""
    if not hold:
        return _sample(run, repeats, hold_us=0.0)
    import torch

    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(min(switch_interval, HELD_SWITCH_INTERVAL_S))
    current = torch.cuda.current_stream()
    stream = torch.cuda.Stream() if own_stream else current  # torch's pool streams are non-blocking
    stream.wait_stream(current)  # what run() reads was written on the caller's stream
    try:
        with torch.cuda.stream(stream):
            return _sample(run, repeats, hold_us=HOLD_START_US)
    finally:
        current.wait_stream(stream)
        sys.setswitchinterval(switch_interval)


def _sample(run, repeats: int, hold_us: float) -> float:
    """_median_of's loop; hold_us 0: not held."""
    import torch

    times, dropped, hold = [], 0, hold_us > 0
    cycles_per_us = _clock_khz() / 1e3 if hold else 0.0
    while len(times) < repeats:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hold:
            torch.cuda._sleep(int(hold_us * cycles_per_us))
            released = torch.cuda.Event()
            released.record()
        start.record()
        run()
        stop.record()
        covered = not hold or not released.query()
        stop.synchronize()
        if covered:
            times.append(start.elapsed_time(stop) * 1e3)
            continue
        dropped += 1
        if dropped > HOLD_RETRIES:
            raise TimingContention(f"timing dropped {dropped} samples: the host took longer to issue a replay "
                                   f"than a {hold_us:.0f} us hold of the GPU (another thread holding the GIL, or "
                                   f"an overloaded CPU); measure with fewer threads busy")
        hold_us = min(2 * hold_us, HOLD_MAX_US)
    return statistics.median(times)


def _clock_khz() -> float:
    """The SM clock torch reports (kHz), for the spin's cycle count; a GPU running faster only shortens the
    hold, which the released-event check catches."""
    import torch

    return float(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 0)
                 or 2_000_000)


def tiny_kernel_us() -> float:
    """Cost of a one-element kernel in a graph: about the floor any launch pays."""
    import torch

    x = torch.zeros(1, device="cuda")
    return graph_time_us(lambda t: t.add_(0), [x], calls_per_graph=50)
