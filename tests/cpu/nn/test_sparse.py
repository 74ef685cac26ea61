"""SparseLinear and SparseConv2d (nn/sparse.py) on the CPU: the dense path they take there computes what the
original layer does, the CSR buffers round-trip through state_dict and pickling at any nonzero count, casts
and moves forget what was built, and bad input is refused with the problem named."""
import io
import pickle

import pytest
import torch
from torch import nn

from sparseforge.formats import SparseFormatError
from sparseforge.mappings.csr.plan import CsrConfig
from sparseforge.nn import SparseConv2d, SparseLinear, SparseShapeError
from sparseforge.nn.sparse import TimedConfig

from .training import assert_trains_like_dense


def _pruned(module: nn.Module, density: float, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.mul_((torch.rand(module.weight.shape, generator=g) < density).to(module.weight.dtype))
    return module


def test_linear_matches_the_layer_it_came_from_over_any_leading_dimensions():
    linear = _pruned(nn.Linear(48, 20), 0.1)
    layer = SparseLinear.from_dense(linear)
    assert layer.nnz == int(torch.count_nonzero(linear.weight)) and 0.85 < layer.sparsity < 0.95
    for shape in ((48,), (3, 48), (2, 5, 48), (0, 48)):
        x = torch.randn(shape)
        assert torch.equal(layer(x), linear(x))
    assert torch.equal(layer.to_dense().weight, linear.weight) and torch.equal(layer.to_dense().bias, linear.bias)


def test_csr_buffers_hold_exactly_the_nonzeros_in_row_order():
    linear = _pruned(nn.Linear(10, 6, bias=False), 0.3, seed=1)
    layer = SparseLinear.from_dense(linear)
    w = layer.sparse_matrix()
    assert torch.equal(torch.from_numpy(w.to_dense()), linear.weight.detach())
    assert layer.weight_indices.dtype == torch.int32 and layer.weight_indptr[-1] == layer.nnz
    assert layer.bias is None


def test_state_dict_loads_into_a_layer_of_another_nonzero_count_and_pickles():
    source = SparseLinear.from_dense(_pruned(nn.Linear(32, 16), 0.2, seed=2))
    target = SparseLinear.from_dense(_pruned(nn.Linear(32, 16), 0.7, seed=3))
    assert target.nnz != source.nnz
    target.load_state_dict(source.state_dict())
    x = torch.randn(4, 32)
    assert target.nnz == source.nnz and torch.equal(target(x), source(x))
    buffer = io.BytesIO()
    torch.save(nn.Sequential(source), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(x), source(x)) and loaded[0].layer_id != source.layer_id


def test_a_cast_converts_the_values_and_forgets_the_dense_copy():
    layer = SparseLinear.from_dense(_pruned(nn.Linear(16, 8), 0.5, seed=4))
    x = torch.randn(2, 16)
    reference = layer(x)
    assert layer._dense is not None  # the CPU path keeps it
    layer.to(torch.bfloat16)
    assert layer.weight_values.dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16 and layer._dense is None
    assert layer.weight_indices.dtype == torch.int32  # integers are not cast
    got = layer(x.to(torch.bfloat16)).float()
    assert torch.allclose(got, reference, rtol=3e-2, atol=3e-2)


def test_memory_is_the_csr_bytes_unless_dense_is_kept():
    layer = SparseLinear.from_dense(_pruned(nn.Linear(256, 128), 0.1, seed=5))
    csr = layer.memory_bytes()["csr"]
    assert csr == layer.nnz * (4 + 4) + 129 * 8
    assert csr < 0.25 * 256 * 128 * 4  # 90% sparse: about a fifth of the dense bytes
    # on the CPU the buffers are the layer's only copy: they stay where the layer is (the GPU test covers the
    # move to host memory once a kernel holds W)
    layer(torch.randn(4, 256))
    assert not layer.csr_on_host and layer.device == layer.weight_values.device
    assert layer.memory_bytes()["csr_host"] == 0


def test_bad_inputs_are_refused_with_the_problem_named():
    layer = SparseLinear.from_dense(_pruned(nn.Linear(16, 8), 0.5))
    with pytest.raises(SparseShapeError, match=r"shape \(3, 15\); this layer takes \(\.\.\., 16\)"):
        layer(torch.randn(3, 15))
    with pytest.raises(SparseShapeError, match="dtype torch.float16.*cast the input"):
        layer(torch.randn(3, 16).half())
    with pytest.raises(ValueError, match="policy must be one of"):
        SparseLinear(4, 4, policy="fastest")


def test_from_dense_refuses_another_layer_kind_and_non_finite_weights_up_front():
    with pytest.raises(TypeError, match="takes an nn.Linear, got Conv2d; use SparseConv2d.from_dense"):
        SparseLinear.from_dense(nn.Conv2d(3, 4, 3))
    with pytest.raises(TypeError, match="takes an nn.Conv2d, got Linear; use SparseLinear.from_dense"):
        SparseConv2d.from_dense(nn.Linear(3, 4))
    linear, conv = _pruned(nn.Linear(16, 8), 0.5), nn.Conv2d(4, 4, 3)
    with torch.no_grad():
        linear.weight[2, 5], conv.weight[1, 2, 0, 1] = float("nan"), float("-inf")
    with pytest.raises(SparseFormatError, match=r"weight\[2, 5\] = nan is not finite"):
        SparseLinear.from_dense(linear)
    with pytest.raises(SparseFormatError, match=r"weight\[1, 19\] = -inf is not finite"):  # 2 * 9 + 0 * 3 + 1
        SparseConv2d.from_dense(conv)


@pytest.mark.parametrize("kwargs", [dict(kernel_size=3, padding=1), dict(kernel_size=(1, 5), stride=2),
                                    dict(kernel_size=3, dilation=2, groups=4), dict(kernel_size=3, padding="same"),
                                    dict(kernel_size=7, stride=2, padding=3, bias=False)])
def test_conv_matches_the_layer_it_came_from(kwargs):
    conv = _pruned(nn.Conv2d(8, 16, **kwargs), 0.2, seed=6)
    layer = SparseConv2d.from_dense(conv)
    x = torch.randn(2, 8, 13, 11)
    assert torch.allclose(layer(x), conv(x), atol=1e-6)
    assert torch.equal(layer.to_dense().weight, conv.weight)


def test_conv_with_relu_fused_and_refusals():
    conv = _pruned(nn.Conv2d(4, 6, 3), 0.3)
    layer = SparseConv2d.from_dense(conv, relu=True)
    x = torch.randn(1, 4, 7, 7)
    assert torch.equal(layer(x), torch.relu(conv(x)))
    assert isinstance(layer.to_dense(), nn.Sequential)
    with pytest.raises(SparseShapeError, match=r"takes \(batch, 4, H, W\)"):
        layer(torch.randn(1, 3, 7, 7))
    with pytest.raises(ValueError, match="zeros only"):
        SparseConv2d.from_dense(nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"))


def test_conv_with_a_residual_adds_it_before_the_relu_and_checks_it():
    conv = _pruned(nn.Conv2d(4, 6, 3, padding=1), 0.3, seed=2).double()
    layer = SparseConv2d.from_dense(conv, relu=True, residual=True)
    x, r = torch.randn(2, 4, 7, 7, dtype=torch.float64), torch.randn(2, 6, 7, 7, dtype=torch.float64)
    assert torch.allclose(layer(x, residual=r), torch.relu(conv(x) + r), rtol=1e-12, atol=1e-12)
    dense = layer.to_dense()
    assert torch.allclose(dense(x, r), torch.relu(conv(x) + r), rtol=1e-12, atol=1e-12)
    assert "residual=True" in repr(layer)
    with pytest.raises(SparseShapeError, match=r"call it as layer\(x, residual=r\), r of shape \(2, 6, 7, 7\)"):
        layer(x)
    with pytest.raises(SparseShapeError, match=r"residual has shape \(2, 6, 7, 6\); the output's is \(2, 6, 7, 7\)"):
        layer(x, residual=r[..., :6])
    with pytest.raises(SparseShapeError, match="give both alike"):
        layer(x, residual=r.float())
    plain = SparseConv2d.from_dense(conv)
    with pytest.raises(SparseShapeError, match="adds no residual"):
        plain(x, residual=r)


def test_set_epilogue_on_a_layer_without_kernels_only_changes_what_follows():
    conv = _pruned(nn.Conv2d(4, 6, 1), 0.3, seed=3).double()
    layer = SparseConv2d.from_dense(conv)
    x, r = torch.randn(1, 4, 5, 5, dtype=torch.float64), torch.randn(1, 6, 5, 5, dtype=torch.float64)
    layer.set_epilogue(relu=True, residual=True)
    assert layer.relu and layer.residual
    assert torch.allclose(layer(x, residual=r), torch.relu(conv(x) + r), rtol=1e-12, atol=1e-12)


def test_every_sparse_module_kind_gets_its_own_id_in_the_op_registry():
    """SparseLinear and SparseLinear24 share torch.library's registry: one counter, no collisions."""
    from sparseforge.nn import SparseLinear24
    from sparseforge.ops import LAYERS

    a = SparseLinear(16, 16)
    b = SparseLinear24(16, 16)
    assert a.layer_id != b.layer_id and LAYERS[a.layer_id] is a and LAYERS[b.layer_id] is b
    del b
    assert LAYERS.get(a.layer_id) is a


def test_a_layer_built_in_inference_mode_runs_and_keeps_its_dense_copy():
    with torch.inference_mode():
        layer = SparseLinear.from_dense(_pruned(nn.Linear(16, 8), 0.5))
        x = torch.randn(2, 16)
        first = layer(x)
        assert torch.equal(layer(x), first) and layer._dense is not None


def test_dense_path_compiles_fullgraph_at_several_widths():
    layer = SparseLinear.from_dense(_pruned(nn.Linear(16, 8), 0.5), policy="dense")
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    for n in (3, 5, 7):
        x = torch.randn(n, 16)
        assert torch.allclose(compiled(x), layer(x))


def test_state_dict_of_another_shape_is_refused_with_the_reason():
    small = SparseLinear.from_dense(_pruned(nn.Linear(16, 8), 0.5))
    other = SparseLinear.from_dense(_pruned(nn.Linear(32, 4), 0.5))
    with pytest.raises(RuntimeError, match="weight_indptr has 5 entries; this layer's 8 rows need 9"):
        small.load_state_dict(other.state_dict())
    wide = SparseLinear.from_dense(_pruned(nn.Linear(64, 8), 0.5))
    with pytest.raises(RuntimeError, match="weight_indices reach .*; this layer has 16 columns"):
        small.load_state_dict(wide.state_dict())


def test_padding_same_with_an_even_kernel_is_refused():
    with pytest.raises(ValueError, match="pads unevenly"):
        SparseConv2d.from_dense(nn.Conv2d(4, 4, (1, 2), padding="same"))


def test_a_layer_built_on_meta_and_assigned_a_state_computes_where_the_state_is():
    source = SparseLinear.from_dense(_pruned(nn.Linear(32, 16), 0.3, seed=7))
    with torch.device("meta"):
        layer = SparseLinear(32, 16, nnz=source.nnz)
    layer.load_state_dict(source.state_dict(), assign=True)
    assert layer.device.type == "cpu" and not layer.csr_on_host
    x = torch.randn(3, 32)
    assert torch.equal(layer(x), source(x))
    assert all(t.device.type == "cpu" for t in layer.state_dict().values())


class _Choice:
    def __init__(self, sparse_us, dense_us):
        self.sparse_us, self.dense_us = sparse_us, dense_us
        self.records = [{"family": "csr", "config": {}, "mapping": "csr", "us": sparse_us}]  # the winner, timed


class _FakeKernel:
    """What _path needs of a kernel: its chooser's graph-replay times, a mapping name, its config, and a
    call."""
    mapping, weight_bytes = "fake", 0

    def __init__(self, layer, sparse_us, dense_us):
        self.choice, self.layer, self.calls = _Choice(sparse_us, dense_us), layer, 0
        self.config = CsrConfig()

    def __call__(self, x, residual=None):
        self.calls += 1
        return torch.nn.functional.linear(x, self.layer.dense_weight_2d(), self.layer.bias)


def _stub_eager_times(monkeypatch, layer, kernel_us, dense_us):
    """eager_time_us returning kernel_us for the kernel's call and dense_us for dense's."""
    import sparseforge.runtime.timing as timing

    def eager_time_us(fn, inputs, repeats=25):
        before = kernel_calls[0].calls if kernel_calls else 0
        fn(inputs[0])
        return kernel_us if kernel_calls and kernel_calls[0].calls > before else dense_us

    kernel_calls = []
    monkeypatch.setattr(timing, "eager_time_us", eager_time_us)
    return kernel_calls


@pytest.mark.parametrize("eager_kernel_us, runs_dense", [(30.0, True), (6.0, False)])
def test_a_width_the_kernel_wins_in_a_graph_is_timed_eagerly_and_runs_dense_where_eager_dense_wins(
        monkeypatch, eager_kernel_us, runs_dense):
    layer = SparseLinear.from_dense(_pruned(nn.Linear(32, 16), 0.2), policy="measure")
    kernel = _FakeKernel(layer, sparse_us=4.0, dense_us=8.0)  # the kernel wins 2x under graph replay
    calls = _stub_eager_times(monkeypatch, layer, eager_kernel_us, 10.0)
    calls.append(kernel)
    monkeypatch.setattr(SparseLinear, "_compile", lambda self, rows: kernel)
    monkeypatch.setattr(SparseLinear, "_measures_eagerly", lambda self, x: True)
    x = torch.randn(5, 32)
    assert layer._path(5, x) is kernel
    [graph], [eager] = layer.decisions, layer.eager_decisions
    assert graph.path == "unstructured" and graph.mode == "graph"
    assert eager.mode == "eager" and (eager.sparse_us, eager.dense_us) == (eager_kernel_us, 10.0)
    assert (eager.path == "dense") == runs_dense and (5 in layer._eager_dense) == runs_dense
    # the dense W is kept only where an eager call of this width needs it
    assert (layer._dense is not None) == runs_dense
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert layer._runs_dense_eagerly(5) == runs_dense
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not layer._runs_dense_eagerly(5)  # a captured call keeps the kernel, the graph decision
    with torch.no_grad():
        layer.weight_values.mul_(2)  # an in-place edit: every decision is made again
    layer._refresh()
    assert layer.eager_decisions == [] and not layer._eager_dense


def test_a_width_dense_in_a_graph_is_not_timed_eagerly(monkeypatch):
    layer = SparseLinear.from_dense(_pruned(nn.Linear(32, 16), 0.2), policy="measure")
    kernel = _FakeKernel(layer, sparse_us=9.0, dense_us=8.0)
    monkeypatch.setattr(SparseLinear, "_compile", lambda self, rows: kernel)
    monkeypatch.setattr(SparseLinear, "_measures_eagerly", lambda self, x: True)
    monkeypatch.setattr(SparseLinear, "_decide_eagerly", lambda *a: pytest.fail("timed eagerly"))
    assert layer._path(3, torch.randn(3, 32)) is None
    assert layer.decisions[0].path == "dense" and layer.eager_decisions == []
    # the kernel that lost is remembered for callers that keep no dense W (a decoder layer runs it anyway)
    assert layer.kernel_configs() == {} and layer.fastest_kernel_configs() == {3: kernel.config}
    assert layer.timed_configs(3) == [TimedConfig(CsrConfig(), 9.0)] and layer.timed_configs(5) == []


def test_a_conv_with_a_residual_is_timed_eagerly_with_one(monkeypatch):
    layer = SparseConv2d.from_dense(_pruned(nn.Conv2d(4, 6, 3, padding=1), 0.3), policy="measure", residual=True)
    x = torch.randn(1, 4, 7, 7)
    (r,) = layer._eager_extra(x)
    assert r.shape == (1, 6, 7, 7)
    want = torch.nn.functional.conv2d(x, layer.dense_weight(), layer.bias, padding=1) + r
    assert torch.allclose(layer._dense_call(x, r), want, atol=1e-6)
    assert SparseConv2d.from_dense(nn.Conv2d(4, 6, 3))._eager_extra(x) == ()


def test_eager_timing_is_off_by_default_and_takes_a_contiguous_copy(monkeypatch):
    layer = SparseLinear.from_dense(_pruned(nn.Linear(32, 16), 0.2), policy="measure")
    assert not layer._measures_eagerly(torch.randn(2, 32))  # off by default (and never on the CPU)
    seen = []

    class Strict(_FakeKernel):
        def __call__(self, x, residual=None):
            assert x.is_contiguous(), "the kernels refuse a non-contiguous input"
            seen.append(x.shape)
            return super().__call__(x)

    kernel = Strict(layer, 4.0, 8.0)
    calls = _stub_eager_times(monkeypatch, layer, 5.0, 10.0)
    calls.append(kernel)
    monkeypatch.setattr(SparseLinear, "_compile", lambda self, rows: kernel)
    monkeypatch.setattr(SparseLinear, "_measures_eagerly", lambda self, x: True)
    transposed = torch.randn(32, 6).t()  # 6 x 32, not contiguous
    assert layer._path(6, transposed) is kernel and seen and layer.eager_decisions[0].path == "unstructured"


def test_a_failed_eager_timing_keeps_the_kernel_with_the_reason(monkeypatch):
    import sparseforge.runtime.timing as timing

    layer = SparseLinear.from_dense(_pruned(nn.Linear(32, 16), 0.2), policy="measure")
    kernel = _FakeKernel(layer, 4.0, 8.0)
    monkeypatch.setattr(SparseLinear, "_compile", lambda self, rows: kernel)
    monkeypatch.setattr(SparseLinear, "_measures_eagerly", lambda self, x: True)

    def oom(fn, inputs, repeats=25):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(timing, "eager_time_us", oom)
    assert layer._path(2, torch.randn(2, 32)) is kernel
    [eager] = layer.eager_decisions
    assert eager.path == "unstructured" and "eager timing failed" in eager.reason and not layer._eager_dense
    assert layer._dense is None


def test_set_epilogue_forgets_eager_decisions_and_restore_brings_them_back():
    layer = SparseConv2d.from_dense(_pruned(nn.Conv2d(4, 6, 3, padding=1), 0.3), policy="measure")
    layer._eager_decided, layer._eager_dense = {(7, 7): "decision"}, {(7, 7)}
    state = layer.epilogue_state()
    layer.set_epilogue(relu=True, residual=False)
    assert layer._eager_decided == {} and layer._eager_dense == set()
    layer.restore_epilogue(state)
    assert layer._eager_decided == {(7, 7): "decision"} and layer._eager_dense == {(7, 7)}


def test_a_dense_w_made_under_inference_mode_serves_a_later_autograd_call():
    dense = _pruned(nn.Linear(8, 4), 0.5)
    layer = SparseLinear.from_dense(dense)
    with torch.inference_mode():
        layer(torch.randn(2, 8))  # makes the dense W (the CPU path)
    assert not layer._dense.is_inference()
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()
    assert torch.allclose(x.grad, dense.weight.detach().sum(0).expand(2, 8))


class _LayoutKernel:
    """A convolution kernel stub (CPU) that computes with cuDNN's math and, like the real kernels, takes x (and
    the residual) only in its own layout and writes its output in that layout."""
    mapping, weight_bytes = "fake", 0

    def __init__(self, layer, layout):
        self.choice, self.layer, self.layout, self.calls = _Choice(4.0, 8.0), layer, layout, 0
        self.memory_format = torch.channels_last if layout == "nhwc" else torch.contiguous_format

    def __call__(self, x, residual=None):
        self.calls += 1
        assert x.is_contiguous(memory_format=self.memory_format), f"{self.layout} kernel given {x.stride()}"
        y = self.layer._dense_forward(x, residual)
        if residual is not None:
            assert residual.is_contiguous(memory_format=self.memory_format)
        return y.contiguous(memory_format=self.memory_format)


@pytest.mark.parametrize("residual", [False, True])
def test_a_channels_last_input_gets_its_own_nhwc_kernel_and_output(monkeypatch, residual):
    """SparseConv2d keys its kernels by layout: an NCHW and a channels_last input of one size get two kernels
    (compiled with layout 'nchw' and 'nhwc'); each output keeps its input's layout; the residual is handed
    over in the kernel's layout; the second call of each takes the lean path (no checked forward)."""
    layer = SparseConv2d.from_dense(_pruned(nn.Conv2d(4, 6, 3, padding=1), 0.3), policy="sparse",
                                    residual=residual)
    made = []

    def compile_(self, x):
        layout = "nhwc" if x.dim() == 4 and not x.is_contiguous() and \
            x.is_contiguous(memory_format=torch.channels_last) else "nchw"
        made.append(layout)
        return _LayoutKernel(self, layout)

    monkeypatch.setattr(SparseConv2d, "_compile", compile_)
    monkeypatch.setattr(SparseConv2d, "_dense_path", lambda self, x, residual=None: False)
    x = torch.randn(2, 4, 7, 7)
    r = torch.randn(2, 6, 7, 7) if residual else None
    want = layer._dense_forward(x, r)
    with torch.no_grad():
        y = layer(x, r) if residual else layer(x)
        x_cl = x.contiguous(memory_format=torch.channels_last)
        r_cl = r.contiguous(memory_format=torch.channels_last) if residual else None
        y_cl = layer(x_cl, r) if residual else layer(x_cl)  # an NCHW residual is converted for the NHWC kernel
    assert made == ["nchw", "nhwc"] and set(layer._paths) == {(7, 7), (7, 7, "nhwc")}
    assert y.is_contiguous() and y_cl.is_contiguous(memory_format=torch.channels_last) and not y_cl.is_contiguous()
    assert torch.allclose(y, want, atol=1e-6) and torch.allclose(y_cl, want, atol=1e-6)
    checked = []
    monkeypatch.setattr(SparseConv2d, "_checked_forward", lambda self, *a: checked.append(a) or pytest.fail("checked"))
    with torch.no_grad():
        again = layer(x_cl, r_cl) if residual else layer(x_cl)
        again_nchw = layer(x, r) if residual else layer(x)
    assert not checked and torch.equal(again, y_cl) and torch.equal(again_nchw, y)
    assert again.is_contiguous(memory_format=torch.channels_last)
    assert [k.calls for k in layer._paths.values()] == [2, 2]


def test_the_lean_paths_fall_back_to_the_checks_for_what_they_do_not_take(monkeypatch):
    """An input of another dtype, a wrong residual, or one needing grad skips the lean path: the checked
    forward names the problem (or runs dense under autograd)."""
    layer = SparseConv2d.from_dense(_pruned(nn.Conv2d(4, 6, 3, padding=1), 0.3), policy="sparse", residual=True)
    monkeypatch.setattr(SparseConv2d, "_compile", lambda self, x: _LayoutKernel(self, "nchw"))
    dense_path = SparseConv2d._dense_path
    monkeypatch.setattr(SparseConv2d, "_dense_path",
                        lambda self, x, residual=None: dense_path(self, x, residual) if self._needs_grad(x, residual)
                        else False)
    x, r = torch.randn(1, 4, 7, 7), torch.randn(1, 6, 7, 7)
    with torch.no_grad():
        layer(x, r)  # the kernel ran: the lean path is armed
    assert layer._hot is not None
    with torch.no_grad(), pytest.raises(SparseShapeError, match="dtype"):
        layer(x.double(), r)
    with torch.no_grad(), pytest.raises(SparseShapeError, match="residual has shape"):
        layer(x, torch.randn(1, 6, 5, 5))
    with torch.no_grad(), pytest.raises(SparseShapeError, match="adds a residual"):
        layer(x)
    grad_x = x.clone().requires_grad_()
    y = layer(grad_x, r)  # autograd: the dense path, whose result has a grad_fn
    assert y.grad_fn is not None
    with torch.no_grad():
        layer.weight_values.mul_(2)  # an in-place edit: the lean path re-decides (the version check)
        layer(x, r)
    assert len(layer._paths) == 1


def test_a_linear_lean_call_hands_the_kernel_the_rows_as_they_lie(monkeypatch):
    """SparseLinear's lean path: a contiguous 3-D input goes to launch_rows without a reshape, its output
    allocated (batch, tokens, out); a kernel that cannot take rows unchecked gets the 2-D rows."""
    layer = SparseLinear.from_dense(_pruned(nn.Linear(32, 16), 0.3), policy="sparse")
    launched = []

    class RowsKernel(_FakeKernel):
        takes_rows_unchecked = True

        def launch_rows(self, b, out):
            launched.append((tuple(b.shape), tuple(out.shape)))
            out.copy_(torch.nn.functional.linear(b, self.layer.dense_weight_2d(), self.layer.bias))

    kernel = RowsKernel(layer, 4.0, 8.0)
    monkeypatch.setattr(SparseLinear, "_compile", lambda self, rows: kernel)
    monkeypatch.setattr(SparseLinear, "_dense_path", lambda self, x: False)
    x = torch.randn(2, 3, 32)
    want = torch.nn.functional.linear(x, layer.dense_weight_2d(), layer.bias)
    with torch.no_grad():
        first = layer(x)  # checked path: decides width 6, calls the kernel on 2-D rows
        second = layer(x)  # lean path
    assert kernel.calls == 1 and launched == [((2, 3, 32), (2, 3, 16))]
    assert torch.allclose(first, want, atol=1e-6) and torch.allclose(second, want, atol=1e-6)
    RowsKernel.takes_rows_unchecked = False
    with torch.no_grad():
        third = layer(x)
    assert kernel.calls == 2 and torch.allclose(third, want, atol=1e-6)


def test_the_conv_op_fake_keeps_a_channels_last_input_layout():
    """Under torch.compile the op's fake decides the output strides the graph assumes: channels_last for a
    channels_last input, NCHW otherwise (the eager op makes its output match)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import sparseforge.ops  # noqa: F401  (registers the ops)

    with FakeTensorMode():
        anchor = torch.empty(0)
        x = torch.empty(2, 4, 7, 7)
        y = torch.ops.sparseforge.sparse_conv2d(x.contiguous(memory_format=torch.channels_last), anchor, None, 0,
                                                6, 5, 5)
        z = torch.ops.sparseforge.sparse_conv2d(x, anchor, None, 0, 6, 5, 5)
        assert y.shape == (2, 6, 5, 5) and y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
        assert z.is_contiguous()


def test_a_bias_or_residual_needing_grad_sends_the_call_to_the_dense_path():
    """The kernels record no autograd graph: where the bias (bias-only fine-tuning) or the residual requires
    grad, the layer runs dense, so their gradients are not dropped."""
    layer = SparseConv2d.from_dense(_pruned(nn.Conv2d(4, 6, 3, padding=1), 0.3), policy="sparse", residual=True)
    x, r = torch.randn(1, 4, 7, 7), torch.randn(1, 6, 7, 7)
    assert not layer._needs_grad(x, r)
    assert layer._needs_grad(x, r.clone().requires_grad_())
    layer.bias.requires_grad_(True)
    assert layer._needs_grad(x, r)
    y = layer(x, r)
    y.sum().backward()
    assert layer.bias.grad is not None and torch.allclose(layer.bias.grad, torch.full((6,), 49.0))


def test_a_channels_last_input_runs_dense_on_a_channels_last_weight_made_once(monkeypatch):
    """cuDNN turns a weight not in its input's layout into one on every call (a copy kernel a call, inside a
    CUDA graph too): a channels_last input of a layer decided dense reads a channels_last W, made when the
    shape is decided (not at a later call, which may be a capture), kept, counted in memory_bytes, and
    dropped with the dense W."""
    conv = _pruned(nn.Conv2d(8, 6, 3, padding=1), 0.3)
    layer = SparseConv2d.from_dense(conv, policy="dense")
    x = torch.randn(1, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    seen = []
    real_conv2d = torch.nn.functional.conv2d
    monkeypatch.setattr(torch.nn.functional, "conv2d", lambda inp, w, *a: seen.append(w) or real_conv2d(inp, w, *a))
    with torch.no_grad():
        y, again = layer(x), layer(x)
        nchw = layer(x.contiguous())
    assert torch.allclose(y, conv(x), atol=1e-6) and torch.equal(again, y) and torch.allclose(nchw, y, atol=1e-6)
    assert seen[0].is_contiguous(memory_format=torch.channels_last) and not seen[0].is_contiguous()
    assert seen[1] is seen[0]  # made once
    assert seen[2].is_contiguous()  # an NCHW input keeps the NCHW W
    dense_bytes = 6 * 8 * 9 * 4
    assert layer.memory_bytes()["dense"] == 2 * dense_bytes  # both layouts are held, and counted
    layer._drop_dense()
    assert layer._dense is None and layer._dense_in_layout is None and layer.memory_bytes()["dense"] == 0
    for forget in (lambda: layer.to(torch.float64), lambda: layer.load_state_dict(layer.state_dict())):
        with torch.no_grad():
            layer(x.to(layer.weight_values.dtype))
        assert layer._dense_in_layout is not None
        forget()  # a cast, a load: the copy belongs to the old W
        assert layer._dense_in_layout is None
    with torch.no_grad():
        layer(x.double())
    assert pickle.loads(pickle.dumps(layer))._dense_in_layout is None


def test_a_channels_last_shape_decided_dense_gets_its_w_when_decided():
    """prepare(channels_last=True) on a layer the kernels refuse here (the CPU): dense, and the channels_last W
    made then, before any call (which may be a CUDA graph capture)."""
    layer = SparseConv2d.from_dense(_pruned(nn.Conv2d(8, 6, 3, padding=1), 0.3))
    decisions = layer.prepare([(1, 8, 5, 5)], channels_last=True)
    assert [d.path for d in decisions] == ["dense"] and layer._dense_in_layout is not None
    assert layer._dense_in_layout[2].is_contiguous(memory_format=torch.channels_last)


def test_a_channels_last_dense_weight_is_not_made_during_a_capture(monkeypatch):
    """During a CUDA graph capture nothing may be allocated to keep: the NCHW W serves (cuDNN converts it in the
    graph) and nothing is kept."""
    layer = SparseConv2d.from_dense(_pruned(nn.Conv2d(4, 4, 3), 0.5), policy="dense")
    layer.dense_weight_2d()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    w = layer.dense_weight(torch.channels_last)
    assert w.is_contiguous() and not w.is_contiguous(memory_format=torch.channels_last)
    assert layer._dense_in_layout is None


def test_a_move_to_where_the_layer_is_keeps_its_decisions_and_a_cast_forgets_them():
    """model.to(its own device) (pipelines move the models they are given) keeps what the layer decided and
    built; a cast to another dtype builds them again."""
    torch.manual_seed(0)
    layer = SparseLinear.from_dense(nn.Linear(16, 8), policy="sparse")
    layer._decided[1] = "decided at conversion"
    layer.to("cpu")
    layer.float()
    assert layer._decided == {1: "decided at conversion"}
    layer.double()
    assert layer._decided == {} and layer.weight_values.dtype == torch.float64


def test_a_cast_of_every_tensor_is_refused_before_it_reaches_the_csr_indices():
    layer = SparseLinear.from_dense(nn.Linear(16, 8), policy="sparse")
    indices = layer.weight_indices.clone()
    with pytest.raises(TypeError, match=r"CSR indices too.*\.to\(dtype\)"):
        layer.type(torch.DoubleTensor)
    assert torch.equal(layer.weight_indices, indices) and layer.weight_values.dtype == torch.float32


@pytest.mark.parametrize("kind", ["linear", "conv", "conv channels_last"])
@pytest.mark.parametrize("compiled", [False, True])
def test_values_being_trained_get_the_dense_layers_gradient_step_after_step(kind, compiled):
    """W's values requiring grad (the dense path): W is made from them at each call, where autograd sees it,
    and never kept (each step changes them), so values.grad is the dense layer's weight gradient at the stored
    positions, after an optimizer step too; eagerly and under torch.compile."""
    if kind == "linear":
        dense = _pruned(nn.Linear(24, 10), 0.4, seed=7).double()
        layer = SparseLinear.from_dense(dense)
        shape = (5, 24)
    else:
        dense = _pruned(nn.Conv2d(4, 6, 3, padding=1), 0.4, seed=7).double()
        layer = SparseConv2d.from_dense(dense)
        shape = (2, 4, 7, 7)
    layout = torch.channels_last if kind.endswith("channels_last") else torch.contiguous_format
    rows, cols = layer._shape2d
    stored = (torch.repeat_interleave(torch.arange(rows), torch.diff(layer.weight_indptr)), layer.weight_indices.long())
    values = layer.weight_values.requires_grad_(True)
    run = torch.compile(layer, backend="aot_eager") if compiled else layer
    inputs = (torch.randn(shape, dtype=torch.float64).contiguous(memory_format=layout) for _ in range(3))
    assert_trains_like_dense(run, dense, values, stored, inputs, as_matrix=lambda w: w.view(rows, cols))
    assert layer._dense is None and layer._dense_in_layout is None
