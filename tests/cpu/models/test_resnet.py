"""The ResNet-50 built for the end-to-end figures (models/resnet.py): torchvision's layer names and
shapes, every DLMC rn50 file used once at the right weight, the masks read in TensorFlow's column order,
and BatchNorm calibration keeping the pruned model's activations in fp16 range."""
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from sparseforge import SparseMatrix
from sparseforge.models import apply_dlmc_masks, calibrate_batchnorm, dlmc_mask, dlmc_name_map, resnet50

ARCHIVE = Path(__file__).resolve().parents[4] / "shared" / "dlmc" / "dlmc-subset.tar.xz"


@pytest.fixture(scope="module")
def rn50_dir(tmp_path_factory):
    if not ARCHIVE.is_file():
        pytest.skip(f"{ARCHIVE} not present")
    root = tmp_path_factory.mktemp("dlmc")
    with tarfile.open(ARCHIVE) as tar:
        members = [m for m in tar.getmembers() if "/rn50/magnitude_pruning/0.9/" in m.name]
        tar.extractall(root, members=members, filter="data")
    return root / "dlmc" / "rn50" / "magnitude_pruning" / "0.9"


def test_architecture_has_torchvisions_names_and_parameter_count():
    model = resnet50()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision's resnet50
    assert model.layer2[0].conv2.stride == (2, 2) and model.layer2[0].conv1.stride == (1, 1)  # v1.5
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


def test_name_map_pairs_all_54_files_with_weights_of_their_shape(rn50_dir):
    names = dlmc_name_map()
    assert len(names) == len(set(names.values())) == 54
    assert {p.stem for p in rn50_dir.glob("*.smtx")} == set(names.values())
    params = dict(resnet50().named_parameters())
    for name, stem in names.items():
        pattern = SparseMatrix.from_smtx(rn50_dir / f"{stem}.smtx")
        w = params[name]
        assert pattern.shape == (w.shape[0], w[0].numel()), name


def test_masks_follow_tensorflows_column_order():
    """Column c of a 3x3 pattern is tap c // Cin, channel c % Cin."""
    cin, cout = 4, 2
    indptr, indices = np.array([0, 2, 3]), np.array([0 * cin + 3, 4 * cin + 1, 8 * cin + 0])
    mask = dlmc_mask(SparseMatrix(indptr, indices, np.ones(3, np.float32), (cout, 9 * cin)), (cout, cin, 3, 3))
    assert mask[0, 3, 0, 0] == 1 and mask[0, 1, 1, 1] == 1 and mask[1, 0, 2, 2] == 1 and mask.sum() == 3


def test_masked_model_has_the_files_sparsity_and_calibrated_activations_fit_fp16(rn50_dir):
    model = resnet50()
    sparsities = apply_dlmc_masks(model, rn50_dir)
    assert 0.85 < np.mean(list(sparsities.values())) < 0.95
    calibrate_batchnorm(model, input_shape=(2, 3, 64, 64), passes=2)
    assert not model.training
    with torch.no_grad():
        out = model(torch.randn(2, 3, 64, 64))
    assert torch.isfinite(out).all() and out.abs().max() < 6e4


def test_the_masked_resnet_converts_whole_and_computes_the_same(rn50_dir):
    """Every conv and the FC become sparse modules (policy 'sparse': no timing on the CPU), BatchNorms fold
    into the convolutions they follow (the residual adds and shared ReLUs stay), and the output is kept."""
    from sparseforge.nn import SparseConv2d, SparseLinear, convert

    model = resnet50()
    apply_dlmc_masks(model, rn50_dir)
    calibrate_batchnorm(model, input_shape=(2, 3, 64, 64), passes=1)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        want = model(x)
    report = convert(model, x, policy="sparse")
    assert len(report.layers) == 54 and len(report.folded) == 53  # every BatchNorm follows its conv alone
    assert sum(isinstance(m, SparseConv2d) for m in model.modules()) == 53
    assert isinstance(model.fc, SparseLinear)
    with torch.no_grad():
        got = model(x)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
