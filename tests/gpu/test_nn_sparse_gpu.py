"""SparseLinear / SparseConv2d and convert() on the GPU: the sparse kernels (forced and measured) against
float64 into fresh outputs, decisions made ahead and replayed in a CUDA graph, torch.compile(fullgraph=True)
through the custom ops, and a small CNN converted by measurement with its outputs kept."""
import copy

import pytest
import torch
from torch import nn

from sparseforge.nn import SparseConv2d, SparseLinear, convert, prepare

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _pruned(module: nn.Module, density: float, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.mul_((torch.rand(module.weight.shape, generator=g) < density).to(module.weight.dtype))
    return module


class _Bottleneck(nn.Module):
    """A 3x3 and a 1x1 convolution, the shortcut added in place, ReLUs: the epilogues fusion takes."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(32, 32, 3, padding=1), nn.Conv2d(32, 32, 1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.conv2(self.relu(self.conv1(x)))
        out += x
        return self.relu(out)


def _close(got, want, dtype):
    err = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert torch.isfinite(got).all() and err <= TOL[dtype], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [(1,), (8,), (3, 33)])
def test_sparse_linear_runs_its_kernel_and_matches_float64(dtype, tokens):
    linear = _pruned(nn.Linear(512, 384), 0.1).to("cuda", dtype)
    layer = SparseLinear.from_dense(linear, policy="sparse", tune_budget=None)
    x = torch.randn(*tokens, 512, device="cuda").to(dtype)
    with torch.no_grad():
        y = layer(x)
        want = x.double() @ linear.weight.double().T + linear.bias.double()
    assert y.shape == (*tokens, 384)
    _close(y, want, dtype)
    assert [d.path for d in layer.decisions] == ["unstructured"] and layer.memory_bytes()["dense"] == 0


def test_decisions_made_ahead_replay_in_a_cuda_graph_and_compile_fullgraph():
    model = nn.Sequential(_pruned(nn.Linear(256, 256), 0.1), nn.ReLU(), _pruned(nn.Linear(256, 64), 0.1, seed=1))
    model = model.to("cuda", torch.float16).eval()
    x = torch.randn(4, 256, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        want = model(x).double()
    for i in (0, 2):
        model[i] = SparseLinear.from_dense(model[i], tune_budget=1.0)
    decisions = prepare(model, [4])
    assert len(decisions) == 2 and all(d.dense_us and d.sparse_us for d in decisions)
    out = torch.empty(4, 64, device="cuda", dtype=torch.float16)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        model(x)
        with torch.cuda.graph(graph):
            out.copy_(model(x))
        graph.replay()
        _close(out, want, torch.float16)
        compiled = torch.compile(model, fullgraph=True)
        _close(compiled(x), want, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_conv_matches_float64_at_two_image_sizes(dtype):
    conv = _pruned(nn.Conv2d(32, 64, 3, padding=1, stride=2), 0.1).to("cuda", dtype)
    layer = SparseConv2d.from_dense(conv, policy="sparse", tune_budget=None, relu=True)
    for size in ((15, 15), (8, 12)):
        x = torch.randn(2, 32, *size, device="cuda").to(dtype)
        with torch.no_grad():
            want = torch.relu(torch.nn.functional.conv2d(x.double(), conv.weight.double(), conv.bias.double(),
                                                         2, 1))
            _close(layer(x), want, dtype)
    assert len(layer.decisions) == 2


def test_convert_measures_every_layer_and_keeps_the_outputs(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(64 * 14 * 14, 128))
    for i in (0, 3, 6):
        _pruned(model[i], 0.1, seed=i)
    model = model.cuda().eval()
    x = torch.randn(1, 16, 14, 14, device="cuda")
    with torch.no_grad():  # the reference in float64: cuDNN's fp32 default (TF32) is off by ~1e-4 itself
        want = copy.deepcopy(model).double()(x.double())
    # the layers convert() keeps dense run cuDNN / cuBLAS: in full fp32 here, so the bound is fp32's
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    report = convert(model, x, tune_budget=1.0)
    assert [layer.name for layer in report.layers] == ["0", "3", "6"] and report.folded == [("0", "1")]
    for layer in report.layers:
        assert layer.times_us["dense"] > 0 and layer.times_us["unstructured"] > 0
        assert layer.choice in ("dense", "unstructured")
    assert report.latency_before_us > 0 and report.latency_after_us > 0
    with torch.no_grad():
        _close(model(x), want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_relu_and_residual_kernels_match_float64_under_graph_replay(dtype):
    """fuse_epilogues on GPU kernels: each conv's kernel rebuilt with its ReLU / shortcut add (the winning
    config, not timed again) computes what the unfused model does, inside a CUDA graph too."""
    from sparseforge.nn import fuse_epilogues
    from sparseforge.nn.convert import model_latency_us

    torch.manual_seed(1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(32, 32, 3, padding=1), nn.Conv2d(32, 32, 3, padding=1)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            out = self.relu(self.conv1(x))
            out = self.conv2(out)
            out += x
            return self.relu(out)

    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), Block(), Block())
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            _pruned(m, 0.1, seed=3)
    model = model.cuda().eval()
    x = torch.randn(2, 16, 14, 14, device="cuda")
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
    model = model.to(dtype)
    convert(model, x.to(dtype), policy="sparse", tune_budget=None, time_model=False)
    fused, report = fuse_epilogues(model, (x.to(dtype),))
    expected = {"0": "relu", "2.conv1": "relu", "2.conv2": "residual+relu", "3.conv1": "relu", "3.conv2": "residual+relu"}
    fused_kinds = dict(report.fused)
    assert all(expected[name] == kind for name, kind in fused_kinds.items()) and len(fused_kinds) >= 3
    # a layer left out is one whose picked config is split K (it takes no epilogue), and it says so
    assert all("takes no epilogue" in s.reason for s in report.skipped)
    assert set(fused_kinds) | {s.name for s in report.skipped} == set(expected)
    assert all(fused.get_submodule(name)._paths and all(k is not None for k in fused.get_submodule(name)._paths.values())
               for name, _ in report.fused)
    with torch.no_grad():
        _close(fused(x.to(dtype)), want, dtype)
    assert model_latency_us(fused, (x.to(dtype),)) > 0  # captures and replays


def test_one_copy_of_w_on_the_gpu_and_the_host_buffers_round_trip(tmp_path):
    """Once a kernel holds W, the CSR buffers live in host memory (memory_bytes: csr 0, csr_host > 0); the
    layer still reports its device, and state_dict, deepcopy, torch.save / load, .half() and a new width
    (its kernel built from the host copy) all keep working."""
    linear = _pruned(nn.Linear(512, 384), 0.1).to("cuda", torch.float32)
    layer = SparseLinear.from_dense(linear, policy="sparse", tune_budget=None)
    x = torch.randn(8, 512, device="cuda")
    with torch.no_grad():
        y = layer(x)
        want = x.double() @ linear.weight.double().T + linear.bias.double()
    _close(y, want, torch.float32)
    mem = layer.memory_bytes()
    assert layer.csr_on_host and layer.device.type == "cuda" and layer.weight_values.device.type == "cpu"
    assert mem["csr"] == 0 and mem["csr_host"] > 0  # kernels: 0 where the pick has W in its code (inline)
    state = layer.state_dict()  # the CSR entries as held (host memory), the bias on the GPU
    assert state["weight_values"].device.type == "cpu" and state["bias"].device.type == "cuda"
    with torch.no_grad():
        _close(layer(torch.cat([x, x[:3]])), torch.cat([want, want[:3]]), torch.float32)  # a new width: 11
        again = SparseLinear(512, 384, device="cuda", policy="sparse", tune_budget=None)
        again.load_state_dict(layer.state_dict())
        _close(again(x), want, torch.float32)
        _close(copy.deepcopy(layer)(x), want, torch.float32)
        torch.save(layer, tmp_path / "layer.pt")
        loaded = torch.load(tmp_path / "layer.pt", weights_only=False)
        assert loaded.csr_on_host and loaded.device.type == "cuda"
        _close(loaded(x), want, torch.float32)
        on_cpu = torch.load(tmp_path / "layer.pt", weights_only=False, map_location="cpu")
        assert not on_cpu.csr_on_host and on_cpu.device.type == "cpu"
        _close(on_cpu(x.cpu()).cuda(), want, torch.float32)
        half = layer.half()  # a dtype cast leaves the buffers in host memory; the kernels are rebuilt
        assert half.csr_on_host and half.weight_values.dtype == torch.float16 and half.device.type == "cuda"
        _close(half(x.half()), want, torch.float16)
        moved = copy.deepcopy(half).cpu().float()  # a move to the CPU takes the layer and its buffers there
        assert not moved.csr_on_host and moved.device.type == "cpu"
        _close(moved(x.cpu()).cuda(), want, torch.float16)
        assert torch.equal(layer.to_dense().weight.float().cpu(), linear.weight.half().float().cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_convs_fused_by_cudnn_match_float64_under_graph_replay(dtype, monkeypatch):
    """fuse_epilogues on convolutions kept dense: cuDNN's fused conv + bias (+ residual) + ReLU, forced
    ("fuse") and by measurement, computes what the separate ops do, inside a CUDA graph too."""
    from sparseforge.nn import FusedDenseConv2d, fuse_epilogues
    from sparseforge.nn.convert import model_latency_us
    from sparseforge.nn.dense_epilogue import measure_fused_dense

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(4)

    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True), _Bottleneck()).cuda().eval()
    x = torch.randn(2, 16, 14, 14, device="cuda")
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
    model = model.to(dtype)
    xs = (x.to(dtype),)
    fused, report = fuse_epilogues(copy.deepcopy(model), xs, dense_convs="fuse")
    assert dict(report.fused) == {"0": "relu (cuDNN fused)", "2.conv1": "relu (cuDNN fused)",
                                  "2.conv2": "residual+relu (cuDNN fused)"}, report
    layers = [fused.get_submodule(name) for name, _ in report.fused]
    assert all(isinstance(m, FusedDenseConv2d) and m.cudnn_fused for m in layers)
    with torch.no_grad():
        got = torch.full_like(want, float("nan"), dtype=dtype)
        got.copy_(fused(*xs))
        _close(got, want, dtype)
    assert model_latency_us(fused, xs) > 0  # captures and replays
    separate, one = measure_fused_dense(layers[2], (2, 32, 14, 14), (2, 32, 14, 14))
    assert separate > 0 and one > 0
    measured, mreport = fuse_epilogues(copy.deepcopy(model), xs)
    assert {n for n, _ in mreport.fused} | {s.name for s in mreport.skipped} == {"0", "2.conv1", "2.conv2"}
    assert all("measured" in s.reason or "fails here" in s.reason for s in mreport.skipped)
    with torch.no_grad():
        _close(measured(*xs), want, dtype)


def test_eager_decisions_are_measured_where_the_kernel_won_and_both_modes_compute_the_same():
    torch.manual_seed(5)
    dense = _pruned(nn.Linear(512, 512), 0.1).cuda().eval()
    layer = SparseLinear.from_dense(dense, policy="measure", tune_budget=0.5)
    layer.measure_eager = True
    layer.prepare([1, 64])
    eager = {d.n: d for d in layer.eager_decisions}
    for d in layer.decisions:
        assert (d.n in eager) == (d.path == "unstructured"), (d, eager)
    for d in eager.values():
        assert d.mode == "eager" and d.sparse_us > 0 and d.dense_us > 0 and d.path in ("unstructured", "dense")
        assert (d.n in layer._eager_dense) == (d.path == "dense")
    x = torch.randn(64, 512, device="cuda")
    want = torch.nn.functional.linear(x.double(), dense.weight.double(), dense.bias.double())
    with torch.no_grad():
        _close(layer(x), want, torch.float32)
        graph, out = torch.cuda.CUDAGraph(), None
        with torch.cuda.graph(graph):
            out = layer(x)
        out.fill_(float("nan"))
        graph.replay()
        _close(out, want, torch.float32)


def _poisoned_pool(shape, dtype, memory_format=torch.contiguous_format):
    """Free a NaN-filled block of `shape` so the caching allocator hands it to the next allocation of that size:
    a lean call's fresh output then starts as NaN, and any element the kernel does not write shows."""
    block = torch.full(shape, float("nan"), device="cuda", dtype=dtype).contiguous(memory_format=memory_format)
    del block


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [(16,), (2, 24)])
def test_the_lean_linear_call_matches_float64_and_the_checked_call(dtype, tokens):
    """The second call of a width takes the lean path (packed launch, rows as they lie); it computes what the
    first (checked) call did, into a NaN-poisoned block, against float64."""
    linear = _pruned(nn.Linear(512, 384), 0.1).to("cuda", dtype)
    layer = SparseLinear.from_dense(linear, policy="sparse", tune_budget=None)
    x = torch.randn(*tokens, 512, device="cuda").to(dtype)
    with torch.no_grad():
        first = layer(x)
        assert layer._hot is not None
        want = x.double() @ linear.weight.double().T + linear.bias.double()
        for _ in range(3):
            _poisoned_pool((*tokens, 384), dtype)
            again = layer(x)
            _close(again, want, dtype)
            assert torch.equal(again, first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
def test_a_channels_last_conv_runs_nhwc_kernels_eagerly_in_a_graph_and_compiled(dtype, residual):
    """SparseConv2d on channels_last inputs: an NHWC kernel (its own decision), a channels_last output matching
    float64, the lean second call, CUDA graph replay, and torch.compile(fullgraph=True), whose graph assumes
    the op's fake strides (channels_last): outputs must agree with eager."""
    conv = _pruned(nn.Conv2d(32, 48, 3, padding=1), 0.1).to("cuda", dtype)
    layer = SparseConv2d.from_dense(conv, policy="sparse", tune_budget=None, residual=residual, relu=True)
    x = torch.randn(2, 32, 14, 14, device="cuda").to(dtype).contiguous(memory_format=torch.channels_last)
    r = torch.randn(2, 48, 14, 14, device="cuda").to(dtype).contiguous(memory_format=torch.channels_last)
    args = (x, r) if residual else (x,)
    with torch.no_grad():
        want = torch.nn.functional.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
        want = torch.relu(want + r.double() if residual else want)
        y = layer(*args)
        assert (14, 14, "nhwc") in layer._paths and layer._paths[(14, 14, "nhwc")] is not None
        assert layer._paths[(14, 14, "nhwc")].layout == "nhwc"
        assert y.is_contiguous(memory_format=torch.channels_last)
        _close(y, want, dtype)
        _poisoned_pool(y.shape, dtype, torch.channels_last)
        lean = layer(*args)
        _close(lean, want, dtype)
        out = torch.full_like(y, float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(layer(*args))
        graph.replay()
        torch.cuda.synchronize()
        _close(out, want, dtype)

        class Wrap(nn.Module):  # a channels_last consumer after the op: strides matter to the compiled graph
            def __init__(self):
                super().__init__()
                self.layer = layer

            def forward(self, *a):
                return self.layer(*a).flatten(1) * 2.0

        compiled = torch.compile(Wrap(), fullgraph=True)
        got = compiled(*args)
        _close(got / 2.0, want.flatten(1), dtype)
        # the NCHW input of the same size gets its own (NCHW) kernel, and the same values
        nchw = layer(*(t.contiguous() for t in args))
        assert nchw.is_contiguous() and layer._paths[(14, 14)].layout == "nchw"
        _close(nchw, want, dtype)


def test_convert_prebuilds_every_candidate_so_measuring_compiles_nothing(tmp_path, monkeypatch):
    """convert compiles every layer's candidates side by side first (prebuild_layers); the measuring pass then
    finds each kernel it loads in the disk cache."""
    monkeypatch.setenv("SPARSEFORGE_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(8, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                          nn.Flatten(), nn.Linear(32 * 10 * 10, 64))
    for i in (0, 2, 5):
        _pruned(model[i], 0.15, seed=i)
    model = model.cuda().eval()
    x = torch.randn(1, 8, 10, 10, device="cuda")
    from sparseforge.runtime import kernel as kernel_module

    loaded = []
    real = kernel_module.LoadedPlanKernel.__init__

    def record(self, plan, built, device_index, full_plan=None):
        loaded.append(built.hit)
        real(self, plan, built, device_index, full_plan)

    monkeypatch.setattr(kernel_module.LoadedPlanKernel, "__init__", record)
    report = convert(model, x, tune_budget=1.0, time_model=False)
    assert len(report.layers) == 3 and loaded and all(loaded), loaded


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_channels_last_model_is_decided_on_nhwc_kernels_fused_and_kept_channels_last(dtype):
    """convert decides a channels_last model's convolutions on NHWC kernels (the ones it runs), layers kept
    dense read a channels_last W, fuse_epilogues takes their ReLU / shortcut add (checked layer by layer), and
    the output stays channels_last and right against float64."""
    from sparseforge.nn import fuse_epilogues

    torch.manual_seed(4)

    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), _Bottleneck(), _Bottleneck())
    # 90% sparse, the first bottleneck's 3x3 at 98% so that at least one layer wins by a wide margin in every
    # dtype (which of the others convert keeps dense is a measurement: one fp16 run on the H200 kept one)
    for i, m in enumerate(m for m in model.modules() if isinstance(m, nn.Conv2d)):
        _pruned(m, 0.02 if i == 1 else 0.1, seed=10 + i)
    model = model.cuda().eval()
    x = torch.randn(1, 16, 28, 28, device="cuda")
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
    cl = torch.channels_last
    model = model.to(dtype).to(memory_format=cl)
    xs = x.to(dtype).contiguous(memory_format=cl)
    report = convert(model, xs, tune_budget=0.5, time_model=False)
    convs = [m for m in model.modules() if isinstance(m, SparseConv2d)]
    kept = [m for m in model.modules() if type(m) is nn.Conv2d]
    # every layer measured on channels_last input, each one convert kept dense kept by a measured loss
    assert len(report.layers) == 5 and all(layer.input_shapes[0][-1] == "channels_last" for layer in report.layers)
    assert convs and len(convs) + len(kept) == 5, (len(convs), len(kept))
    for layer in report.layers:
        assert layer.times_us.get("dense") and layer.times_us.get("unstructured"), layer
        assert (layer.choice == "dense") == layer.reason.startswith("no sparse path"), layer
    assert all(m.weight.is_contiguous(memory_format=cl) for m in kept)
    for conv in convs:
        assert conv._decided and all(key[-1] == "nhwc" for key in conv._decided), conv._decided
        if any(k is None for k in conv._paths.values()):  # decided dense somewhere: its W is channels_last
            assert conv._dense_in_layout is not None and conv._dense_in_layout[2].is_contiguous(memory_format=cl)
    fused, fuse_report = fuse_epilogues(model, (xs,))
    assert fuse_report.fused and not any(s.name == "(model)" for s in fuse_report.skipped), fuse_report.skipped
    with torch.no_grad():
        out = fused(xs)
    assert out.is_contiguous(memory_format=cl)
    _close(out, want, dtype)
