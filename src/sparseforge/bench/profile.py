"""Where a whole model's GPU time goes: the kernels one forward launches, read by torch.profiler (CUPTI).

A model's CUDA-graph latency is its kernels' device time plus the gaps between them. The per-layer times a
conversion measures cover only its layers, so a converted model that is slower than the sum of its layers
suggests (ResNet-50 fp16 channels_last at 95%: 329 us of layers in a 682 us forward, against 510 in 641 for
dense) needs the rest named: extra copies, layout conversions, launches that are not layers. This gives the
kernels per forward, their summed device time and the busiest kernels by name.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable


def kernel_breakdown(run: Callable[[], object], calls: int = 5, top: int = 15) -> dict:
    """What one call of run() puts on the GPU, averaged over `calls` eager calls after one warm-up call:
    kernels (and memory copies / sets) per call, their summed device microseconds per call, and the `top`
    names by device time (each with its launches and microseconds per call). Device durations do not depend
    on how the work was launched, so the eager calls stand for a graph replay of the same work; the replay's
    latency minus busy_us is the time the GPU sat between kernels."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    with torch.no_grad():
        run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                run()
            torch.cuda.synchronize()
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        entry = totals[event.name]
        entry[0] += 1
        entry[1] += float(event.time_range.elapsed_us())  # a device event's range is the kernel's own run
    return summarize_kernels(totals, calls, top)


def summarize_kernels(totals: dict, calls: int, top: int) -> dict:
    """totals: kernel name -> [launches, device us] over `calls` calls -> the per-call summary (see
    kernel_breakdown)."""
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])
    return {"calls": calls,
            "kernels_per_call": sum(n for n, _ in totals.values()) / calls,
            "busy_us_per_call": sum(us for _, us in totals.values()) / calls,
            "top": [{"name": name[:120], "launches_per_call": n / calls, "us_per_call": us / calls}
                    for name, (n, us) in ranked[:top]]}


def describe_breakdown(label: str, breakdown: dict, latency_us: float | None = None) -> str:
    """A few lines for a log: launches, busy time against the replay latency, the busiest kernels."""
    busy = breakdown["busy_us_per_call"]
    gap = "" if latency_us is None else f" of {latency_us:.1f} us replayed ({latency_us - busy:.1f} us between kernels)"
    lines = [f"{label}: {breakdown['kernels_per_call']:.0f} kernels a forward, {busy:.1f} us busy{gap}"]
    lines += [f"    {k['us_per_call']:8.1f} us {k['launches_per_call']:5.1f}x  {k['name'][:90]}" for k in breakdown["top"]]
    return "\n".join(lines)
