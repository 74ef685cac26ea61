"""Graph-replay timing with and without the stream held (runtime/timing.py), quiet and with busy Python
threads holding the GIL as bench's prebuild threads do: the evidence for the hold. Then beside a thread that
works on the GPU and copies to the host on the default stream (as a prebuild packing W does), held on the
current stream against held on a non-blocking stream of the timing's own (what runtime/timing.py does), which the
default stream's work neither waits for nor delays: on one H100 host the first dropped every sample (TimingContention).
Prints one JSON line.

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


def held_on(own_stream: bool, graph, calls) -> dict:
    """Held timing with the hold, the events and the replays on a non-blocking stream of the timing's own
    (what runtime/timing.py does) or on the current one; a measurement that gave up is a result too."""
    try:
        return {"held_us": timing._median_of(graph.replay, 25, hold=True, own_stream=own_stream) / calls}
    except timing.TimingContention as err:
        return {"held_us": None, "error": str(err)[:200]}


def beside_a_syncing_thread(graph, calls) -> dict:
    """The GPU test's packing loop (a kernel, then a copy to the host, on the default stream) in another thread
    while this one times: held on the current stream, then on a non-blocking stream of its own."""
    stop, errors = threading.Event(), []

    def packing():
        try:
            while not stop.is_set():
                a = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
                int(torch.cumsum(a, 0)[-1].cpu().isfinite())
        except Exception as err:  # noqa: BLE001 - reported in the result
            errors.append(repr(err)[:200])

    thread = threading.Thread(target=packing, daemon=True)
    thread.start()
    try:
        return {"current_stream": held_on(False, graph, calls), "own_stream": held_on(True, graph, calls),
                "thread_errors": errors}
    finally:
        stop.set()
        thread.join()


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
    result["syncing_thread"] = beside_a_syncing_thread(graph, calls)
    result["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
