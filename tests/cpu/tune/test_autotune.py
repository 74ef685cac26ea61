import dataclasses

import pytest

from sparseforge.tune import candidates, default_config
from sparseforge.mappings.tile.autotune import SPLIT_MAX_ITEMS, SPLIT_ROW_NNZ, chunked_candidates


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
    small = candidates(49, "kn", row_nnz=50.0)  # below SPLIT_ROW_NNZ: the pick stays unsplit
    assert small[0].segment_nnz == 0
    assert [c.segment_nnz for c in small[1:4]] == [50, 100, 400]
    large = candidates(3136, "kn", row_nnz=50.0)
    assert [c.segment_nnz for c in large if c.segment_nnz] == [400]
    assert all(c.segment_nnz == 0 for c in candidates(49, "kn", row_nnz=50.0, relu=True))
    assert all(c.segment_nnz == 0 for c in candidates(49, "kn"))


def test_long_rows_with_few_work_items_split_by_default_and_tuner_can_undo_it():
    row_nnz = SPLIT_ROW_NNZ + 10.0
    first = default_config(196, "kn", row_nnz, m=512)
    assert first.segment_nnz == int(row_nnz * first.rows_per_group / 4)
    configs = candidates(196, "kn", row_nnz, m=512)
    assert configs[0] == first and dataclasses.replace(first, segment_nnz=0) in configs
    assert default_config(196, "kn", row_nnz, relu=True, m=512).segment_nnz == 0  # relu cannot fuse splits
    assert default_config(784, "kn", row_nnz, m=512).segment_nnz == 0  # enough column tiles already
    assert default_config(49, "kn", row_nnz, m=1000).segment_nnz == 0  # enough row groups already
    assert default_config(49, "kn", row_nnz, m=4 * SPLIT_MAX_ITEMS).segment_nnz > 0
    assert default_config(196, "kn", SPLIT_ROW_NNZ - 1.0, m=512).segment_nnz == 0
    assert default_config(196, "kn", row_nnz).segment_nnz == 0  # rows unknown: no split


def test_tuner_does_not_propose_chunked_runs_until_measured():
    assert not any(c.chunk_k for n in (49, 3136) for c in candidates(n, "kn", row_nnz=100.0))
    kn = chunked_candidates(default_config(3136, "kn"), 3136)
    assert [c.groups_per_block for c in kn] == [4, 8] and all(c.chunk_k == 64 for c in kn)
    assert kn[1].vec == 1 and kn[1].cluster_rows and not kn[0].cluster_rows


def test_kn_clusters_rows_by_default_and_tuner_keeps_consecutive_rows():
    configs = candidates(196, "kn", row_nnz=50.0, m=512)
    assert configs[0].cluster_rows
    assert dataclasses.replace(configs[0], cluster_rows=False) in configs
    assert not default_config(256, "nk").cluster_rows


def test_nk_transposes_x_by_default_and_keeps_staging_as_a_candidate():
    configs = candidates(256, "nk")
    assert configs[0].transpose_x and configs[0].vec == 1
    assert any(not c.transpose_x for c in configs)


def test_tuner_tries_split_k_at_large_n_only_where_work_items_are_few():
    # 128 rows at N = 784: 32 row groups x 2 column tiles, far under one item per SM
    few = [c.segment_nnz for c in candidates(784, "kn", row_nnz=100.0, m=128) if c.segment_nnz]
    assert few == [100, 200, 800]
    many = [c.segment_nnz for c in candidates(784, "kn", row_nnz=100.0, m=4096) if c.segment_nnz]
    assert many == [800]
    assert default_config(784, "kn", 100.0, m=128).segment_nnz == 0  # measured only at N <= 256: tuner's call
