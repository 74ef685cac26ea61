import pytest

from sparseforge.tune import candidates, default_config


@pytest.mark.parametrize("n", [1, 7, 49, 196, 256, 784, 3136, 12544])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_candidates_are_valid_unique_and_start_with_default(n, layout):
    configs = candidates(n, layout)
    assert configs[0] == default_config(n, layout)
    assert len(configs) == len(set(configs)) >= 3
    for config in configs:
        assert n % config.vec == 0
        if layout == "nk":
            assert config.vec == 1


def test_column_warps_cover_n_without_idle_warps():
    config = default_config(256, "kn")
    assert config.warps_per_block * 32 * config.vec <= 2 * 256


def test_split_candidates_for_small_n_and_long_rows_not_with_relu():
    small = candidates(49, "kn", group_nnz=200.0)
    assert [c.segment_nnz for c in small[1:4]] == [50, 100, 400]
    assert small[0].segment_nnz == 0  # the heuristic pick stays first and unsplit
    large = candidates(3136, "kn", group_nnz=200.0)
    assert [c.segment_nnz for c in large if c.segment_nnz] == [400]
    assert all(c.segment_nnz == 0 for c in candidates(49, "kn", group_nnz=200.0, relu=True))
    assert all(c.segment_nnz == 0 for c in candidates(49, "kn"))


def test_chunked_candidates_for_kn_only():
    kn = [c for c in candidates(3136, "kn") if c.chunk_k]
    assert [c.groups_per_block for c in kn] == [4, 8] and all(c.chunk_k == 64 for c in kn)
    assert not any(c.chunk_k for c in candidates(256, "nk"))


def test_nk_candidates_include_transposed_x_early():
    configs = candidates(256, "nk")
    assert not configs[0].transpose_x and configs[1].transpose_x and configs[1].vec == 1
