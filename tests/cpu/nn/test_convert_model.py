"""convert() and BatchNorm folding (nn/convert.py, nn/fold.py) on the CPU: folding is exact in float64 and
only where the graph allows it; the per-layer pick follows the measured times (stubbed here: the GPU test
measures them); policies 'sparse' and 'dense'; a model that is not on a GPU is refused for 'measure'."""
import pytest
import torch
from torch import nn

from sparseforge.nn import SparseConv2d, SparseLinear, convert, fold_batchnorms, fold_conv_bn, measure_layer
from sparseforge.semi.decide import Decision


def _bn(channels: int, seed: int) -> nn.BatchNorm2d:
    g = torch.Generator().manual_seed(seed)
    bn = nn.BatchNorm2d(channels)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(channels, generator=g))
        bn.running_var.copy_(torch.rand(channels, generator=g) + 0.5)
        bn.weight.copy_(torch.randn(channels, generator=g))
        bn.bias.copy_(torch.randn(channels, generator=g))
    return bn.eval()


def test_folding_one_pair_is_exact_in_float64_and_keeps_the_zeros():
    conv = nn.Conv2d(3, 5, 3, padding=1, bias=False).double()
    with torch.no_grad():
        conv.weight[:, :, 0, 0] = 0
    bn = _bn(5, 0).double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    want = bn(conv(x))
    fold_conv_bn(conv, bn)
    assert torch.allclose(conv(x), want, rtol=1e-12, atol=1e-12)
    assert (conv.weight[:, :, 0, 0] == 0).all()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1), _bn(4, 1)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 1), _bn(4, 2)
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        z = self.conv2(y)
        return self.bn2(z) + z  # conv2's output is used twice: bn2 must not fold


def test_only_pairs_where_the_conv_output_feeds_the_batchnorm_alone_fold():
    model = Block().eval()
    x = torch.randn(1, 4, 5, 5)
    want = model(x)
    report = fold_batchnorms(model)
    assert report.folded == [("conv1", "bn1")]
    assert isinstance(model.bn1, nn.Identity) and isinstance(model.bn2, nn.BatchNorm2d)
    assert [s.name for s in report.skipped] == ["bn2"] and "used elsewhere" in report.skipped[0].reason
    assert torch.allclose(model(x), want, atol=1e-5)


