"""CUDA-graph timing the decode prototypes share (bitmap_tiles_bench.py, bitmap_lanes_bench.py,
bitmap_walk_bench.py): the calls captured once in order, replayed, the median per call."""
import statistics

import torch


def graph_us(calls, reps=15):
    """median microseconds per call of a CUDA graph replaying `calls` in order."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in calls[:3]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(calls))
    return statistics.median(times)
