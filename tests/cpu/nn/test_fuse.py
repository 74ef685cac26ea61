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

    model = TwoUses().double().eval()
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

    model = Branchy().eval()
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
            r = self.b(self.relu(h))
            return y + r

    model = Edits().double().eval()
    x = torch.randn(1, 3, 5, 5, dtype=torch.float64)
    want = model(x)
    convert(model, x, policy="sparse")
    fused, report = fuse_epilogues(model, x)
    assert "a" not in dict(report.fused) and any("in-place operation" in s.reason for s in report.skipped)
    assert torch.allclose(fused(x), want, rtol=1e-12, atol=1e-12)
