import pytest

from sparseforge.suite import SAMPLE_DIR, discover


def test_sample_suite_covers_models_sparsities_and_shapes():
    cases = discover(SAMPLE_DIR)
    assert 18 <= len(cases) <= 30
    assert {c.model for c in cases} == {"rn50", "transformer"}
    assert {c.sparsity for c in cases} == {0.9, 0.95}
    assert all(c.N for c in cases)
    by_layer = {(c.layer, c.sparsity): c for c in cases}
    c = by_layer[("bottleneck_1_block_group1_1_1", 0.9)]
    assert (c.M, c.K, c.nnz, c.N) == (64, 256, 1638, 3136)
    assert by_layer[("bottleneck_2_block_group1_1_1", 0.9)].K == 576
    assert by_layer[("final_dense", 0.95)].N == 1
    assert all(c.N == 256 for c in cases if c.model == "transformer")


def test_batch_tokens_and_forced_n():
    one = SAMPLE_DIR / "rn50/magnitude_pruning/0.9/bottleneck_3_block_group4_1_1.smtx"
    assert discover(one, batch=8)[0].N == 49 * 8
    tf = SAMPLE_DIR / "transformer/magnitude_pruning/0.9"
    assert {c.N for c in discover(tf, tokens=128)} == {128}
    assert {c.N for c in discover(SAMPLE_DIR, n=7)} == {7}


def test_case_loads_matrix():
    case = discover(SAMPLE_DIR / "rn50/magnitude_pruning/0.95/initial_conv.smtx")[0]
    w = case.load()
    assert w.shape == (case.M, case.K) and w.nnz == case.nnz
    assert case.name == "rn50/magnitude_pruning/0.95/initial_conv"


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        discover(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no .smtx files"):
        discover(tmp_path)
    with pytest.raises(ValueError, match="batch"):
        discover(SAMPLE_DIR, batch=0)
    with pytest.raises(ValueError, match=r"specs \(conv:\.\.\.\) are cases for `sparseforge bench` only"):
        discover("conv:vgg16")  # was "conv:vgg16 does not exist"


def test_unknown_model_has_no_n(tmp_path):
    (tmp_path / "w.smtx").write_text("2, 2, 1\n0 1 1\n0\n")
    case = discover(tmp_path)[0]
    assert case.N is None and case.sparsity is None


@pytest.mark.parametrize("text, message", [
    ("initial_conv,-5\n", "line 1: N = -5 for initial_conv; N is output pixels per image, >= 1"),  # was N = -5
    ("initial_conv,12544\ninitial_conv,5\n", "line 2: initial_conv is listed twice"),  # the last silently won
])
def test_bad_batchsizes_file_names_the_line(tmp_path, text, message):
    from sparseforge.suite import read_batchsizes

    (tmp_path / "rn50_batchsizes.txt").write_text(text)
    with pytest.raises(ValueError, match=message):
        read_batchsizes(tmp_path / "rn50_batchsizes.txt")


def test_a_file_given_in_the_current_folder_is_named_by_that_folder(tmp_path, monkeypatch):
    (tmp_path / "w.smtx").write_text((SAMPLE_DIR / "rn50/magnitude_pruning/0.9/initial_conv.smtx").read_text())
    monkeypatch.chdir(tmp_path)
    assert discover("w.smtx")[0].name == f"{tmp_path.name}//?/w"  # was "//?/w": the model named ""
