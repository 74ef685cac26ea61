"""The timing helpers that need no GPU: how many weight copies the rotating-weights protocol uses."""
import pytest

from sparseforge.runtime.timing import MAX_WEIGHT_COPIES, ROTATE_L2_MULTIPLE, weight_copies

L2 = 60 << 20


@pytest.mark.parametrize("weight_bytes", [1, 4096, 6 << 20, 33_554_432, 60 << 20, 117 << 20, 1 << 31])
def test_copies_together_exceed_the_l2_twice_and_are_never_one(weight_bytes):
    copies = weight_copies(weight_bytes, L2)
    assert copies >= 2  # the previous call's copy is never the next one's
    if copies < MAX_WEIGHT_COPIES:
        assert copies * weight_bytes >= ROTATE_L2_MULTIPLE * L2
        assert copies == 2 or (copies - 1) * weight_bytes < ROTATE_L2_MULTIPLE * L2  # no more than needed


def test_a_dense_llama_weight_needs_four_copies_and_a_90_percent_one_twenty():
    assert weight_copies(4096 * 4096 * 2, L2) == 4          # dense fp16 4096 x 4096: 33.5 MB
    assert weight_copies(4096 * 4096 // 10 * 4, L2) == 19   # 90% with 16-bit index + fp16 value: 6.7 MB


def test_tiny_weights_are_capped_and_empty_ones_still_rotate():
    assert weight_copies(16, L2) == MAX_WEIGHT_COPIES
    assert weight_copies(0, L2) == 2


class _FakeCuda:
    """torch.cuda as _median_of uses it, scripted: `released` says, sample by sample, whether the hold's spin
    had already ended when it was asked (after the stop event was issued); `elapsed` the ms each kept sample
    measured. `log` records every call in order, by event role (the n-th event of a sample: released, start,
    stop when held; start, stop when not)."""

    def __init__(self, released: list[bool], elapsed: list[float]):
        self.released, self.elapsed, self.sleeps, self.log = list(released), list(elapsed), [], []
        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                self.role = "timed" if enable_timing else "released"

            def record(self):
                cuda.log.append((self.role, "record"))

            def query(self):
                cuda.log.append((self.role, "query"))
                return cuda.released.pop(0)

            def synchronize(self):
                cuda.log.append((self.role, "synchronize"))

            def elapsed_time(self, other):
                return cuda.elapsed.pop(0)

        class Stream:
            made = 0

            def __init__(self, name=None):
                if name is None:
                    Stream.made += 1
                self.name = name or f"own{Stream.made}"

            def wait_stream(self, other):
                cuda.waits.append((self.name, other.name))

        class use_stream:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                self.before, cuda.current = cuda.current, self.stream

            def __exit__(self, *exc):
                cuda.current = self.before

        self.Event, self.Stream, self.stream = Event, Stream, use_stream
        self.current, self.waits, self.sleep_streams = Stream("caller"), [], []

    def current_stream(self):
        return self.current

    def _sleep(self, cycles):
        self.sleeps.append(cycles)
        self.sleep_streams.append(self.current.name)
        self.log.append(("stream", "sleep"))


@pytest.fixture
def fake_cuda(monkeypatch):
    import torch

    from sparseforge.runtime import timing

    def install(released, elapsed):
        fake = _FakeCuda(released, elapsed)
        monkeypatch.setattr(torch.cuda, "Event", fake.Event)
        monkeypatch.setattr(torch.cuda, "_sleep", fake._sleep, raising=False)
        for name in ("Stream", "stream", "current_stream"):
            monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
        monkeypatch.setattr(timing, "_clock_khz", lambda: 1_000_000.0)  # 1 GHz: 1000 cycles a microsecond
        return fake
    return install


def test_a_held_sample_is_asked_about_after_its_stop_event_and_before_waiting_for_it(fake_cuda):
    from sparseforge.runtime.timing import _median_of

    fake = fake_cuda(released=[False], elapsed=[1.0])
    _median_of(lambda: fake.log.append(("graph", "replay")), repeats=1, hold=True)
    # the spin and its event first, then start, the replay, stop; only then the question (asked before the
    # stop is waited for: afterwards every spin has ended and every sample would be dropped)
    assert fake.log == [("stream", "sleep"), ("released", "record"), ("timed", "record"), ("graph", "replay"),
                        ("timed", "record"), ("released", "query"), ("timed", "synchronize")]


def test_a_held_measurement_runs_on_a_stream_of_its_own_ordered_after_and_before_the_callers(fake_cuda):
    from sparseforge.runtime.timing import _median_of

    # another thread's work on the default stream must not queue behind the spin (nor the spin behind it)
    fake = fake_cuda(released=[False, False], elapsed=[1.0, 2.0])
    _median_of(lambda: None, repeats=2, hold=True)
    assert fake.sleep_streams == ["own1", "own1"]
    assert fake.waits == [("own1", "caller"), ("caller", "own1")]  # inputs ready first, results seen after
    assert fake.current.name == "caller"
    fake = fake_cuda(released=[False], elapsed=[1.0])
    _median_of(lambda: None, repeats=1, hold=True, own_stream=False)
    assert fake.sleep_streams == ["caller"]


def test_a_held_sample_the_hold_did_not_cover_is_dropped_and_the_hold_doubles_and_stays(fake_cuda):
    from sparseforge.runtime.timing import HOLD_START_US, _median_of

    # the second sample's spin ended before its stop event was issued: it is not timed, the next hold doubles
    # and stays doubled (a hold that relaxes after every covered sample is outrun again by the same stalls)
    fake = fake_cuda(released=[False, True, False, False], elapsed=[1.0, 2.0, 3.0])
    assert _median_of(lambda: None, repeats=3, hold=True) == pytest.approx(2000.0)  # median of 1, 2, 3 ms in us
    start = HOLD_START_US * 1000
    assert fake.sleeps == [start, start, 2 * start, 2 * start]
    assert not fake.released and not fake.elapsed


def test_a_held_measurement_shortens_the_gil_switch_interval_and_restores_it(fake_cuda):
    import sys

    from sparseforge.runtime.timing import HELD_SWITCH_INTERVAL_S, _median_of

    fake_cuda(released=[False, False], elapsed=[1.0, 2.0])
    seen, before = [], sys.getswitchinterval()
    _median_of(lambda: seen.append(sys.getswitchinterval()), repeats=2, hold=True)
    assert seen == [pytest.approx(HELD_SWITCH_INTERVAL_S)] * 2 and HELD_SWITCH_INTERVAL_S < before
    assert sys.getswitchinterval() == before
    fake_cuda(released=[True] * 100, elapsed=[])
    with pytest.raises(RuntimeError):
        _median_of(lambda: None, repeats=1, hold=True)
    assert sys.getswitchinterval() == before  # restored on the error path too


def test_a_host_that_never_issues_in_time_is_an_error_not_a_figure(fake_cuda):
    from sparseforge.runtime.timing import HOLD_MAX_US, HOLD_RETRIES, TimingContention, _median_of

    fake = fake_cuda(released=[True] * (HOLD_RETRIES + 1), elapsed=[])
    with pytest.raises(TimingContention, match="dropped .* samples"):
        _median_of(lambda: None, repeats=5, hold=True)
    assert not fake.released  # every one of the allowed drops was tried first
    assert fake.sleeps[-1] == HOLD_MAX_US * 1000 and max(fake.sleeps) == HOLD_MAX_US * 1000  # grown, capped
    assert issubclass(TimingContention, RuntimeError)


def test_eager_timing_is_not_held(fake_cuda):
    from sparseforge.runtime.timing import _median_of

    fake = fake_cuda(released=[], elapsed=[4.0, 5.0, 6.0])
    assert _median_of(lambda: None, repeats=3) == pytest.approx(5000.0)
    assert fake.sleeps == [] and ("released", "query") not in fake.log


def test_fallbacks_to_eager_timing_do_not_swallow_contention(monkeypatch):
    # a starved host must stop the measurement, not turn into an eager figure that counts the same stalls
    import importlib

    import torch

    from sparseforge.runtime import timing

    convert_module = importlib.import_module("sparseforge.nn.convert")  # the module, not nn's convert()

    def starved(*args, **kwargs):
        raise timing.TimingContention("timing dropped 25 samples")

    def eager(*args, **kwargs):
        raise AssertionError("fell back to eager timing")

    monkeypatch.setattr(timing, "graph_time_us", starved)
    monkeypatch.setattr(timing, "eager_time_us", eager)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    with pytest.raises(timing.TimingContention):
        convert_module.model_latency_us(torch.nn.Identity(), (torch.zeros(1),))