def _pruned(layer: nn.Module, seed: int = 0) -> nn.Module:
    """The layer with half of its weight zeroed: convert and measure_layer keep a layer with nothing pruned
    dense, and these tests are about the sparse module."""
    with torch.no_grad():
        layer.weight.mul_(torch.rand(layer.weight.shape, generator=torch.Generator().manual_seed(seed)) > 0.5)
    return layer


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), _bn(8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    with torch.no_grad():
        for layer in (model[0], model[4]):
            layer.weight.mul_((torch.rand_like(layer.weight) < 0.2).float())
    return model.eval()


def test_policy_sparse_puts_in_the_unstructured_modules_and_keeps_the_outputs():
    model = _model()
    x = torch.randn(2, 3, 6, 6)
    want = model(x)
    report = convert(model, x, policy="sparse")
    assert isinstance(model[0], SparseConv2d) and isinstance(model[4], SparseLinear)
    assert isinstance(model[1], nn.Identity)
    assert [layer.choice for layer in report.layers] == ["unstructured", "unstructured"]
    assert report.layers[1].input_shapes == [[2, 288]] and report.folded == [("0", "1")]
    assert torch.allclose(model(x), want, atol=1e-5)
    assert report.memory_after_bytes < report.memory_before_bytes  # 80% sparse: CSR beats dense
    # each layer's own seconds, within the whole; nothing compiled ahead where nothing is measured
    assert all(layer.seconds > 0 for layer in report.layers)
    assert sum(layer.seconds for layer in report.layers) <= report.seconds and report.compile_seconds == 0
    assert report.as_dict()["compile_seconds"] == 0 and "compiling" not in str(report)


def test_policy_dense_replaces_nothing_and_measure_needs_a_gpu():
    model = _model()
    report = convert(model, torch.randn(1, 3, 6, 6), policy="dense", fold_bn=False)
    assert isinstance(model[0], nn.Conv2d) and [layer.choice for layer in report.layers] == ["dense", "dense"]
    with pytest.raises(ValueError, match="CUDA device.*model.cuda\\(\\)"):
        convert(_model(), torch.randn(1, 3, 6, 6))
    with pytest.raises(ValueError, match="policy must be"):
        convert(_model(), torch.randn(1, 3, 6, 6), policy="fast")


@pytest.mark.parametrize("sparse_us, dense_us, choice", [(5.0, 10.0, "unstructured"), (9.9, 10.0, "dense"),
                                                         (12.0, 10.0, "dense")])
def test_measured_pick_keeps_sparse_only_with_the_margin(monkeypatch, sparse_us, dense_us, choice):
    """The timings are stubbed (prepare's decisions); the pick and the report are measure_layer's own."""
    def prepare(self, widths):
        return [Decision(8, "unstructured", "stub", sparse_us / 2, dense_us / 2, mode="graph") for _ in widths]

    monkeypatch.setattr(SparseLinear, "prepare", prepare)
    linear = _pruned(nn.Linear(64, 32))
    layer, replacement = measure_layer("fc", linear, [(4, 64), (1, 64)], "measure", 5.0)
    assert layer.times_us == {"dense": dense_us, "unstructured": sparse_us}
    assert layer.kernel_us == {"unstructured": sparse_us}
    assert layer.choice == choice and (replacement is not None) == (choice == "unstructured")
    if choice == "unstructured":
        assert isinstance(replacement, SparseLinear) and layer.speedup == pytest.approx(dense_us / sparse_us)
    else:
        assert "kept dense" in layer.reason


def test_folding_into_a_masked_convolution_scales_the_original_weight():
    """prune_model keeps its masks as parametrizations by default: conv.weight is computed, so folding must
    scale the stored original (a per-row scale commutes with the mask)."""
    from sparseforge.prune import prune_model

    model = _model()
    prune_model(model, sparsity=0.8, include=r"^0$")  # masks kept
    x = torch.randn(2, 3, 6, 6)
    want = model(x)
    report = convert(model, x, policy="sparse")
    assert report.folded == [("0", "1")] and torch.allclose(model(x), want, atol=1e-5)


def test_batchnorms_without_running_statistics_or_in_training_are_skipped_with_the_reason():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False), nn.Conv2d(4, 4, 1),
                          _bn(4, 9))
    model[1].eval()
    model[3].train()
    report = fold_batchnorms(model)
    assert report.folded == []
    reasons = {s.name: s.reason for s in report.skipped}
    assert "no running statistics" in reasons["1"] and "training mode" in reasons["3"]


