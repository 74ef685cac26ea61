"""GPU numerics of the 2:4 cuSPARSELt path against a float64 reference (run on the device)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparseforge import SparseLinear24, prepare, sparsify_24, to_sparse24
from sparseforge.prune import nm_mask
from sparseforge.semi import Sparse24Error
from sparseforge.semi.cusparselt import CompressedWeight, MatmulPlan
from sparseforge.semi.runtime import Linear24Runtime, padded_input
from sparseforge.semi.transpose import transpose_columns

pytestmark = pytest.mark.gpu
TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPES = [torch.float16, torch.bfloat16]


def weight_24(m, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, k, generator=g) / k ** 0.5
    return (w * nm_mask(w)).to("cuda", dtype)


def rel_err(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(16, 16), (64, 128), (768, 3072), (272, 48)])
@pytest.mark.parametrize("n", [1, 3, 16, 17, 64, 300])
def test_plan_matches_float64_into_poisoned_output(dtype, m, k, n):
    w = weight_24(m, k, dtype)
    x = torch.randn(n, k, device="cuda").to(dtype)
    plan = MatmulPlan(CompressedWeight(w), n)
    out = torch.full((m, plan.padded_n), float("nan"), device="cuda", dtype=dtype)
    xp = padded_input(plan, x)
    plan.search(xp, out)
    out.fill_(float("nan"))
    plan.run(xp, out)
    torch.cuda.synchronize()
    got = out[:, :n].t()
    assert torch.isfinite(got).all(), "unwritten (NaN) outputs"
    assert rel_err(got, x.double() @ w.double().T) <= TOL[dtype]


@pytest.mark.parametrize("rows,ld,n", [(64, 24, 17), (4096, 1024, 1000), (3000, 2056, 2049)])
def test_transpose_columns_both_paths(rows, ld, n):
    src = torch.randn(rows, ld, device="cuda").half()
    got = transpose_columns(src, n)
    assert got.is_contiguous() and torch.equal(got, src[:, :n].t())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_bias(dtype):
    w = weight_24(256, 512, dtype)
    bias = torch.randn(256, device="cuda").to(dtype)
    x = torch.randn(40, 512, device="cuda").to(dtype)
    runtime = Linear24Runtime(w, bias, policy="sparse")
    got = runtime(x)
    ref = x.double() @ w.double().T + bias.double()
    assert runtime.decisions[0].path == "2:4"
    assert rel_err(got, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", ["measure", "sparse", "dense"])
def test_module_matches_masked_dense_on_batched_input(dtype, policy):
    linear = nn.Linear(384, 192, device="cuda")
    sparsify_24(nn.Sequential(linear))
    linear = linear.to(dtype)
    layer = SparseLinear24.from_dense(linear, policy=policy)
    x = torch.randn(3, 7, 384, device="cuda").to(dtype)
    with torch.no_grad():
        got = layer(x)
        ref = F.linear(x.double(), linear.weight.double(), linear.bias.double())
    assert got.shape == (3, 7, 192)
    assert rel_err(got, ref) <= TOL[dtype]
    decisions = layer.decisions
    assert [(d.n, d.mode) for d in decisions] == {"dense": [], "sparse": [(21, "any")],
                                                  "measure": [(21, "eager"), (21, "graph")]}[policy]
    for d in decisions if policy == "measure" else []:
        assert d.path in ("2:4", "dense") and d.sparse_us > 0 and d.dense_us > 0
        assert (d.path == "2:4") == (d.speedup >= 1.03)


def test_misaligned_and_strided_inputs():
    w = weight_24(128, 256, torch.float16)
    layer = SparseLinear24.from_dense(_linear_from(w), policy="sparse")
    flat = torch.randn(33 * 256 + 1, device="cuda").half()
    x = flat[1:].view(33, 256)  # 2-byte offset: not 16-byte aligned
    assert x.data_ptr() % 16
    strided = torch.randn(256, 33, device="cuda").half().t()
    with torch.no_grad():
        for inp in (x, strided):
            assert rel_err(layer(inp), inp.double() @ w.double().T) <= TOL[torch.float16]


def test_weight_update_in_place_recompresses():
    w = weight_24(64, 64, torch.float16)
    layer = SparseLinear24.from_dense(_linear_from(w), policy="sparse")
    x = torch.randn(8, 64, device="cuda").half()
    with torch.no_grad():
        layer(x)
        w2 = weight_24(64, 64, torch.float16, seed=5)
        layer.load_state_dict({"weight": w2})
        assert rel_err(layer(x), x.double() @ w2.double().T) <= TOL[torch.float16]


def test_cuda_graph_capture_prepared_and_unprepared():
    w = weight_24(512, 512, torch.float16)
    layer = SparseLinear24.from_dense(_linear_from(w), policy="sparse")
    layer_model = nn.Sequential(layer)
    prepare(layer_model, [32])
    static = torch.randn(32, 512, device="cuda").half()
    cold = torch.randn(48, 512, device="cuda").half()  # width never prepared: runs dense inside the graph
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = layer_model(static)
        out_cold = layer_model(cold)
    fresh = torch.randn(32, 512, device="cuda").half()
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, fresh.double() @ w.double().T) <= TOL[torch.float16]
    assert rel_err(out_cold, cold.double() @ w.double().T) <= TOL[torch.float16]
    paths = {d.n: d.path for d in layer.decisions}
    assert paths == {32: "2:4", 48: "dense"}
    assert "capture" in layer.decisions[1].reason


def test_torch_compile_fullgraph():
    w = weight_24(256, 256, torch.float16)
    model = nn.Sequential(SparseLinear24.from_dense(_linear_from(w), policy="sparse"), nn.ReLU())
    x = torch.randn(64, 256, device="cuda").half()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        got = compiled(x)
    assert rel_err(got, torch.relu(x.double() @ w.double().T)) <= TOL[torch.float16]
    assert model[0].decisions[0].path == "2:4"


@pytest.mark.parametrize("dtype", DTYPES)
def test_to_sparse24_model_matches_masked_dense(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.Linear(256, 10)).cuda()
    sparsify_24(model)
    model = model.to(dtype).eval()
    x = torch.randn(4, 50, 256, device="cuda").to(dtype)
    with torch.no_grad():
        ref = model(x).double()
        report = to_sparse24(model)
        got = model(x)
    assert report.converted == ["0", "2"] and [s.name for s in report.skipped] == ["3"]
    assert rel_err(got, ref) <= 2 * TOL[dtype]


def test_errors_name_the_problem():
    with pytest.raises(Sparse24Error, match="float16 or bfloat16"):
        CompressedWeight(weight_24(32, 32, torch.float32))
    dense = torch.randn(32, 32, device="cuda").half()
    with pytest.raises(Sparse24Error, match="not 2:4"):
        CompressedWeight(dense)
    bad = weight_24(32, 32, torch.float16)
    bad[0, 0] = float("nan")
    with pytest.raises(Sparse24Error, match="NaN"):
        CompressedWeight(bad)
    layer = SparseLinear24.from_dense(_linear_from(weight_24(32, 32, torch.float16)))
    with torch.no_grad(), pytest.raises(Sparse24Error, match="cast the input"):
        layer(torch.randn(4, 32, device="cuda"))
    with torch.no_grad(), pytest.raises(Sparse24Error, match="takes 32"):
        layer(torch.randn(4, 48, device="cuda").half())


def _linear_from(w):
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=w.dtype)
    with torch.no_grad():
        linear.weight.copy_(w)
    return linear


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(16, 16), (45, 48), (300, 1040), (4096, 11008)])
@pytest.mark.parametrize("n", [1, 2, 5, 8, 12, 16])
def test_packed_gemv_matches_float64_into_poisoned_output(dtype, m, k, n):
    """The CUDA-core 2:4 GEMV for decode widths: any M, K a multiple of 16 (chunk counts below and above a
    warp's 32 lanes), with and without bias."""
    from sparseforge.semi.gemv import Gemv24

    w = weight_24(m, k, dtype, seed=m + k)
    x = torch.randn(n, k, device="cuda").to(dtype)
    for bias in (None, torch.randn(m, device="cuda").to(dtype)):
        gemv = Gemv24(w, bias)
        out = torch.full((n, m), float("nan"), device="cuda", dtype=dtype)
        gemv(x, out=out)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), "unwritten (NaN) outputs"
        ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
        assert rel_err(out, ref) <= TOL[dtype]


