import pytest
import torch
from torch import nn

from sparseforge.prune import prune_model, prune_state_dict


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 12)
        self.conv = nn.Conv2d(3, 8, 3)
        self.odd = nn.Linear(6, 8)
        self.fc = nn.Linear(12, 4)
        self.norm = nn.LayerNorm(4)


def test_per_layer_sparsity_and_skips_listed():
    report = prune_model(Net(), sparsity=0.75)
    pruned = {layer.name: layer for layer in report.layers}
    assert set(pruned) == {"conv", "odd", "fc"}
    for layer in pruned.values():
        assert abs(layer.sparsity - 0.75) < 1.0 / layer.numel + 1e-9
    reasons = {s.name: s.reason for s in report.skipped}
    assert "Embedding is not nn.Linear" in reasons["emb"]
    assert "LayerNorm" in reasons["norm"]


def test_nm_skips_layers_whose_k_does_not_fit():
    report = prune_model(Net(), nm="2:4")
    assert {layer.name for layer in report.layers} == {"fc"}
    reasons = {s.name: s.reason for s in report.skipped}
    assert "27 is not a multiple of 4" in reasons["conv"]
    assert "6 is not a multiple of 4" in reasons["odd"]


def test_global_scope_hits_target_overall():
    model = Net()
    with torch.no_grad():
        model.fc.weight.mul_(100)
    report = prune_model(model, sparsity=0.5, scope="global")
    assert abs(report.sparsity - 0.5) < 1e-2
    by_name = {layer.name: layer.sparsity for layer in report.layers}
    assert by_name["fc"] < by_name["conv"]


def test_include_and_exclude():
    report = prune_model(Net(), sparsity=0.5, include="fc|conv", exclude=lambda name, m: name == "conv")
    assert [layer.name for layer in report.layers] == ["fc"]


def test_state_dict_pruning():
    state = Net().state_dict()
    pruned, report = prune_state_dict(state, sparsity=0.5)
    assert {layer.name for layer in report.layers} == {"emb.weight", "conv.weight", "odd.weight", "fc.weight"}
    assert int((pruned["fc.weight"] == 0).sum()) == 24
    assert torch.equal(pruned["fc.bias"], state["fc.bias"])
    assert any("bias" in s.reason for s in report.skipped)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"),
    ({"sparsity": 0.5, "nm": "2:4"}, "exactly one"),
    ({"nm": "2-4"}, "2:4"),
    ({"sparsity": 0.5, "scope": "model"}, "scope"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        prune_model(Net(), **kwargs)