def test_dtype_casts_the_example_inputs_too_and_shared_layers_are_replaced_everywhere():
    shared = nn.Linear(16, 16)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    with torch.no_grad():
        shared.weight.mul_((torch.rand_like(shared.weight) < 0.3).float())
    x = torch.randn(2, 16)
    report = convert(model, x, dtype=torch.bfloat16, policy="sparse")
    assert isinstance(model[0], SparseLinear) and model[2] is model[0] and len(report.layers) == 1
    assert model(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_a_layer_the_kernels_refuse_stays_dense_with_the_reason(monkeypatch):
    from sparseforge.nn import SparseConv2d

    def refuse(self, x):
        raise ValueError("an 11 x 11 kernel has 121 taps; at most 63")

    monkeypatch.setattr(SparseConv2d, "_compile", refuse)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    conv = _pruned(nn.Conv2d(3, 8, 11))
    layer, replacement = measure_layer("stem", conv, [(1, 3, 32, 32)], "measure", 1.0)
    assert replacement is None and layer.choice == "dense" and "not measured" in layer.reason


def test_a_width_kept_dense_counts_its_dense_time_for_the_unstructured_module(monkeypatch):
    """The unstructured module runs dense where dense won: its cost is the kernel's time at n = 1 plus
    dense's at n = 512, not the slower kernel's; repeated widths count once."""
    def prepare(self, widths):
        assert widths == [1, 512]
        return [Decision(1, "unstructured", "stub", 5.0, 10.0, mode="graph"),
                Decision(512, "dense", "stub", 200.0, 50.0, mode="graph")]

    monkeypatch.setattr(SparseLinear, "prepare", prepare)
    layer, replacement = measure_layer("fc", _pruned(nn.Linear(64, 32)), [(1, 64), (512, 64), (2, 256, 64)], "measure",
                                       5.0)
    assert layer.times_us == {"dense": 60.0, "unstructured": 55.0}
    assert layer.kernel_us == {"unstructured": 205.0}  # the report keeps what the kernel measured where it lost
    assert layer.as_dict()["kernel_us"] == {"unstructured": 205.0}
    assert layer.choice == "unstructured" and isinstance(replacement, SparseLinear)


def test_folding_traces_past_sparse_layers_already_in_the_model():
    model = _model()
    model[4] = SparseLinear.from_dense(model[4])
    x = torch.randn(2, 3, 6, 6)
    want = model(x)
    assert fold_batchnorms(model).folded == [("0", "1")]
    assert torch.allclose(model(x), want, atol=1e-5)


def test_a_channels_last_conv_input_is_decided_on_an_nhwc_kernel_and_reported_so(monkeypatch):
    """convert records each conv input's layout with its shape: a channels_last one is prepared as such (its
    NHWC kernel, the one the model will run), not as an NCHW shape that the model never feeds it (whose
    kernel would be compiled and timed for nothing, the NHWC one left to the first call)."""
    from sparseforge.nn.convert import CHANNELS_LAST, _input_shapes

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 25, 4))
    x = torch.randn(2, 3, 5, 5).contiguous(memory_format=torch.channels_last)
    shapes = _input_shapes(model, (x,), [model[0], model[2]])
    assert shapes[model[0]] == [(2, 3, 5, 5, CHANNELS_LAST)] and shapes[model[2]] == [(2, 200)]
    assert _input_shapes(model, (x.contiguous(),), [model[0]])[model[0]] == [(2, 3, 5, 5)]

    prepared = []

    def prepare(self, input_shapes, channels_last=False):
        prepared.append((list(input_shapes), channels_last))
        for shape in input_shapes:
            self._decided[(shape[2], shape[3], channels_last)] = Decision(50, "unstructured", "stub", 4.0, 8.0,
                                                                           mode="graph")
        return self.decisions

    monkeypatch.setattr(SparseConv2d, "prepare", prepare)
    conv = _pruned(nn.Conv2d(3, 8, 3, padding=1))
    layer, replacement = measure_layer("conv", conv, [(2, 3, 5, 5, CHANNELS_LAST), (1, 3, 7, 7)], "measure", 1.0)
    assert prepared == [([(1, 3, 7, 7)], False), ([(2, 3, 5, 5)], True)]
    assert layer.times_us == {"dense": 16.0, "unstructured": 8.0} and isinstance(replacement, SparseConv2d)
    assert layer.input_shapes == [[2, 3, 5, 5, CHANNELS_LAST], [1, 3, 7, 7]]


@pytest.mark.parametrize("kwargs, error, message", [
    ({"example_inputs": [torch.randn(1, 3, 6, 6)]}, TypeError, "example_inputs is a list; pass a tuple"),
    ({"example_inputs": None}, TypeError, "example_inputs is required"),
    ({"example_inputs": torch.randn(1, 3, 6, 6).numpy()}, TypeError, "numpy array.*torch.from_numpy"),
    ({"dtype": "fp16"}, TypeError, "dtype must be a floating torch.dtype"),  # was "Invalid device string"
    ({"dtype": torch.int8}, TypeError, "dtype must be a floating torch.dtype"),
    ({"tune_budget": -1}, ValueError, "tune_budget -1: give seconds >= 0"),  # was accepted
    ({"include": 3}, TypeError, "include must be a regular expression"),
    ({"exclude": "("}, ValueError, "exclude '\\(' is not a valid regular expression"),
])
def test_bad_arguments_are_named_before_the_model_is_changed(kwargs, error, message):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = {"example_inputs": torch.randn(1, 3, 6, 6), "policy": "sparse", **kwargs}
    with pytest.raises(error, match=message):
        convert(model, **args)
    after = model.state_dict()
    assert isinstance(model[1], nn.BatchNorm2d) and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        convert({"0.weight": torch.randn(2, 2)}, torch.randn(1, 2), policy="sparse")


