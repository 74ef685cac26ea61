"""Convolution cases (suite/conv.py): real geometry for DLMC rn50 3x3 / 7x7 layers, VGG-16 and the text
CNN; spec parsing and its errors."""
import numpy as np
import pytest

from sparseforge.suite import SAMPLE_DIR
from sparseforge.suite.conv import VGG16, discover_conv, is_conv_spec


def test_vgg16_has_its_13_layers_at_their_sizes_pruned_exactly():
    cases = discover_conv("conv:vgg16:0.9", batch=2)
    assert len(cases) == 13 and [c.geometry.channels for c in cases] == [cin for cin, _, _ in VGG16]
    assert all(c.geometry.output_shape[2:] == (size, size) for c, (_, _, size) in zip(cases, VGG16))
    assert all(c.geometry.batch == 2 and c.geometry.kernel == (3, 3) for c in cases)
    w = cases[1].load()
    assert w.shape == (64, 576) and w.nnz == round(64 * 576 * 0.1)
    assert np.array_equal(w.values, cases[1].load().values)  # seeded


def test_text_cnn_is_three_widths_of_100_maps_over_64_words():
    cases = discover_conv("conv:textcnn")
    assert len(cases) == 9 and {c.sparsity for c in cases} == {0.8, 0.9, 0.95}
    widths = sorted({c.geometry.kernel for c in cases})
    assert widths == [(1, 3), (1, 4), (1, 5)]
    assert {c.geometry.output_shape for c in cases if c.geometry.kernel == (1, 5)} == {(1, 100, 1, 60)}


def test_rn50_directory_gives_its_3x3_and_7x7_layers_with_strides_from_the_sizes():
    directory = SAMPLE_DIR / "rn50" / "magnitude_pruning" / "0.9"
    cases = discover_conv(f"conv:{directory}")
    assert {c.layer for c in cases} == {"bottleneck_2_block_group1_1_1", "bottleneck_2_block_group3_1_1", "initial_conv"}
    assert all(c.layer.startswith("bottleneck_2_") or c.layer == "initial_conv" for c in cases)
    for c in cases:
        g = c.geometry
        assert c.load().shape == g.weight_shape
        if c.layer == "initial_conv":
            assert (g.kernel, g.stride, g.padding, g.height) == ((7, 7), (2, 2), (3, 3), 224)
        elif "projection_block_group" in c.layer and not c.layer.endswith("group1"):
            assert g.stride == (2, 2) and g.height == 2 * g.out_height
        else:
            assert g.stride == (1, 1) and g.height == g.out_height and g.padding == (1, 1)


@pytest.mark.parametrize("spec,message", [("conv:vgg16:1.5", "not a number in"), ("conv:resnet", "conv:vgg16"),
                                          ("conv:vgg16:x", "not a number"),
                                          ("conv:", "names no cases: give conv:vgg16")])  # was read as the cwd
def test_bad_specs_name_the_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        discover_conv(spec)


def test_is_conv_spec():
    assert is_conv_spec("conv:vgg16") and not is_conv_spec("llm:0.9") and not is_conv_spec("conv")


def test_dlmc_patterns_are_reordered_from_tensorflows_hwio_to_torchs_order():
    """A weight flattened TensorFlow's way ((r, s, ci) per output channel) comes back in torch's (ci, r, s);
    on DLMC's 7x7 layer the nonzeros then peak at the kernel's centre, as a trained filter's do."""
    from sparseforge import SparseMatrix
    from sparseforge.plan.conv import ConvGeometry
    from sparseforge.suite.conv import tf_to_torch_order

    g = ConvGeometry.of((1, 3, 8, 8), 4, (2, 3))
    rng = np.random.default_rng(0)
    torch_w = np.where(rng.random((4, 3, 2, 3)) < 0.5, rng.standard_normal((4, 3, 2, 3)), 0).astype(np.float32)
    tf_flat = torch_w.transpose(0, 2, 3, 1).reshape(4, -1)  # (co, r, s, ci)
    back = tf_to_torch_order(SparseMatrix.from_dense(tf_flat), g)
    assert np.array_equal(back.to_dense(), torch_w.reshape(4, -1))
    case = [c for c in discover_conv(f"conv:{SAMPLE_DIR}/rn50/magnitude_pruning/0.9") if c.layer == "initial_conv"][0]
    per_tap = np.bincount(case.load().indices % 49, minlength=49).reshape(7, 7)
    assert per_tap[3, 3] > 4 * max(per_tap[0, 0], per_tap[0, 6], per_tap[6, 0], per_tap[6, 6])


def _rn50_dir(tmp_path, sparsity="0.9"):
    directory = tmp_path / "rn50" / "magnitude_pruning" / sparsity
    directory.mkdir(parents=True)
    (tmp_path / "rn50_batchsizes.txt").write_text((SAMPLE_DIR / "rn50_batchsizes.txt").read_text())
    return directory


def test_rn50_directory_with_a_corrupt_pattern_names_the_file_and_line(tmp_path):
    directory = _rn50_dir(tmp_path)
    (directory / "initial_conv.smtx").write_text("garbage\n")
    with pytest.raises(ValueError, match="initial_conv.smtx: line 1 .*'garbage' is not an integer"):
        discover_conv(f"conv:{directory}")


def test_rn50_pattern_whose_k_is_not_whole_taps_is_refused(tmp_path):
    from sparseforge import SparseMatrix

    directory = _rn50_dir(tmp_path)
    w = np.zeros((64, 100), dtype=np.float32)
    w[:, ::7] = 1.0
    SparseMatrix.from_dense(w).to_smtx(directory / "initial_conv.smtx")
    # before: K // 49 = 2 channels, a 64 x 98 weight, and later "duplicate column indices" from the reorder
    with pytest.raises(ValueError, match="K = 100 is not a multiple of the 7x7 taps"):
        discover_conv(f"conv:{directory}")


def test_rn50_directory_named_by_a_sparsity_outside_0_1_is_refused(tmp_path):
    directory = _rn50_dir(tmp_path, "1.5")
    (directory / "initial_conv.smtx").write_text(
        (SAMPLE_DIR / "rn50/magnitude_pruning/0.9/initial_conv.smtx").read_text())
    with pytest.raises(ValueError, match="expected a DLMC rn50 sparsity directory"):
        discover_conv(f"conv:{directory}")


def test_rn50_output_size_that_is_not_a_square_is_refused(tmp_path):
    directory = _rn50_dir(tmp_path)
    (directory / "initial_conv.smtx").write_text(
        (SAMPLE_DIR / "rn50/magnitude_pruning/0.9/initial_conv.smtx").read_text())
    (tmp_path / "rn50_batchsizes.txt").write_text("initial_conv,12000\n")  # was rounded to a 110 x 110 output
    with pytest.raises(ValueError, match="12000 output pixels .* is not a square image"):
        discover_conv(f"conv:{directory}")
