import numpy as np

from sparseforge import SparseMatrix
from sparseforge.plan import TileConfig, make_plan
from sparseforge.runtime.kernel import plan_key


def _plan(values=(1.0, 2.0), **kw):
    dense = np.array([[values[0], 0.0], [0.0, values[1]]], np.float32)
    return make_plan(SparseMatrix.from_dense(dense), 16, **kw)


def test_key_changes_with_everything_that_changes_the_binary():
    base = plan_key(_plan(), "ptxas 13.0")
    variants = [_plan(values=(1.0, 3.0)), _plan(layout="nk"), _plan(dtype="float16"), _plan(relu=True),
                _plan(bias=[1.0, 0.0]), _plan(config=TileConfig(rows_per_group=2)), _plan(arch=80)]
    keys = {plan_key(p, "ptxas 13.0") for p in variants}
    assert base not in keys and len(keys) == len(variants)
    assert plan_key(_plan(), "ptxas 13.1") != base
    assert plan_key(_plan(), "ptxas 13.0") == base
