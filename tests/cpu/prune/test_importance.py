"""importance= (rank by a score other than |w|), scope="row", and ActivationNorms / Wanda scores."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from sparseforge.prune import (ActivationNorms, GradualPruner, current_mask, magnitude_mask, prune_model,
                               prune_state_dict, row_magnitude_mask, wanda_scores)


def _linear(out_features=6, in_features=8, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features)


def _top_mask(score: torch.Tensor, n_keep: int) -> torch.Tensor:
    keep = torch.zeros(score.numel(), dtype=torch.bool)
    keep[torch.topk(score.flatten(), n_keep).indices] = True
    return keep.reshape(score.shape)


def test_default_is_unchanged_magnitude():
    layer = _linear()
    w = layer.weight.detach().clone()
    report = prune_model(nn.Sequential(layer), sparsity=0.5)
    assert report.method == "magnitude 0.5 (layer)"
    assert torch.equal(current_mask(layer), magnitude_mask(w, 0.5))
    # an explicit |w| importance picks the very same masks as the default
    other = _linear()
    prune_model(nn.Sequential(other), sparsity=0.5, importance=lambda name, module, weight: weight.abs())
    assert torch.equal(current_mask(other), current_mask(layer))


def test_kept_set_follows_the_score_not_the_magnitude():
    layer = _linear()
    w = layer.weight.detach().clone()
    # score that inverts magnitude order: the smallest weights are the most important
    score = 1.0 / (w.abs() + 1e-3)
    seen = []

    def importance(name, module, weight):
        seen.append((name, module))
        return score

    model = nn.Sequential(layer)
    report = prune_model(model, sparsity=0.75, importance=importance)
    mask = current_mask(layer)
    n_keep = w.numel() - round(0.75 * w.numel())
    assert torch.equal(mask, _top_mask(score, n_keep))
    assert not torch.equal(mask, magnitude_mask(w, 0.75))
    assert int((~mask).sum()) == round(0.75 * w.numel())
    assert seen == [("0", layer)]
    assert "importance" in report.method


@settings(deadline=None, max_examples=30)
@given(st.integers(1, 20), st.integers(1, 20), st.floats(0.0, 0.99), st.integers(0, 2**31 - 1))
def test_row_scope_prunes_exactly_per_row_by_score(rows, cols, sparsity, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    norms = torch.rand(cols, generator=g) * 10
    score = wanda_scores(w, norms)
    mask = row_magnitude_mask(score, sparsity)
    n_prune = round(sparsity * cols)
    assert ((~mask).sum(dim=1) == n_prune).all()
    for r in range(rows):
        if mask[r].any() and (~mask[r]).any():
            assert score[r][mask[r]].min() >= score[r][~mask[r]].max()


def test_row_scope_through_prune_model_and_state_dict():
    layer = _linear(4, 10)
    w = layer.weight.detach().clone()
    state = {"0.weight": w.clone(), "0.bias": layer.bias.detach().clone()}
    report = prune_model(nn.Sequential(layer), sparsity=0.6, scope="row")
    assert report.method == "magnitude 0.6 (row)"
    assert ((~current_mask(layer)).sum(dim=1) == 6).all()
    pruned, _ = prune_state_dict(state, sparsity=0.6, scope="row",
                                 importance=lambda name, module, weight: weight.abs() * (module is None))
    assert torch.equal(pruned["0.weight"] != 0, current_mask(layer))
    with pytest.raises(ValueError, match="scope must be one of"):
        prune_model(nn.Sequential(_linear()), sparsity=0.5, scope="column")


@pytest.mark.parametrize("bad, match", [
    (lambda n, m, w: torch.ones(3), "weight's shape"),
    (lambda n, m, w: -w.abs(), "negative"),
    (lambda n, m, w: w.abs() * float("nan"), "NaN or inf"),
])
def test_bad_importance_is_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        prune_model(nn.Sequential(_linear()), sparsity=0.5, importance=bad)
    with pytest.raises(TypeError, match="callable"):
        prune_model(nn.Sequential(_linear()), sparsity=0.5, importance="wanda")


def test_activation_norms_match_the_inputs_and_leave_out_masked_tokens():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    norms = ActivationNorms(model)
    x = torch.randn(2, 4, 5)
    token_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    norms.token_mask = token_mask
    model(x)
    with norms.paused():  # the reference pass must not be recorded itself
        hidden = torch.relu(model[0](x))
    got = norms.norms()
    assert torch.allclose(got["0"], x[token_mask].norm(dim=0))
    assert torch.allclose(got["2"], hidden[token_mask].norm(dim=0), atol=1e-6)
    assert norms.tokens() == {"0": 5, "2": 5}
    score = norms.wanda("0", model[0], model[0].weight)
    assert torch.allclose(score, model[0].weight.abs() * x[token_mask].norm(dim=0)[None, :])


def test_activation_norms_refresh_pause_and_accumulate():
    layer = nn.Linear(3, 2)
    model = nn.Sequential(layer)
    a, b, c = torch.randn(4, 3), torch.randn(6, 3), torch.randn(5, 3)
    fresh, running = ActivationNorms(model), ActivationNorms(model, refresh=False)
    model(a)
    model(b)
    ab = torch.cat([a, b]).norm(dim=0)
    assert torch.allclose(fresh.norm("0"), ab) and torch.allclose(running.norm("0"), ab)
    assert torch.allclose(fresh.norm("0"), ab)  # read twice, nothing new: the same statistics
    with fresh.paused(), running.paused():
        model(torch.full((3, 3), 100.0))  # e.g. an evaluation pass: not recorded
    model(c)
    assert torch.allclose(fresh.norm("0"), c.norm(dim=0))  # restarted with the first input after the read
    assert torch.allclose(running.norm("0"), torch.cat([a, b, c]).norm(dim=0))
    fresh.remove()
    model(a)
    assert torch.allclose(fresh.norm("0"), c.norm(dim=0))


def test_activation_norms_errors_and_conv_skipped():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 2))
    norms = ActivationNorms(model)
    assert [s.name for s in norms.skipped] == ["0"] and norms.names == ["2"]
    with pytest.raises(ValueError, match="no inputs recorded for 2"):
        prune_model(model, sparsity=0.5, include="2", importance=norms.wanda)
    with pytest.raises(ValueError, match="not a layer"):
        norms.norm("0")


def test_wanda_keeps_weights_on_loud_inputs():
    # equal magnitudes everywhere: only the input norms can decide, and they must
    layer = nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    model = nn.Sequential(layer)
    norms = ActivationNorms(model)
    model(torch.randn(64, 4) * torch.tensor([0.01, 5.0, 0.1, 3.0]))
    prune_model(model, sparsity=0.5, importance=norms.wanda)
    expected = torch.tensor([False, True, False, True]).expand(3, 4)
    assert torch.equal(current_mask(layer), expected)


def test_gradual_pruner_with_wanda_reaches_target_and_follows_the_last_scores():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    norms = ActivationNorms(model)
    final_scores = {}

    def importance(name, module, weight):
        score = norms.wanda(name, module, weight)
        final_scores[name] = score.clone()
        return score

    scale = torch.linspace(0.1, 3.0, 16)
    model(torch.randn(8, 16) * scale)  # calibration for step 0
    pruner = GradualPruner(model, final_sparsity=0.8, begin_step=0, end_step=20, frequency=5, importance=importance)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pruner.step()
    sparsities = []
    for _ in range(30):
        loss = model(torch.randn(8, 16) * scale).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if pruner.step():
            sparsities.append(pruner.last_report.sparsity)
            if pruner.step_count - 1 == 20:
                at_end = {n: s.clone() for n, s in final_scores.items()}
    assert sparsities == sorted(sparsities)
    assert sparsities[-1] == pytest.approx(0.8, abs=1e-9)  # per layer, round(0.8 * numel) each
    for name, layer in (("0", model[0]), ("2", model[2])):
        mask = current_mask(layer)
        assert int((~mask).sum()) == round(0.8 * layer.weight.numel())
        assert torch.equal(mask, magnitude_mask(at_end[name], 0.8))
        assert (layer.weight[~mask] == 0).all()
