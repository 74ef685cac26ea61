"""Write a small seeded CNN's state dict (safetensors) for the pruning demo."""
import sys

import torch
from safetensors.torch import save_file
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
    nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
    nn.Conv2d(64, 64, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10),
)
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, sys.argv[1])
print(f"wrote {sys.argv[1]}")
