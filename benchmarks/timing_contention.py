"""Graph-replay timing with and without the stream held (runtime/timing.py), quiet and with busy Python
threads holding the GIL as bench's prebuild threads do: the evidence for the hold. Prints one JSON line.

    python benchmarks/timing_contention.py [threads]
"""
import json
import sys
import threading

import torch

from sparseforge.runtime import timing


def graph_of(fn, x, calls=20):
    fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    return graph, calls


def both(graph, calls):
    return {"held_us": timing._median_of(graph.replay, 25, hold=True) / calls,
            "unheld_us": timing._median_of(graph.replay, 25, hold=False) / calls}


def main() -> int:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    x = torch.randn(1 << 16, device="cuda")
    graph, calls = graph_of(lambda t: t.add_(1), x)
    result = {"kernel": "add_ on 65536 fp32, 20 a graph", "quiet": both(graph, calls)}
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            sum(range(10_000))

    pool = [threading.Thread(target=busy, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    try:
        result[f"busy_threads_{threads}"] = both(graph, calls)
    finally:
        stop.set()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
