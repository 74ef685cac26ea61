import numpy as np

from sparseforge import SparseMatrix
from sparseforge.plan import TileConfig, make_plan, operand_bytes


def test_runs_share_columns_only_when_chunked():
    dense = np.zeros((8, 32), np.float32)
    dense[:, [1, 5, 9]] = 1.0                     # every row uses the same three columns
    w = SparseMatrix.from_dense(dense)
    one = operand_bytes(make_plan(w, 64, config=TileConfig(rows_per_group=2, groups_per_block=4)))
    assert one["one_pass"] == one["chunked"] == 4 * 3 * 64 * 4       # 4 groups x 3 k x N x fp32
    chunked = operand_bytes(make_plan(w, 64, config=TileConfig(rows_per_group=2, groups_per_block=4, chunk_k=8)))
    assert chunked["chunked"] == 3 * 64 * 4 and chunked["chunks"] == 4  # the run fetches each k once
    assert chunked["minimum"] == 32 * 64 * 4 and chunked["atomics"] == 0


def test_atomics_count_the_split_rows():
    w = SparseMatrix.from_dense(np.ones((2, 40), np.float32))
    traffic = operand_bytes(make_plan(w, 16, "float16", config=TileConfig(rows_per_group=2, segment_nnz=20)))
    assert traffic["atomics"] == 4 * 2 * 16 * 2  # 4 pieces x 2 rows x N x fp16
