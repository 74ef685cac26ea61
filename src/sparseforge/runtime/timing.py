"""Timing on the GPU: CUDA-graph replay of many calls (launch gaps shrink to what a graph-captured model
sees), medians of repeated replays, fresh random inputs rotated so no call reuses the previous one's."""
from __future__ import annotations

import statistics


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
    with torch.cuda.graph(graph):
        for i in range(calls_per_graph):
            fn(inputs[i % len(inputs)])
    graph.replay()
    torch.cuda.synchronize()
    return _median_of(lambda: graph.replay(), repeats) / calls_per_graph


def eager_time_us(fn, inputs: list, repeats: int = 25) -> float:
    """Median microseconds per call without a graph (host overhead included), for code graphs refuse."""
    import torch

    for x in inputs:
        fn(x)
    torch.cuda.synchronize()
    calls = len(inputs)
    return _median_of(lambda: [fn(x) for x in inputs], repeats) / calls


def _median_of(run, repeats: int) -> float:
    import torch

    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def tiny_kernel_us() -> float:
    """Cost of a one-element kernel in a graph: about the floor any launch pays."""
    import torch

    x = torch.zeros(1, device="cuda")
    return graph_time_us(lambda t: t.add_(0), [x], calls_per_graph=50)