def test_packed_gemv_under_graph_replay():
    from sparseforge.semi.gemv import Gemv24

    w = weight_24(256, 512, torch.float16)
    gemv = Gemv24(w)
    x = torch.randn(1, 512, device="cuda").half()
    out = torch.empty(1, 256, device="cuda").half()
    gemv(x, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv(x, out=out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, x.double() @ w.double().T) <= TOL[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_runtime_with_the_gemv_candidate(dtype, monkeypatch):
    """With the GEMV in decisions (the default since it was measured), decode widths pick among three paths;
    outputs stay right in either mode whatever is picked."""
    from sparseforge.semi import gemv as gemv_module

    monkeypatch.setattr(gemv_module, "USE_IN_DECISIONS", True)
    monkeypatch.setattr(gemv_module, "DECISION_MAX_N", gemv_module.MAX_N)  # built widths past the decision range
    linear = nn.Linear(4096, 4096, device="cuda")
    sparsify_24(nn.Sequential(linear))
    layer = SparseLinear24.from_dense(linear.to(dtype))
    for n in (1, 4, 12, 64):
        x = torch.randn(n, 4096, device="cuda").to(dtype)
        with torch.no_grad():
            got = layer(x)
        ref = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        assert rel_err(got, ref) <= TOL[dtype]
    paths = {(d.n, d.mode): d.path for d in layer.decisions}
    assert set(paths.values()) <= {"2:4", "2:4-gemv", "dense"}
    assert all(p != "2:4-gemv" for (n, _), p in paths.items() if n > 16)


def test_modes_that_differ_run_their_own_path_eagerly_and_in_a_graph(monkeypatch):
    """Eager dense, graph 2:4: each mode's call runs its path (the runtime keeps one callable per mode)."""
    from sparseforge.semi import runtime as runtime_module
    from sparseforge.semi.decide import Decision, WidthChoice

    monkeypatch.setattr(runtime_module, "decide_modes", lambda n, timed, dense, *a, **k: WidthChoice(
        Decision(n, "dense", "forced by the test", mode="eager"), Decision(n, "2:4", "forced by the test", mode="graph")))
    ran = []
    real = runtime_module._run_padded
    monkeypatch.setattr(runtime_module, "_run_padded", lambda plan, x, compressed=None: ran.append(x.shape[0]) or
                        real(plan, x, compressed))
    w = weight_24(256, 512, torch.float16)
    runtime = Linear24Runtime(w, None)
    x = torch.randn(32, 512, device="cuda").half()
    runtime.prepare(x)  # times every path, 2:4 included
    ran.clear()
    eager = runtime(x)
    assert ran == [] and rel_err(eager, x.double() @ w.double().T) <= TOL[torch.float16]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = runtime(x)
    fresh = torch.randn(32, 512, device="cuda").half()
    x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert ran == [32] and rel_err(out, fresh.double() @ w.double().T) <= TOL[torch.float16]


def test_a_fresh_process_captures_a_width_that_falls_back_to_dense():
    """In a process whose first cuBLAS call would come inside the capture (no matmul before), a width never
    prepared runs dense in the graph: prepare made cuBLAS's handles (runtime.streams.ready_dense_fallback)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch
        from torch import nn
        from sparseforge import SparseLinear24, prepare
        from sparseforge.prune import nm_mask
        torch.manual_seed(0)
        w = torch.randn(256, 256, device="cuda").half()
        w = w * nm_mask(w, 2, 4)
        linear = nn.Linear(256, 256, bias=True).cuda().half()
        with torch.no_grad():
            linear.weight.copy_(w)
        model = nn.Sequential(SparseLinear24.from_dense(linear, policy="sparse"))
        prepare(model, [32])
        static, cold = torch.randn(32, 256, device="cuda").half(), torch.randn(48, 256, device="cuda").half()
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            out, out_cold = model(static), model(cold)
        graph.replay()
        torch.cuda.synchronize()
        want = cold.double() @ w.double().T + linear.bias.double()
        err = ((out_cold.double() - want).norm() / want.norm()).item()
        assert err < 5e-3, err
        print("ok", [(d.n, d.path) for d in model[0].decisions])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-2000:]


@pytest.mark.parametrize("dtype", DTYPES)
def test_copies_of_w_that_timing_rotates_give_the_same_product(dtype):
    """cuSPARSELt's plan run on a copy of its compressed bytes, and the GEMV on its own copy of the packed W,
    compute what the originals do (the rotated timings time the same product); a copy of the wrong size is
    refused."""
    from sparseforge.semi.gemv import Gemv24

    w = weight_24(512, 256, dtype)
    x = torch.randn(8, 256, device="cuda").to(dtype)
    ref = x.double() @ w.double().T
    compressed = CompressedWeight(w)
    plan = MatmulPlan(compressed, 8)
    copy = compressed.data.clone()
    compressed.data.zero_()  # the plan's own bytes: what a run from the copy must not read
    out = torch.full((512, plan.padded_n), float("nan"), device="cuda", dtype=dtype)
    plan.run(padded_input(plan, x), out, copy)
    assert rel_err(transpose_columns(out, 8), ref) <= TOL[dtype]
    with pytest.raises(Sparse24Error, match="compressed bytes"):
        plan.run(padded_input(plan, x), out, copy[:-16])
    gemv = Gemv24(w)
    twin = gemv.with_copy_of_w()
    gemv.packed.values.zero_()
    assert twin.packed.values.data_ptr() != gemv.packed.values.data_ptr()
    assert rel_err(twin(x), ref) <= TOL[dtype]


def test_pinned_widths_run_their_paths_without_timing_and_release_the_rest(monkeypatch):
    """A layer pinned to the paths its group's first layer measured times nothing, runs those paths right, and
    after release_unused holds only what they read."""
    from sparseforge.semi import runtime as runtime_module

    monkeypatch.setattr(runtime_module, "_both_us", lambda calls: pytest.fail("a pinned width was timed"))
    linear = nn.Linear(512, 1024, device="cuda")
    sparsify_24(nn.Sequential(linear))
    layer = SparseLinear24.from_dense(linear.half())
    layer.pin({1: ("2:4-gemv", "2:4-gemv"), 16: ("2:4", "2:4")})
    for n in (1, 16):
        x = torch.randn(n, 512, device="cuda").half()
        with torch.no_grad():
            got = layer(x)
        assert rel_err(got, F.linear(x.double(), layer.weight.double(), layer.bias.double())) <= TOL[torch.float16]
    assert {(d.n, d.path) for d in layer.decisions} == {(1, "2:4-gemv"), (16, "2:4")}
    runtime = layer.runtime()
    runtime.release_unused()
    held = runtime.device_bytes()
    assert held["compressed"] > 0 and held["packed"] > 0
    layer.pin({16: ("dense", "dense")})
    layer(torch.randn(1, 512, device="cuda").half())
    layer(torch.randn(16, 512, device="cuda").half())
    layer.runtime().release_unused()
    assert layer.runtime().device_bytes()["compressed"] == 0 and layer.memory_bytes()["kernels"] > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(16, 16), (45, 48), (4096, 14336)])
def test_packed_densify_writes_w_into_poisoned_output(dtype, m, k):
    """The packed copy's dense writer gives W back, every element written (pruned ones zero)."""
    from sparseforge.semi.gemv import Gemv24

    w = weight_24(m, k, dtype)
    gemv = Gemv24(w)
    out = torch.full_like(w, float("nan"))
    assert gemv.densify(out) is out
    torch.cuda.synchronize()
    assert not out.isnan().any() and torch.equal(out, w)
    with pytest.raises(Sparse24Error, match="not contiguous"):
        gemv.densify(torch.empty(k, m, device="cuda", dtype=dtype).t())
    with pytest.raises(Sparse24Error, match="densify writes"):
        gemv.densify(torch.empty(m, k, device="cuda", dtype=torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_layer_keeps_no_dense_w_on_the_gpu_and_prefills_from_the_workspace(dtype, tmp_path):
    """A 2:4 DecodeLinear after prepare: its dense W in host memory, the packed copy (and cuSPARSELt's where a
    width runs it) on the GPU; decode widths, a width padded up to one, a prefill and a graph replay all match
    float64; a width whose eager call was pinned dense runs its graph path eagerly; prepare keeps it
    released; a copy must be prepared before a capture, and is released by it; an edit of W brings W back to
    the GPU until the next prepare; the layer saves and loads released."""
    import copy

    import sparseforge
    from sparseforge.nn import DecodeLinear

    linear = nn.Linear(1024, 512, device="cuda")
    sparsify_24(nn.Sequential(linear))
    linear = linear.to(dtype).requires_grad_(False)
    w, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    inner = SparseLinear24.from_dense(linear)
    inner.pin({1: ("dense", "2:4-gemv"), 8: ("2:4", "2:4")})
    layer = DecodeLinear(inner, [1, 8])
    layer.prepare()
    assert inner.dense_on_host and inner.weight.device.type == "cpu" and torch.equal(inner.weight.cuda(), w)
    held = inner.memory_bytes()
    assert held["weight"] == 0 and held["weight_host"] == w.numel() * 2 and held["dense"] == 0
    assert 0 < held["kernels"] < 1.25 * w.numel() * 2  # packed 0.5625x + compressed ~0.56x + plan workspace
    made = {(d.n, d.mode): d for d in inner.decisions}
    assert {key: d.path for key, d in made.items()} == {(1, "eager"): "2:4-gemv", (1, "graph"): "2:4-gemv",
                                                         (8, "eager"): "2:4", (8, "graph"): "2:4"}
    assert "keeps no dense W" in made[1, "eager"].reason

    def check(model, weight, n):
        x = torch.randn(n, 1024, device="cuda").to(dtype)
        with torch.no_grad():
            got = model(x)
        assert rel_err(got, x.double() @ weight.double().T + bias.double()) <= TOL[dtype], n

    for n in (1, 3, 8, 37):  # decode, padded to 8, decode, prefill (from the workspace)
        check(layer, w, n)
    def captured(model, n):  # a graph of `model` on n tokens, replayed on fresh ones, against float64
        static = torch.randn(n, 1024, device="cuda").to(dtype)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            out = model(static)
        fresh = torch.randn(n, 1024, device="cuda").to(dtype)
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, fresh.double() @ w.double().T + bias.double()) <= TOL[dtype]

    captured(layer, 1)
    captured(layer, 37)  # a prefill width: one launch from the packed copy into the shared workspace
    assert len(sparseforge.prepare(nn.Sequential(layer), [1, 8])) == 4 and inner.dense_on_host
    twin = copy.deepcopy(layer)  # a copy rebuilds its runtime: not before a capture
    x = torch.randn(1, 1024, device="cuda").to(dtype)
    with pytest.raises(RuntimeError, match="prepare"), torch.no_grad(), torch.cuda.graph(torch.cuda.CUDAGraph()):
        twin(x)
    twin.prepare()
    assert twin.inner.dense_on_host
    captured(twin, 1)
    before = inner.decisions
    layer.to("cuda").to(dtype)  # where it is already: released still, nothing decided again
    assert inner.dense_on_host and inner.decisions == before
    captured(layer, 1)
    layer.float().to(dtype)  # real casts: the runtime goes; prepare builds it again (pinned) and releases W
    assert inner.chosen_paths() == {}
    sparseforge.prepare(nn.Sequential(layer), [1])
    assert inner.dense_on_host and inner.weight.device.type == "cpu"
    captured(layer, 1)
    captured(layer, 37)
    saved = sparseforge.save(nn.Sequential(layer), tmp_path / "released")
    loaded = sparseforge.load(saved, model=nn.Sequential(nn.Linear(1024, 512)), device="cuda")
    assert loaded[0].inner.dense_on_host
    check(loaded, w, 1)
    check(loaded, w, 37)
    with torch.no_grad():
        inner.weight.mul_(2)  # an edit in host memory: the layer is built again from a W on the GPU
    check(layer, 2 * w, 1)
    assert not inner.dense_on_host and inner.weight.is_cuda
    layer.prepare()
    assert inner.dense_on_host
    check(layer, 2 * w, 37)
