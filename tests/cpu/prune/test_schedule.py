import pytest
import torch
from torch import nn

from sparseforge.prune import GradualPruner, cubic_sparsity


def test_cubic_schedule_endpoints_and_shape():
    assert cubic_sparsity(0, 0.9, 0, 100) == 0.0
    assert cubic_sparsity(100, 0.9, 0, 100) == pytest.approx(0.9)
    assert cubic_sparsity(500, 0.9, 0, 100) == pytest.approx(0.9)
    assert cubic_sparsity(50, 0.9, 0, 100) == pytest.approx(0.9 - 0.9 * 0.5 ** 3)
    steps = [cubic_sparsity(t, 0.9, 10, 90, 0.1) for t in range(0, 100)]
    assert steps == sorted(steps)


def test_bad_schedule():
    with pytest.raises(ValueError, match="end_step"):
        cubic_sparsity(0, 0.9, 10, 10)
    with pytest.raises(ValueError, match="initial_sparsity"):
        GradualPruner(nn.Linear(2, 2), 0.5, 0, 10, initial_sparsity=0.6)


def test_gradual_pruning_during_training_reaches_target_and_masks_hold():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    pruner = GradualPruner(model, final_sparsity=0.8, begin_step=0, end_step=20, frequency=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sparsities = []
    for _ in range(30):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if pruner.step():
            sparsities.append(pruner.last_report.sparsity)
    assert sparsities == sorted(sparsities)
    assert sparsities[-1] == pytest.approx(0.8, abs=0.01)
    w = model[0].weight
    assert (w == 0).float().mean() >= 0.79


@pytest.mark.parametrize("kwargs, error, message", [
    ({"frequency": 2.5}, TypeError, "frequency must be an integer"),
    ({"frequency": float("nan")}, TypeError, "frequency must be an integer"),  # never due: masks never updated
    ({"begin_step": "0"}, TypeError, "begin_step must be an integer"),
    ({"scope": "model"}, ValueError, "scope must be one of"),
    ({"include": "("}, ValueError, "include '\\(' is not a valid regular expression"),
    ({"importance": 3}, TypeError, "importance must be a callable"),
    ({"include": "zzz"}, ValueError, "include matched no layer"),
])
def test_bad_pruner_arguments_are_refused_at_construction(kwargs, error, message):
    args = {"final_sparsity": 0.5, "begin_step": 0, "end_step": 10, **kwargs}
    with pytest.raises(error, match=message):
        GradualPruner(nn.Linear(4, 4), **args)


def test_nan_step_is_refused():
    with pytest.raises(ValueError, match="step is NaN"):
        cubic_sparsity(float("nan"), 0.9, 0, 10)


def test_a_model_that_is_itself_a_layer_is_pruned_gradually():
    layer = nn.Linear(16, 8)
    pruner = GradualPruner(layer, final_sparsity=0.5, begin_step=0, end_step=2, frequency=1)
    for _ in range(3):
        pruner.step()
    assert [p.name for p in pruner.last_report.layers] == [""]  # was: an empty report, nothing pruned
    assert int((layer.weight == 0).sum()) == 64
