"""fuse_epilogues (nn/fuse.py) on the CPU, where the sparse layers run their dense path: the fused model
computes what the unfused one does (float64), the ReLUs and adds it took are gone from the graph, and what it
cannot fuse (a conv output used twice, a broadcasting add, a layer called twice, an untraceable model) it
leaves with the reason."""
import operator

import pytest
import torch
from torch import nn

from sparseforge.nn import SparseConv2d, convert, fuse_epilogues


class Bottleneck(nn.Module):
    """torchvision's shape: one ReLU module called three times, `out += identity`, a downsample."""

    def __init__(self, cin: int, mid: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = self.downsample(x)
        out += identity
        return self.relu(out)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), Bottleneck(8, 4, 16, 2), Bottleneck(16, 4, 16))
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            with torch.no_grad():
                m.weight.mul_(torch.rand(m.weight.shape) > 0.6)
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
    return model.double().eval()


def _pruned(model: nn.Module, seed: int = 0) -> nn.Module:
    """Half of each Conv2d weight zeroed: convert keeps a layer with nothing pruned dense, and these tests fuse
    the sparse convolutions it puts in."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.mul_(torch.rand(m.weight.shape, generator=g) > 0.5)
    return model


def _ops(gm) -> dict:
    counts = {"relu": 0, "add": 0}
    for node in gm.graph.nodes:
        name = str(node.target)
        if "relu" in name or node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.ReLU):
            counts["relu"] += 1
        if node.target in (operator.add, operator.iadd, torch.add):
            counts["add"] += 1
    return counts


def test_a_converted_resnet_block_fuses_every_relu_and_add_and_computes_the_same():
    model = _model()
    x = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    want = model(x)
    convert(model, x, policy="sparse")
    assert torch.allclose(model(x), want, rtol=1e-10, atol=1e-10)
    fused, report = fuse_epilogues(model, x)
    assert isinstance(fused, torch.fx.GraphModule)
    got = fused(x)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-10)
    kinds = dict(report.fused)
    # the stem and each block's conv1 / conv2 take their ReLU; where conv3 and the projection shortcut meet at
    # the add, the later of the two convs takes the other's output as its residual, and the block's ReLU
    assert kinds["0"] == "relu"
    for block in ("2", "3"):
        assert kinds[f"{block}.conv1"] == kinds[f"{block}.conv2"] == "relu"
        taken = [name for name in (f"{block}.conv3", f"{block}.downsample.0") if name in kinds]
        assert len(taken) == 1 and kinds[taken[0]] == "residual+relu"
        assert fused.get_submodule(taken[0]).residual
    assert kinds["2.downsample.0"] == "residual+relu"  # it runs after conv3 here (as in torchvision)
    assert _ops(fused) == {"relu": 0, "add": 0} and report.skipped == []


def test_what_cannot_be_fused_stays_with_the_reason():
    class TwoUses(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)
            self.bias = nn.Parameter(torch.randn(4, 1, 1))

        def forward(self, x):
            y = self.a(x)
            z = self.b(x) + self.bias  # broadcasting: not a residual
            return torch.relu(y) + y + torch.relu(z)

    model = _pruned(TwoUses()).double().eval()
    x = torch.randn(1, 3, 5, 5, dtype=torch.float64)
    want = model(x)
    convert(model, x, policy="sparse")
    fused, report = fuse_epilogues(model, x)
    assert report.fused == []
    assert [s.name for s in report.skipped] == ["b"] and "shape and dtype" in report.skipped[0].reason
    assert torch.allclose(fused(x), want, rtol=1e-12, atol=1e-12)


def test_a_model_fx_cannot_trace_comes_back_unchanged():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            return torch.relu(self.conv(x)) if x.sum() > 0 else x

    model = _pruned(Branchy()).eval()
    x = torch.ones(1, 3, 4, 4)
    convert(model, x, policy="sparse")
    fused, report = fuse_epilogues(model, x)
    assert fused is model and "cannot trace" in report.skipped[0].reason
    assert not model.conv.relu


def test_a_layer_called_twice_is_not_fused():
    conv = nn.Conv2d(3, 3, 1).double()

    class Twice(nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.conv = layer

        def forward(self, x):
            return torch.relu(self.conv(self.conv(x)))

    twice = Twice(SparseConv2d.from_dense(conv)).eval()
    x = torch.randn(1, 3, 4, 4, dtype=torch.float64)
    fused, report = fuse_epilogues(twice, x)
    assert report.fused == [] and "more than one place" in report.skipped[0].reason
    assert torch.allclose(fused(x), torch.relu(conv(conv(x))), rtol=1e-12, atol=1e-12)


def test_a_model_whose_trace_computes_otherwise_is_given_back_unfused():
    """z += conv(x) with z an alias of y: the model's y changes, the traced graph's does not."""
    class IntoOther(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)

        def forward(self, x):
            y = self.a(x) * 1.0
            z = y
            z += self.b(x)
            return y * 2 + torch.relu(z)

    model = IntoOther().double().eval()
    x = torch.randn(1, 3, 5, 5, dtype=torch.float64)
    want = model(x)
    convert(model, x, policy="sparse")
    fused, report = fuse_epilogues(model, x)
    # fx itself records `z += ...` as a new tensor, so the traced graph computes y * 2 from the old y: fusion
    # checks the trace against the model on the example and gives the model back
    assert fused is model and report.fused == [] and "does not compute what the model does" in report.skipped[0].reason
    assert torch.allclose(fused(x), want, rtol=1e-12, atol=1e-12)


def test_a_failure_that_is_not_a_refusal_puts_every_layer_back(monkeypatch):
    model = _model()
    x = torch.randn(1, 3, 12, 12, dtype=torch.float64)
    convert(model, x, policy="sparse")
    calls = []

    def flaky(self, relu, residual, original=SparseConv2d.set_epilogue):
        calls.append(self)
        if len(calls) == 3:
            raise RuntimeError("ptxas failed")
        original(self, relu, residual)

    monkeypatch.setattr(SparseConv2d, "set_epilogue", flaky)
    with pytest.raises(RuntimeError, match="ptxas"):
        fuse_epilogues(model, x)
    assert not any(m.relu or m.residual for m in model.modules() if isinstance(m, SparseConv2d))


@pytest.mark.parametrize("case", ["residual edited in place after the conv", "conv input edited in place after"])
def test_an_in_place_edit_between_a_conv_and_its_epilogue_blocks_the_fusion(case):
    class Edits(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            if case.startswith("residual"):
                r = self.b(x) * 1.0
                y = self.a(x)
                r.clamp_(min=0)
                return y + r
            h = x * 1.0
            y = self.a(h)
            r = self.relu(h) * 2.0  # edits a's input in place after a read it: a cannot move to the add
            return y + r + self.b(x)

    model = _pruned(Edits()).double().eval()
    x = torch.randn(1, 3, 5, 5, dtype=torch.float64)
    want = model(x)
    convert(model, x, policy="sparse")
    fused, report = fuse_epilogues(model, x)
    assert "a" not in dict(report.fused) and any("in-place operation" in s.reason for s in report.skipped)
    assert torch.allclose(fused(x), want, rtol=1e-12, atol=1e-12)


class ShortcutFirst(nn.Module):
    """sparseforge.models' ResNet block shape: the projection shortcut computed first, in-place ReLUs on
    other tensors between it and the add."""

    def __init__(self, cin: int, mid: int, cout: int, in_place_add: bool = False):
        super().__init__()
        self.downsample = nn.Conv2d(cin, cout, 1)
        self.conv1, self.conv2 = nn.Conv2d(cin, mid, 1), nn.Conv2d(mid, cout, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.in_place_add = in_place_add

    def forward(self, x):
        identity = self.downsample(x)
        out = self.conv2(self.relu(self.conv1(x)))
        if self.in_place_add:  # torchvision's `out += identity`
            out += identity
            return self.relu(out)
        return self.relu(out + identity)


def _shortcut_model(in_place_add: bool = False) -> nn.Module:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), ShortcutFirst(8, 4, 16, in_place_add))
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            with torch.no_grad():
                m.weight.mul_(torch.rand(m.weight.shape) > 0.6)
    return model.double().eval()


@pytest.mark.parametrize("in_place_add", [False, True])
def test_in_place_edits_of_other_tensors_do_not_block_a_shortcut_computed_first(in_place_add):
    model = _shortcut_model(in_place_add)
    x = torch.randn(1, 3, 9, 9, dtype=torch.float64)
    want = model(x)
    convert(model, x, policy="sparse")
    fused, report = fuse_epilogues(model, x)
    # the shortcut conv runs first, so conv2 (the later) takes the add; the ReLU between (in place, on conv1's
    # output) edits nothing the fused node reads
    assert dict(report.fused) == {"0": "relu", "2.conv1": "relu", "2.conv2": "residual+relu"}, report
    assert report.skipped == [] and _ops(fused) == {"relu": 0, "add": 0}
    assert torch.allclose(fused(x), want, rtol=1e-12, atol=1e-12)


def test_dense_convs_take_their_epilogue_as_fused_dense_layers_and_a_sparse_partner_takes_the_add():
    from sparseforge.nn import FusedDenseConv2d

    def converted():
        model = _shortcut_model()
        convert(model, x, policy="sparse", exclude=r"^(0|2\.conv1|2\.conv2)$")  # these stay nn.Conv2d
        return model

    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    want = _shortcut_model()(x)
    # on the CPU there is nothing to measure: "measure" leaves dense convs alone
    _, measured = fuse_epilogues(converted(), x)
    assert dict(measured.fused) == {"2.downsample": "residual+relu"}, measured
    kept, report = fuse_epilogues(converted(), x, dense_convs="keep")
    assert dict(report.fused) == {"2.downsample": "residual+relu"} and type(kept.get_submodule("0")) is nn.Conv2d
    model = converted()
    fused, report = fuse_epilogues(model, x, dense_convs="fuse")
    kinds = dict(report.fused)
    # the sparse shortcut takes the add over the dense conv2 (its kernel adds it for nothing); conv2 then has
    # only the add after it, which cuDNN does not fuse without a ReLU: it stays as it was
    assert kinds == {"0": "relu (cuDNN fused)", "2.conv1": "relu (cuDNN fused)", "2.downsample": "residual+relu"}
    assert isinstance(fused.get_submodule("0"), FusedDenseConv2d) and type(model[0]) is nn.Conv2d  # the model keeps its own
    assert not fused.get_submodule("0").cudnn_fused  # a CPU model: the separate ops run
    assert torch.allclose(fused(x), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="dense_convs"):
        fuse_epilogues(model, x, dense_convs="always")


def test_a_dense_conv_takes_an_add_and_relu_when_its_partner_is_dense_too():
    model = _shortcut_model()
    x = torch.randn(1, 3, 9, 9, dtype=torch.float64)
    want = model(x)
    fused, report = fuse_epilogues(model, x, dense_convs="fuse")  # nothing converted: every conv dense
    assert dict(report.fused) == {"0": "relu (cuDNN fused)", "2.conv1": "relu (cuDNN fused)",
                                  "2.conv2": "residual+relu (cuDNN fused)"}
    assert _ops(fused) == {"relu": 0, "add": 0}
    assert torch.allclose(fused(x), want, rtol=1e-12, atol=1e-12)


def test_fused_dense_conv_refuses_what_cudnn_cannot_fuse_and_a_wrong_call():
    from sparseforge.nn import FusedDenseConv2d

    with pytest.raises(ValueError, match="explicit zero padding"):
        FusedDenseConv2d(nn.Conv2d(3, 3, 3, padding="same"), residual=False)
    with pytest.raises(ValueError, match="explicit zero padding"):
        FusedDenseConv2d(nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect"), residual=False)
    layer = FusedDenseConv2d(nn.Conv2d(3, 3, 1), residual=True)
    x = torch.randn(1, 3, 4, 4)
    with pytest.raises(ValueError, match="layer\\(x, residual=r\\)"):
        layer(x)
    with pytest.raises(ValueError, match="adds no residual"):
        FusedDenseConv2d(nn.Conv2d(3, 3, 1), residual=False)(x, residual=x)
    assert torch.allclose(layer(x, residual=x), torch.relu(layer.conv(x) + x))


def _refusing(monkeypatch, names: set):
    """SparseConv2d.set_epilogue refusing (as a split-K config does) for the layers whose id() is in `names`."""
    original = SparseConv2d.set_epilogue

    def set_epilogue(self, relu, residual):
        if id(self) in names:
            raise ValueError("a split-K config takes no epilogue")
        original(self, relu, residual)

    monkeypatch.setattr(SparseConv2d, "set_epilogue", set_epilogue)


def test_an_in_place_relu_before_the_conv_reads_its_input_does_not_block_it(monkeypatch):
    """conv1 keeps its in-place ReLU (it refuses an epilogue); conv2 reads that ReLU's output after the edit,
    so conv2 may still move to the add, the shortcut computed first notwithstanding."""
    model = _shortcut_model()
    x = torch.randn(1, 3, 9, 9, dtype=torch.float64)
    want = model(x)
    convert(model, x, policy="sparse")
    _refusing(monkeypatch, {id(model[2].conv1)})
    fused, report = fuse_epilogues(model, x)
    assert dict(report.fused) == {"0": "relu", "2.conv2": "residual+relu"}, report
    assert [s.name for s in report.skipped] == ["2.conv1"] and "takes no epilogue" in report.skipped[0].reason
    assert torch.allclose(fused(x), want, rtol=1e-12, atol=1e-12)


def test_where_the_conv_left_an_add_refuses_it_the_first_conv_takes_it(monkeypatch):
    model = _shortcut_model()
    x = torch.randn(1, 3, 9, 9, dtype=torch.float64)
    want = model(x)
    convert(model, x, policy="sparse")
    _refusing(monkeypatch, {id(model[2].conv2)})  # the later conv, which the shortcut leaves the add to
    fused, report = fuse_epilogues(model, x)
    kinds = dict(report.fused)
    assert kinds == {"0": "relu", "2.conv1": "relu", "2.downsample": "residual+relu"}, report
    assert [s.name for s in report.skipped] == ["2.conv2"]
    assert _ops(fused) == {"relu": 0, "add": 0}
    assert torch.allclose(fused(x), want, rtol=1e-12, atol=1e-12)


def test_a_fused_model_with_dense_epilogues_saves_and_loads_in_a_fresh_process(tmp_path):
    import subprocess
    import sys

    model = _shortcut_model()
    x = torch.randn(1, 3, 9, 9, dtype=torch.float64)
    want = model(x)
    fused, report = fuse_epilogues(model, x, dense_convs="fuse")
    assert len(report.fused) == 3
    torch.save({"model": fused, "x": x, "want": want}, tmp_path / "fused.pt")
    check = ("import torch, sparseforge.nn; d = torch.load(r'%s', weights_only=False); "
             "assert torch.allclose(d['model'](d['x']), d['want'], rtol=1e-12, atol=1e-12); print('ok')"
             % (tmp_path / "fused.pt"))
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def _perturb_fused(monkeypatch, relative: float, only: str | None = None):
    """Make every fused SparseConv2d (or the one named `only`) return its output scaled by 1 + relative: a
    kernel that rounds once where the separate ops rounded twice (small `relative`), or a wrong one."""
    original = SparseConv2d.forward

    def forward(self, x, residual=None):
        y = original(self, x, residual)
        wrong = (self.relu or self.residual) and (only is None or self is only)
        return y * (1 + relative) if wrong else y

    monkeypatch.setattr(SparseConv2d, "forward", forward)


class _IllConditioned(nn.Module):
    """A fused layer's output minus 0.999 of the same computed unfused: the output is 1e-3 of the layer's, so
    a relative change of the layer's output is 1000x larger at the model's output (a deep half-precision
    model amplifies its layers' rounding alike, ResNet-50 about 25x)."""

    def __init__(self):
        super().__init__()
        self.sparse, self.plain = _pruned(nn.Conv2d(3, 4, 3, padding=1)), nn.Conv2d(3, 4, 3, padding=1)
        with torch.no_grad():
            self.plain.weight.copy_(self.sparse.weight)
            self.plain.bias.copy_(self.sparse.bias)

    def forward(self, x):
        return torch.relu(self.sparse(x)) - 0.999 * torch.relu(self.plain(x))


def test_a_fused_layer_is_checked_alone_so_rounding_amplified_downstream_does_not_refuse_it(monkeypatch):
    """Each fused node is compared with the node it replaced on the inputs the graph hands it, and the graph
    goes on from the traced value: a fused kernel within rounding of the separate ops fuses even where the
    model would amplify that past the bound at its output."""
    model = _IllConditioned().double().eval()
    x = torch.randn(1, 3, 6, 6, dtype=torch.float64)
    convert(model, x, policy="sparse", include="sparse")
    _perturb_fused(monkeypatch, 1e-5)  # far inside the float64 bound (1e-4) for the layer alone
    fused, report = fuse_epilogues(model, x)
    assert report.fused == [("sparse", "relu")] and fused is not model
    with torch.no_grad():
        out, want = fused(x), model.plain(x)  # (the unfused model, for the amplification below)
        want = torch.relu(model.sparse._dense_forward(x)) - 0.999 * torch.relu(want)
    assert float((out - want).norm() / want.norm()) > 1e-3  # 1e-5 at the layer, 100x past the bound at the output


def test_a_fused_layer_that_computes_otherwise_is_left_unfused_with_its_name_and_the_rest_fuse(monkeypatch):
    model = _model()
    x = torch.randn(1, 3, 12, 12, dtype=torch.float64)
    want = model(x)
    convert(model, x, policy="sparse")
    target = model[2].conv2
    _perturb_fused(monkeypatch, 1e-2, only=target)  # 1e-2 relative: 100x the float64 bound
    fused, report = fuse_epilogues(model, x)
    assert fused is not model and report.fused and "2.conv2" not in dict(report.fused)
    reason = next(s.reason for s in report.skipped if s.name == "2.conv2")
    assert "computed otherwise (relative difference" in reason and "left unfused" in reason
    assert not (target.relu or target.residual)
    assert torch.allclose(fused(x), want, rtol=1e-10, atol=1e-10)


def test_when_every_fused_layer_computes_otherwise_none_is_fused(monkeypatch):
    model = _model()
    x = torch.randn(1, 3, 12, 12, dtype=torch.float64)
    convert(model, x, policy="sparse")
    _perturb_fused(monkeypatch, 1e-2)
    fused, report = fuse_epilogues(model, x)
    assert report.fused == [] and not any(m.relu or m.residual for m in model.modules() if isinstance(m, SparseConv2d))
    assert sum("computed otherwise" in s.reason for s in report.skipped) >= 3


def test_a_fused_kernel_writing_over_its_operand_is_refused(monkeypatch):
    """The check hands the traced value on; a kernel whose output is its input's memory would slip past it, so
    such an output is refused outright."""
    model = _model()
    x = torch.randn(1, 3, 12, 12, dtype=torch.float64)
    convert(model, x, policy="sparse")
    target = model[2].downsample[0]  # it takes its block's add (its partner conv3 leaves it the add)
    original = SparseConv2d.forward

    def in_place(self, inp, residual=None):
        y = original(self, inp, residual)
        return residual.copy_(y) if self is target and residual is not None else y

    monkeypatch.setattr(SparseConv2d, "forward", in_place)
    fused, report = fuse_epilogues(model, x)
    reasons = {s.name: s.reason for s in report.skipped}
    assert "2.downsample.0" not in dict(report.fused) and "shares memory with an operand" in reasons["2.downsample.0"]
    assert "2.conv1" in dict(report.fused)  # the others still fuse


def test_a_rewiring_that_changes_what_the_graph_computes_is_refused(monkeypatch):
    """Each fused layer right, but the graph wired wrong after them (here: the output replaced by zeros of its
    shape): the run on the layers' traced values catches it."""
    from sparseforge.nn import fuse as fuse_module

    model = _model()
    x = torch.randn(1, 3, 12, 12, dtype=torch.float64)
    convert(model, x, policy="sparse")
    real = fuse_module._fuse

    def miswired(gm, *args):
        real(gm, *args)
        output = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(output):
            output.args = (gm.graph.call_function(torch.zeros_like, (output.args[0],)),)

    monkeypatch.setattr(fuse_module, "_fuse", miswired)
    fused, report = fuse_epilogues(model, x)
    assert fused is model and "the rewired graph" in report.skipped[-1].reason
