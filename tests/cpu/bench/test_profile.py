"""bench/profile.py's summary of profiled kernels (the profiling itself needs a GPU: tests/gpu)."""
import pytest

from sparseforge.bench.profile import describe_breakdown, kernel_breakdown, summarize_kernels


def test_kernels_are_summed_per_call_and_ranked_by_device_time():
    totals = {"copy": [6, 3.0], "conv_a": [3, 30.0], "relu": [9, 18.0]}
    got = summarize_kernels(totals, calls=3, top=2)
    assert got["calls"] == 3 and got["kernels_per_call"] == 6 and got["busy_us_per_call"] == pytest.approx(17.0)
    assert [k["name"] for k in got["top"]] == ["conv_a", "relu"]
    assert got["top"][1] == {"name": "relu", "launches_per_call": 3, "us_per_call": 6.0}
    text = describe_breakdown("converted", got, latency_us=20.0)
    assert "6 kernels a forward, 17.0 us busy of 20.0 us replayed (3.0 us between kernels)" in text
    assert "conv_a" in text.splitlines()[1]


def test_at_least_one_call_is_profiled():
    with pytest.raises(ValueError, match="at least 1"):
        kernel_breakdown(lambda: None, calls=0)
