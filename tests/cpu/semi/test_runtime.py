"""Linear24Runtime's decisions on the CPU, cuSPARSELt, the GEMV and the timer replaced by recording fakes: decode
widths time each path over copies of what it reads (rotated through HBM), pinned widths time nothing, and the
copies of W no chosen path reads are released and no longer counted."""
import pytest
import torch

from sparseforge.prune import nm_mask
from sparseforge.runtime import timing
from sparseforge.semi import runtime as rt
from sparseforge.semi.decide import DENSE, GEMV, SPARSE
from sparseforge.semi.packed import pack_24, unpack_24

L2 = 1 << 20  # a 1 MiB L2: a 64 x 256 fp16 W (32 KiB) needs many copies to leave it


class FakeCompressed:
    def __init__(self, weight):
        self.rows, self.cols = weight.shape
        self.data = torch.zeros(weight.numel() * weight.element_size() * 9 // 16, dtype=torch.uint8)

    @property
    def nbytes(self):
        return self.data.numel()


class FakePlan:
    searched = 0

    def __init__(self, compressed, n, bias):
        self.weight, self.padded_n, self.config_id = compressed, n, 7
        self.workspace = torch.empty(100, dtype=torch.uint8)

    def search(self, x, out):
        FakePlan.searched += 1

    def run(self, x, out, compressed=None):
        pass


class FakeGemv:
    built = 0

    def __init__(self, weight, bias):
        FakeGemv.built += 1
        self.packed, self.dtype, self.device = pack_24(weight), weight.dtype, weight.device
        self.nbytes = self.packed.nbytes

    def with_copy_of_w(self):
        return FakeGemv.__new__(FakeGemv)

    def densify(self, out):
        return out.copy_(unpack_24(self.packed))

    def __call__(self, x):
        return x


@pytest.fixture
def fakes(monkeypatch):
    """Fakes in place; returns the list of each timing's call count, and the timings to hand out by path."""
    monkeypatch.setattr(rt, "CompressedWeight", FakeCompressed)
    monkeypatch.setattr(rt, "MatmulPlan", FakePlan)
    monkeypatch.setattr(rt, "ready_dense_fallback", lambda weight, bias: None)
    monkeypatch.setattr(rt.gemv_module, "Gemv24", FakeGemv)
    monkeypatch.setattr(rt, "_run_padded", lambda plan, x, compressed=None: x)
    monkeypatch.setattr(timing, "l2_bytes", lambda device=None: L2)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    FakePlan.searched = FakeGemv.built = 0
    seen, times = [], {SPARSE: (10.0, 30.0), GEMV: (5.0, 30.0), DENSE: (20.0, 25.0)}
    order = iter([SPARSE, GEMV, DENSE] * 10)

    def both_us(calls):
        seen.append(len(calls))
        return times[next(order)]

    monkeypatch.setattr(rt, "_both_us", both_us)
    return seen


def weight_24(m=64, k=256):
    w = torch.randn(m, k, generator=torch.Generator().manual_seed(0))
    return (w * nm_mask(w)).to(torch.float16)


def test_decode_widths_time_every_path_over_copies_that_leave_the_l2(fakes):
    w = weight_24()
    runtime = rt.Linear24Runtime(w, None)
    x = torch.randn(1, 256).to(torch.float16)
    choice, plan = runtime.prepare(x)
    x_bytes = x.numel() * 2
    want = [timing.weight_copies(runtime.compressed.nbytes + x_bytes, L2),
            timing.weight_copies(runtime.gemv.nbytes + x_bytes, L2),
            timing.weight_copies(w.numel() * 2 + x_bytes, L2)]
    assert fakes == want and min(want) > 2  # every path rotated, each by its own bytes
    assert choice.graph.path == GEMV and choice.eager.path == DENSE and plan is None


def test_wider_inputs_time_one_copy(fakes):
    runtime = rt.Linear24Runtime(weight_24(), None)
    runtime.prepare(torch.randn(timing.ROTATED_MAX_N + 1, 256).to(torch.float16))
    assert fakes == [1, 1]  # 2:4 and dense; the GEMV only up to its widths


def test_release_unused_drops_the_copies_no_decision_reads_and_stops_counting_them(fakes):
    runtime = rt.Linear24Runtime(weight_24(), None)
    runtime.prepare(torch.randn(1, 256).to(torch.float16))  # GEMV in graphs, dense eagerly
    held = runtime.device_bytes()
    assert held["compressed"] > 0 and held["packed"] > 0 and held["workspace"] == 0
    runtime.release_unused()
    assert runtime.device_bytes() == {"compressed": 0, "packed": held["packed"], "workspace": 0, "dense": 0}
    assert runtime._compressed is None and runtime.compressed is not None  # built again on demand


def test_pinned_widths_time_nothing_and_build_only_what_they_run(fakes):
    runtime = rt.Linear24Runtime(weight_24(), None, pinned={1: (GEMV, GEMV), 8: (DENSE, SPARSE)})
    one, _ = runtime.prepare(torch.randn(1, 256).to(torch.float16))
    assert fakes == [] and FakePlan.searched == 0 and FakeGemv.built == 1
    assert (one.eager.path, one.graph.path) == (GEMV, GEMV) and "pinned" in one.graph.reason
    eight, plan = runtime.prepare(torch.randn(8, 256).to(torch.float16))
    assert fakes == [] and FakePlan.searched == 1 and plan is not None
    assert (eight.eager.path, eight.graph.path) == (DENSE, SPARSE) and eight.graph.config_id == 7
    runtime.release_unused()
    assert runtime.device_bytes()["compressed"] > 0 and runtime.device_bytes()["packed"] > 0


def test_a_pinned_gemv_beyond_its_widths_runs_dense_and_the_other_mode_its_own_path(fakes):
    runtime = rt.Linear24Runtime(weight_24(), None, pinned={32: (GEMV, GEMV), 48: (GEMV, SPARSE)})
    choice, _ = runtime.prepare(torch.randn(32, 256).to(torch.float16))
    assert choice.graph.path == DENSE and "at most" in choice.graph.reason and FakeGemv.built == 0
    mixed, plan = runtime.prepare(torch.randn(48, 256).to(torch.float16))
    assert (mixed.eager.path, mixed.graph.path) == (DENSE, SPARSE) and plan is not None
    assert mixed.graph.config_id == 7 and mixed.eager.config_id is None and "at most" in mixed.eager.reason


@pytest.mark.parametrize("pinned,match", [
    ({0: (GEMV, GEMV)}, "key 0"),
    ({True: (GEMV, GEMV)}, "key True"),
    ({"1": (GEMV, GEMV)}, "key '1'"),
    ({1: (GEMV,)}, r"pinned\[1\] must be"),
    ({1: ("2:4", "csr")}, r"pinned\[1\] must be"),
    ({1: "2:4"}, r"pinned\[1\] must be"),
])
def test_check_pinned_names_the_bad_entry(pinned, match):
    with pytest.raises(ValueError, match=match):
        rt.check_pinned(pinned)


def test_check_pinned_takes_lists_as_saved_in_json():
    assert rt.check_pinned({4: [SPARSE, DENSE]}) == {4: (SPARSE, DENSE)}


def test_the_rotated_timings_call_every_copy_once_a_round_the_layers_own_first(fakes, monkeypatch):
    """The real _both_us over the fakes: graph replay and eager timing each call every copy of a path (distinct
    tensors and GEMVs, the layer's own first, cuSPARSELt's own compressed W as None: the call real use makes)."""
    monkeypatch.undo()  # the fixture's stubbed _both_us out; its fakes back in below
    monkeypatch.setattr(rt, "CompressedWeight", FakeCompressed)
    monkeypatch.setattr(rt, "MatmulPlan", FakePlan)
    monkeypatch.setattr(rt, "ready_dense_fallback", lambda weight, bias: None)
    monkeypatch.setattr(rt.gemv_module, "Gemv24", FakeGemv)
    monkeypatch.setattr(timing, "l2_bytes", lambda device=None: L2)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    rounds = []
    monkeypatch.setattr(timing, "rotating_graph_time_us", lambda fn, ops, repeats=25: rounds.append(
        ("graph", [fn(op) for op in ops])) or 1.0)
    monkeypatch.setattr(timing, "eager_time_us", lambda fn, ops, repeats=25: rounds.append(
        ("eager", [fn(op) for op in ops])) or 1.0)
    read = []
    monkeypatch.setattr(rt, "_run_padded", lambda plan, x, compressed=None: read.append(compressed) or "2:4")
    monkeypatch.setattr(FakeGemv, "__call__", lambda self, x: read.append(self) or "gemv")
    monkeypatch.setattr(rt.F, "linear", lambda x, w, b: read.append(w) or "dense")
    runtime = rt.Linear24Runtime(weight_24(), None)
    runtime.prepare(torch.randn(1, 256).to(torch.float16))
    assert [(mode, set(calls)) for mode, calls in rounds] == [
        ("graph", {"2:4"}), ("eager", {"2:4"}), ("graph", {"gemv"}), ("eager", {"gemv"}),
        ("graph", {"dense"}), ("eager", {"dense"})]
    counts = [len(calls) for mode, calls in rounds if mode == "graph"]
    sparse, gemv, dense = read[:counts[0]], read[2 * counts[0]:2 * counts[0] + counts[1]], read[-counts[2]:]
    assert sparse[0] is None and len({id(c) for c in sparse[1:]}) == counts[0] - 1 > 1
    assert gemv[0] is runtime.gemv and len({id(g) for g in gemv}) == counts[1] > 2
    assert dense[0] is runtime.weight and len({id(w) for w in dense}) == counts[2] > 2


def test_a_width_first_seen_in_a_capture_stays_undecided_and_unsaved(fakes, monkeypatch):
    runtime = rt.Linear24Runtime(weight_24(), None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    choice, _ = runtime.prepare(torch.randn(1, 256).to(torch.float16))
    assert choice.graph.path == DENSE and not runtime.decided(1) and runtime.chosen_paths() == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    runtime.prepare(torch.randn(1, 256).to(torch.float16))
    assert runtime.decided(1) and runtime.chosen_paths() == {1: (DENSE, GEMV)}


def test_release_unused_of_some_widths_keeps_only_what_they_read(fakes):
    runtime = rt.Linear24Runtime(weight_24(), None, pinned={1: (GEMV, GEMV), 8: (SPARSE, SPARSE)})
    for n in (1, 8):
        runtime.prepare(torch.randn(n, 256).to(torch.float16))
    plan = runtime.entries[8][1]
    runtime.release_unused([1])  # width 8 is never sent here (not a kernel width): its cuSPARSELt copy goes
    assert runtime._compressed is None and runtime.device_bytes()["packed"] > 0
    # with its plan and call (which held that copy): decided again if it is ever run
    assert not runtime.decided(8) and 8 not in runtime._calls and runtime.chosen_paths() == {1: (GEMV, GEMV)}
    assert plan is not None and all(p is not plan for _, p in runtime.entries.values())


def test_a_runtime_pinned_off_cusparselt_compresses_nothing(fakes, monkeypatch):
    made = []
    monkeypatch.setattr(rt, "CompressedWeight", lambda weight: made.append(weight) or FakeCompressed(weight))
    rt.Linear24Runtime(weight_24(), None, pinned={1: (GEMV, DENSE)}).prepare(torch.randn(1, 256).to(torch.float16))
    assert made == []
    rt.Linear24Runtime(weight_24(), None, pinned={1: (GEMV, SPARSE)})
    assert len(made) == 1


def test_drop_dense_lets_go_of_w_once_every_width_runs_2_4_in_graphs(fakes):
    """The default timings: the GEMV wins under graph replay, dense called eagerly. Dropping W makes the eager
    call run the GEMV too (said so), keeps the packed copy (it stands for W) through release_unused, and
    densify writes W back bit for bit."""
    w = weight_24()
    runtime = rt.Linear24Runtime(w, None)
    runtime.prepare(torch.randn(1, 256).to(torch.float16))
    assert runtime.entries[1][0].eager.path == DENSE
    assert runtime.drop_dense() and not runtime.holds_dense and runtime.weight is None
    choice, _ = runtime.entries[1]
    assert (choice.eager.path, choice.graph.path) == (GEMV, GEMV)
    assert "keeps no dense W" in choice.eager.reason and "called eagerly" in choice.eager.reason
    assert runtime._calls[1][0] is runtime._calls[1][1] is runtime.gemv
    assert runtime.chosen_paths() == {1: (GEMV, GEMV)}
    runtime.release_unused()
    assert runtime.gemv is not None and runtime.device_bytes()["dense"] == 0
    out = torch.full_like(w, float("nan"))
    assert torch.equal(runtime.densify(out), w)
    assert runtime.drop_dense()  # again: nothing to do


def test_drop_dense_builds_the_packed_copy_where_only_cusparselt_runs(fakes):
    runtime = rt.Linear24Runtime(weight_24(), None, pinned={8: (SPARSE, SPARSE)})
    runtime.prepare(torch.randn(8, 256).to(torch.float16))
    assert runtime.gemv is None and runtime.drop_dense() and runtime.gemv is not None
    runtime.release_unused()
    assert runtime.device_bytes()["compressed"] > 0 and runtime.device_bytes()["packed"] > 0


@pytest.mark.parametrize("case", ["nothing decided", "a width dense in graphs", "policy dense", "captured width"])
def test_drop_dense_keeps_w_where_a_width_may_run_dense(fakes, monkeypatch, case):
    w = weight_24()
    x = torch.randn(1, 256).to(torch.float16)
    runtime = rt.Linear24Runtime(w, None, policy="dense" if case == "policy dense" else "measure",
                                 pinned={1: (GEMV, DENSE)} if case == "a width dense in graphs" else None)
    if case == "captured width":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    if case != "nothing decided":
        runtime.prepare(x)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not runtime.drop_dense() and runtime.weight is w and runtime.holds_dense


def test_a_width_decided_after_drop_dense_makes_w_again_and_counts_it(fakes, monkeypatch):
    w = weight_24()
    made = []
    monkeypatch.setattr(rt, "CompressedWeight", lambda weight: made.append(weight.clone()) or FakeCompressed(weight))
    runtime = rt.Linear24Runtime(w, None, pinned={1: (GEMV, GEMV)})
    runtime.prepare(torch.randn(1, 256).to(torch.float16))
    assert made == [] and runtime.drop_dense()
    assert runtime.compressed is not None and torch.equal(made[0], w)  # compressed from W written back
    assert runtime.weight is None  # which was not kept
    runtime.prepare(torch.randn(4, 256).to(torch.float16))  # measured: dense is timed, so W is back
    assert torch.equal(runtime.weight, w) and runtime.device_bytes()["dense"] == w.numel() * 2
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    runtime.weight, runtime._own_dense = None, False
    with pytest.raises(RuntimeError, match="keeps no dense W"):
        runtime.dense_weight()