def test_example_inputs_the_model_does_not_take_are_named_before_anything_is_timed_or_folded():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"fails on example_inputs \[\(1, 5, 6, 6\)\] \(RuntimeError"):
        convert(model, torch.randn(1, 5, 6, 6), policy="sparse")
    after = model.state_dict()
    assert isinstance(model[1], nn.BatchNorm2d) and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("layer, example", [(_pruned(nn.Linear(16, 8)), torch.randn(2, 16)),
                                            (_pruned(nn.Conv2d(4, 8, 3)), torch.randn(1, 4, 6, 6))])
def test_a_model_that_is_itself_a_layer_is_refused_with_the_fix(layer, example):
    from sparseforge.nn import to_sparse24

    # was: silently skipped (the module named ""), an empty report; it cannot be replaced in place
    with pytest.raises(ValueError, match=r"itself an nn\.(Linear|Conv2d).*nn\.Sequential\(layer\)"):
        convert(layer, example, policy="sparse")
    with pytest.raises(ValueError, match="to_sparse24"):
        to_sparse24(layer)
    wrapped = nn.Sequential(layer)
    report = convert(wrapped, example, policy="sparse")
    assert [r.name for r in report.layers] == ["0"] and isinstance(wrapped[0], (SparseLinear, SparseConv2d))


def test_a_2of4_decision_is_put_on_another_dense_times_scale():
    from sparseforge.nn.convert import _rescaled
    from sparseforge.semi.decide import SPARSE, Decision

    timed_in_l2 = Decision(1, SPARSE, "faster", sparse_us=4.0, dense_us=8.0)
    rotated = _rescaled(timed_in_l2, 12.0)  # the same width's dense, timed with weights streamed from HBM
    assert rotated.dense_us == 12.0 and rotated.sparse_us == 6.0 and rotated.speedup == timed_in_l2.speedup
    assert _rescaled(timed_in_l2, None) is timed_in_l2


@pytest.mark.parametrize("policy", ["sparse", "measure"])
@pytest.mark.parametrize("layer, shape, zeros", [(nn.Linear(64, 32), (4, 64), 0), (nn.Linear(64, 32), (4, 64), 40),
                                                 (nn.Conv2d(3, 8, 3, padding=1), (1, 3, 6, 6), 0)])
def test_a_layer_with_nothing_pruned_stays_dense_under_every_policy(policy, layer, shape, zeros):
    """A sparse module of an unpruned layer would hold its W twice over (the CSR's values and indices) and run no
    faster; under half the lowest sparsity bucket of zeros (stray ones, as a 16-bit cast rounds) counts as
    unpruned. Nothing is measured for it either."""
    with torch.no_grad():
        layer.weight.view(-1)[:zeros] = 0  # 40 of 2048: about 2%
    report, replacement = measure_layer("fc", layer, [shape], policy, 5.0)
    assert replacement is None and report.choice == "dense" and not report.times_us
    assert report.reason == ("nothing pruned: kept dense" if zeros == 0 else
                             "1.95% zeros, under 2.5%: not pruned, kept dense")


def test_convert_keeps_an_unpruned_layer_dense_and_its_memory_as_it_was():
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), _pruned(nn.Linear(512, 16)))
    report = convert(model, torch.randn(1, 512), policy="sparse", time_model=False)
    assert type(model[0]) is nn.Linear and isinstance(model[2], SparseLinear)
    assert [layer.choice for layer in report.layers] == ["dense", "unstructured"]
    model = nn.Sequential(nn.Linear(512, 512))
    report = convert(model, torch.randn(1, 512), policy="sparse", time_model=False)
    assert type(model[0]) is nn.Linear and report.memory_after_bytes == report.memory_before_bytes == 2**20 + 2048


@pytest.mark.parametrize("model, kwargs, message", [
    (nn.Sequential(nn.ReLU()), {}, "the model has no nn.Linear or nn.Conv2d layer: nothing to convert"),
    (nn.Sequential(nn.Linear(4, 4)), {"include": "zzz"}, "include matched no layer: 'zzz' is found in none"),
    (nn.Sequential(nn.Linear(4, 4)), {"exclude": "0"}, "exclude matched every layer there is to convert"),
])
def test_a_model_left_with_no_layer_to_convert_is_refused_with_the_reason(model, kwargs, message):
    from sparseforge.prune import NothingSelectedError

    with pytest.raises(NothingSelectedError, match=message):
        convert(model, torch.randn(2, 4), policy="sparse", **kwargs)
