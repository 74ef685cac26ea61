"""ResNet-50 with torchvision's architecture (v1.5: the stride on the 3x3 of each projection block; the same
module names, so torchvision's state_dicts load) and initialisation, built here so no torchvision is needed;
the DLMC rn50 magnitude-pruning patterns put on its weights (`apply_dlmc_masks`), and BatchNorm statistics
calibrated on random inputs so activations stay in fp16 range (`calibrate_batchnorm`).

DLMC names (TensorFlow's ResNet-50): `initial_conv` is conv1, `final_dense` fc; in group G (layer G), block 0
is `..._block_group_projection_block_groupG` and block b >= 1 `..._block_groupG_b_1`; `bottleneck_i_` is the
block's conv i, `bottleneck_projection_` its downsample convolution. The files are Cout x (kh kw Cin) in
TensorFlow's (r, s, ci) column order; `dlmc_name_map` pairs every weight with its file and the masks are
reordered to torch's (ci, r, s).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..formats import SparseMatrix

LAYERS = (3, 4, 6, 3)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet50(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = 64
        for g, (planes, blocks) in enumerate(zip((64, 128, 256, 512), LAYERS), start=1):
            stride = 1 if g == 1 else 2
            downsample = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(planes * 4))
            layer = [Bottleneck(inplanes, planes, stride, downsample)]
            inplanes = planes * 4
            layer += [Bottleneck(inplanes, planes) for _ in range(1, blocks)]
            setattr(self, f"layer{g}", nn.Sequential(*layer))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2048, num_classes)
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(seed: int = 0, num_classes: int = 1000) -> ResNet50:
    """torchvision's ResNet-50 architecture with its initialisation drawn from `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ResNet50(num_classes)


def dlmc_name_map() -> dict[str, str]:
    """Qualified weight name of ResNet50 -> DLMC rn50 file stem (all 54 files, each once)."""
    names = {"conv1.weight": "initial_conv", "fc.weight": "final_dense"}
    for g, blocks in enumerate(LAYERS, start=1):
        for b in range(blocks):
            block = f"_block_group_projection_block_group{g}" if b == 0 else f"_block_group{g}_{b}_1"
            for i in (1, 2, 3):
                names[f"layer{g}.{b}.conv{i}.weight"] = f"bottleneck_{i}{block}"
        names[f"layer{g}.0.downsample.0.weight"] = f"bottleneck_projection_block_group_projection_block_group{g}"
    return names


def dlmc_mask(pattern: SparseMatrix, weight_shape: tuple) -> torch.Tensor:
    """A DLMC pattern (Cout x kh kw Cin, TensorFlow's column order) as a 0/1 mask of a torch weight's shape."""
    cout = weight_shape[0]
    cin, kh, kw = (weight_shape[1], 1, 1) if len(weight_shape) == 2 else weight_shape[1:]
    if pattern.shape != (cout, cin * kh * kw):
        raise ValueError(f"pattern {pattern.shape} does not fit a weight of shape {tuple(weight_shape)}")
    rows = np.repeat(np.arange(cout), np.diff(pattern.indptr))
    cols = pattern.indices.astype(np.int64)
    tap, ci = cols // cin, cols % cin  # (r, s, ci): ci fastest
    mask = np.zeros((cout, cin, kh * kw), np.float32)
    mask[rows, ci, tap] = 1.0
    return torch.from_numpy(mask.reshape(weight_shape))


def apply_dlmc_masks(model: ResNet50, directory: Path) -> dict[str, float]:
    """Zero, in place, every weight outside its DLMC pattern (directory: e.g. .../rn50/magnitude_pruning/0.9).
    Returns each weight's resulting sparsity."""
    directory = Path(directory)
    sparsities = {}
    params = dict(model.named_parameters())
    for name, stem in dlmc_name_map().items():
        path = directory / f"{stem}.smtx"
        if not path.is_file():
            raise ValueError(f"{path}: missing; a DLMC rn50 sparsity directory holds all 54 layers")
        weight = params[name]
        pattern = SparseMatrix.from_smtx(path)  # the pattern; its drawn values are not used
        mask = dlmc_mask(pattern, tuple(weight.shape)).to(weight.device, weight.dtype)
        with torch.no_grad():
            weight.mul_(mask)
        sparsities[name] = 1.0 - float(mask.sum()) / mask.numel()
    return sparsities


def calibrate_batchnorm(model: nn.Module, input_shape=(8, 3, 224, 224), passes: int = 4, seed: int = 0) -> None:
    """Set every BatchNorm's running statistics to the cumulative average over `passes` forward passes of
    seeded random inputs (train-mode statistics, no gradients), then put the model in eval mode: with
    torchvision's initialisation and 90% of the weights zeroed, the default (0, 1) statistics let the
    activations drift far from fp16's range."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # cumulative moving average over the passes
    model.train()
    with torch.no_grad():
        for _ in range(passes):
            model(torch.randn(input_shape, generator=generator).to(device, next(model.parameters()).dtype))
    model.eval()
