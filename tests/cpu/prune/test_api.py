import copy

import pytest
import torch
from torch import nn

from sparseforge.prune import find_state_dict, prune_model, prune_state_dict


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
    ({"sparsity": 0.5, "include": "("}, r"include '\(' is not a valid regular expression"),
    ({"sparsity": 0.5, "exclude": "fc["}, r"exclude 'fc\[' is not a valid regular expression"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        prune_model(Net(), **kwargs)


def test_a_layer_pruning_empties_stays_pruned_and_is_named_in_the_warnings():
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(128, 10))
    with torch.no_grad():
        model[1].weight.mul_(1e-4)  # below every weight of the big layer: a global threshold takes them all
    report = prune_model(model, sparsity=0.9, scope="global")
    emptied = {layer.name: layer for layer in report.layers}["1"]
    assert emptied.nonzero_after == 0 and not model[1].weight.any()
    assert len(report.warnings) == 1 and report.warnings[0].startswith("1 (10x128) has no nonzero weight left")
    assert prune_model(nn.Linear(8, 8), sparsity=0.5).warnings == []


@pytest.mark.parametrize("key", ["state_dict", "model", "ema"])
def test_nested_checkpoint_is_pruned_where_it_keeps_its_weights(key):
    state = Net().state_dict()
    checkpoint = {key: state, "epoch": 7, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]}}
    pruned, report = prune_state_dict(checkpoint, sparsity=0.5)
    assert report.state_key == key and len(report.layers) == 4
    assert pruned["epoch"] == 7 and pruned["optimizer"] is checkpoint["optimizer"]
    assert int((pruned[key]["fc.weight"] == 0).sum()) == 24 and torch.equal(pruned[key]["fc.bias"], state["fc.bias"])


def test_find_state_dict_prefers_usual_keys_and_refuses_what_it_cannot_tell():
    state = {"fc.weight": torch.ones(2, 2)}
    assert find_state_dict(state) == (None, state)
    assert find_state_dict({"ema": state, "model": state})[0] == "model"
    with pytest.raises(ValueError, match="several mappings of tensors \\('a', 'b'\\)"):
        find_state_dict({"a": state, "b": state})
    with pytest.raises(ValueError, match="holds no tensors.*'epoch'"):
        find_state_dict({"epoch": 3})


@pytest.mark.parametrize("kwargs, error, message", [
    ({"sparsity": "0.5"}, TypeError, "sparsity must be a number in \\[0, 1\\), got str '0.5'; pass float"),
    ({"sparsity": torch.tensor(0.5)}, TypeError, "sparsity must be a number.*got Tensor"),
    ({"sparsity": True}, TypeError, "sparsity must be a number.*got bool"),
    ({"nm": (2.7, 4)}, ValueError, "N:M must look like '2:4' or \\(2, 4\\), got \\(2.7, 4\\)"),  # was read as 2:4
    ({"nm": (True, 4)}, ValueError, "N:M must look like"),  # was read as 1:4
    ({"sparsity": 0.5, "include": 5}, TypeError, "include must be a regular expression \\(a str\\) or a callable"),
    ({"sparsity": 0.5, "exclude": ["fc"]}, TypeError, "exclude must be a regular expression.*'a\\|b'"),
])
def test_bad_argument_types_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        prune_model(Net(), **kwargs)


def test_not_a_model_or_not_a_state_dict_is_named():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict; for a state dict use prune_state_dict"):
        prune_model({"fc.weight": torch.randn(4, 4)}, sparsity=0.5)
    with pytest.raises(TypeError, match="state must be a state dict.*got list"):
        prune_state_dict([torch.randn(4, 4)], sparsity=0.5)


@pytest.mark.parametrize("kwargs", [{"sparsity": 0.5}, {"sparsity": 0.5, "scope": "global"}, {"nm": "2:4"}])
def test_nan_weights_are_refused_naming_the_tensor(kwargs):
    state = {"ok.weight": torch.randn(4, 8), "bad.weight": torch.randn(4, 8)}
    state["bad.weight"][1, 2] = float("nan")
    with pytest.raises(ValueError, match="bad.weight holds NaN or inf"):
        prune_state_dict(state, **kwargs)


def test_state_dict_entries_that_cannot_be_pruned_are_skipped_with_the_reason():
    state = {1: torch.randn(4, 4), "sparse.weight": torch.randn(4, 4).to_sparse(), "fc.weight": torch.randn(4, 4)}
    pruned, report = prune_state_dict(state, sparsity=0.5)
    assert [layer.name for layer in report.layers] == ["fc.weight"]
    reasons = {s.name: s.reason for s in report.skipped}
    assert "not a parameter name" in reasons[1] and "to_dense()" in reasons["sparse.weight"]
    assert pruned[1] is state[1]


