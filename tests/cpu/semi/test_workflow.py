import torch
from torch import nn

from sparseforge.prune import is_nm
from sparseforge.semi import sparsify_24


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)
        self.odd = nn.Linear(30, 8)
        self.small = nn.Linear(8, 12)
        self.norm = nn.LayerNorm(32)


def test_sparsify_24_keeps_masks_through_training_and_lists_skips():
    torch.manual_seed(0)
    model = Block()
    report = sparsify_24(model, exclude="norm")
    assert {l.name for l in report.layers} == {"fc1", "fc2", "small"}
    assert any(s.name == "odd" and "not a multiple of 4" in s.reason for s in report.skipped)
    assert any(n.name == "small" and "will run dense" in n.reason for n in report.notes)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(5):
        loss = model.fc2(torch.relu(model.fc1(torch.randn(4, 32)))).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert is_nm(model.fc1.weight) and is_nm(model.fc2.weight)
