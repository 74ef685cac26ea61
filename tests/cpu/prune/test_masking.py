import torch
from torch import nn

from sparseforge.prune import current_mask, is_nm, prune_model, remove_masks


def _train(model, steps=5, lr=0.5):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    for _ in range(steps):
        x = torch.randn(16, 32)
        loss = model(x).pow(2).mean() - model(x).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_optimizer_never_resurrects_pruned_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    prune_model(model, sparsity=0.8)
    masks = {i: current_mask(model[i]).clone() for i in (0, 2)}
    _train(model)
    for i, mask in masks.items():
        assert torch.equal(model[i].weight != 0, mask & (model[i].weight != 0))
        assert (model[i].weight[~mask] == 0).all()
        assert (model[i].parametrizations.weight.original[~mask] == 0).all()
    assert (model[0].weight != 0).sum() <= masks[0].sum()


def test_nm_masks_survive_training_and_baking():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 4))
    prune_model(model, nm="2:4")
    _train(model)
    assert all(is_nm(m.weight) for m in model)
    baked = remove_masks(model)
    assert baked == ["0", "1"]
    assert all(is_nm(m.weight) for m in model)
    assert isinstance(model[0].weight, nn.Parameter)


def test_repruning_keeps_old_zeros():
    torch.manual_seed(2)
    layer = nn.Linear(32, 32)
    model = nn.Sequential(layer)
    prune_model(model, sparsity=0.5)
    first = current_mask(layer).clone()
    _train(model, steps=3)
    prune_model(model, sparsity=0.7)
    second = current_mask(layer)
    assert not (second & ~first).any()
    assert int((~second).sum()) == round(0.7 * layer.weight.numel())


def test_apply_mask_refuses_what_is_not_a_mask():
    import numpy as np
    import pytest

    from sparseforge.prune import apply_mask

    with pytest.raises(TypeError, match="mask must be a torch.Tensor, got ndarray"):
        apply_mask(nn.Linear(4, 4), np.ones((4, 4)))
    with pytest.raises(ValueError, match="values other than 0 and 1"):  # was read as all True
        apply_mask(nn.Linear(4, 4), torch.full((4, 4), 0.5))
    layer = nn.Linear(4, 4)
    apply_mask(layer, torch.eye(4))  # a 0/1 float mask is a mask
    assert int(torch.count_nonzero(layer.weight)) <= 4