def test_weights_without_rows_are_skipped_rather_than_crash():
    from sparseforge.prune import NothingSelectedError

    for kwargs in ({"sparsity": 0.5}, {"nm": "2:4"}, {"sparsity": 0.5, "scope": "global"}):
        _, report = prune_state_dict({"a.weight": torch.zeros(0, 8), "b.weight": torch.ones(4, 8)}, **kwargs)
        assert [p.name for p in report.layers] == ["b.weight"]
        assert "holds no values (shape 0x8)" in report.skipped[0].reason
        with pytest.raises(NothingSelectedError, match=r"holds no values \(shape 0x8\)"):  # nothing else to prune
            prune_state_dict({"a.weight": torch.zeros(0, 8)}, **kwargs)


@pytest.mark.parametrize("layer", [nn.Linear(16, 8), nn.Conv2d(4, 8, 3)])
def test_a_model_that_is_itself_a_layer_is_pruned(layer):
    report = prune_model(layer, sparsity=0.5)  # was: skipped as the module named "", an empty report
    assert [p.name for p in report.layers] == [""] and not report.skipped
    assert int((layer.weight == 0).sum()) == layer.weight.numel() // 2


@pytest.mark.parametrize("shape", [(0, 8), (8, 0), (0, 0, 3, 3)])
def test_a_weight_with_no_values_is_skipped_with_the_reason(shape):
    state = {"empty.weight": torch.randn(shape), "fc.weight": torch.randn(4, 8)}
    _, report = prune_state_dict(state, sparsity=0.5)  # was: ZeroDivisionError in LayerPruned.sparsity
    assert [p.name for p in report.layers] == ["fc.weight"]
    assert "holds no values" in {s.name: s.reason for s in report.skipped}["empty.weight"]
    model = nn.Sequential(nn.Linear(8, 0), nn.Linear(8, 4))
    report = prune_model(model, sparsity=0.5)
    assert [p.name for p in report.layers] == ["1"] and "holds no values" in report.skipped[0].reason


def test_an_empty_layer_reports_zero_sparsity():
    from sparseforge.prune import LayerPruned

    assert LayerPruned("w", (0, 8), 0, 0).sparsity == 0.0


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_weights_are_skipped_with_the_reason(dtype):
    state = {"q.weight": torch.randn(4, 8).to(dtype), "fc.weight": torch.randn(4, 8)}
    _, report = prune_state_dict(state, sparsity=0.5)  # was: '"isfinite" not implemented for Float8_e4m3fn'
    assert [p.name for p in report.layers] == ["fc.weight"]
    assert f"{dtype} is not one pruning ranks" in report.skipped[0].reason and "upcast" in report.skipped[0].reason


def test_minus_zero_sparsity_is_labelled_zero():
    _, report = prune_state_dict({"fc.weight": torch.randn(4, 8)}, sparsity=-0.0)
    assert report.method == "magnitude 0 (layer)"


@pytest.mark.parametrize("model, kwargs, message", [
    (Net(), {"include": "zzz"}, r"include matched no layer: 'zzz' is found in none of the names of the 3 "
                                r"Linear / Conv2d layers \(conv, odd, fc\)"),
    (Net(), {"include": lambda name, module: False}, "include matched no layer: it returned False for each of the 3"),
    (Net(), {"exclude": "."}, "exclude matched every layer there is to prune"),
    (Net(), {"include": "fc", "exclude": "f"}, "include and exclude together leave no layer to prune"),
    (nn.Sequential(nn.ReLU()), {}, "the model has no nn.Linear or nn.Conv2d layer: nothing to prune"),
    (nn.Sequential(nn.Embedding(4, 8)), {}, r"nothing to prune \(its modules with weights are Embedding\)"),
    (nn.Sequential(nn.Linear(4, 4).to(torch.float8_e4m3fn)), {}, "every layer is skipped .*not one pruning ranks"),
])
def test_a_model_left_with_no_layer_to_prune_is_refused_with_the_reason(model, kwargs, message):
    from sparseforge.prune import NothingSelectedError

    before = copy.deepcopy(model.state_dict())
    with pytest.raises(NothingSelectedError, match=message):
        prune_model(model, sparsity=0.5, **kwargs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_state_dict_left_with_no_tensor_to_prune_is_refused_with_the_reason():
    from sparseforge.prune import NothingSelectedError

    state = {"fc.weight": torch.randn(4, 8), "fc.bias": torch.randn(4)}
    with pytest.raises(NothingSelectedError, match="include matched no tensor: 'zzz'.*weights that can be pruned"):
        prune_state_dict(state, sparsity=0.5, include="zzz")
    with pytest.raises(NothingSelectedError, match=r"no tensor is a 2-D or 4-D .*\(fc.bias: not a weight"):
        prune_state_dict({"fc.bias": torch.randn(4)}, sparsity=0.5)
