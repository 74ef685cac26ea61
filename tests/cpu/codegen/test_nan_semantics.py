"""NaN and inf in B through every kernel form, on the PTX interpreter: a non-finite B[k, j] reaches exactly the
outputs C[i, j] whose row i of W has a nonzero in column k (SpmmKernel's docstring); a column W does not use
poisons nothing, not even through the small-N kernel's padding (which points at column 0). The same problem
runs on the device in tests/gpu/test_errors_gpu.py."""
import numpy as np
import pytest

from sparseforge import SparseMatrix
from sparseforge.plan import TileConfig, make_plan
from sparseforge.mappings.csr.plan import CsrConfig, make_csr_plan

from .test_interpreted import _decode, _encode, run_csr, run_plan

M = K = 24
N = 8
UNUSED = 0  # a column of W no row uses


def poison_weight() -> SparseMatrix:
    rng = np.random.default_rng(7)
    values = rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 1.5], (M, K))
    dense = np.where(rng.random((M, K)) < 0.3, values, 0).astype(np.float32)
    dense[:, UNUSED] = 0
    dense[:, 3] = 0
    dense[1::3, 3] = 1.5  # column 3: rows 1, 4, 7, ...
    dense[:, 7] = 0
    dense[[2, 6], 7] = [1.0, -2.0]  # column 7: one positive and one negative weight
    dense[5] = 0  # an empty row
    return SparseMatrix.from_dense(dense)


def poisoned_b() -> np.ndarray:
    """(2, K, N) in kn terms: NaN through all of the unused column, a NaN at a used one in batch 1, +-inf in
    batch 0."""
    b = np.random.default_rng(8).standard_normal((2, K, N))
    b[:, UNUSED, :] = np.nan
    b[1, 3, 2] = np.nan
    b[0, 7, 4] = np.inf
    return b


def sparse_reference(w: SparseMatrix, b: np.ndarray) -> np.ndarray:
    """[batch,] M x N in float64 from W's stored nonzeros only (IEEE: NaN * w = NaN, inf * w = +-inf)."""
    out = np.zeros((*b.shape[:-2], w.shape[0], b.shape[-1]))
    for i in range(w.shape[0]):
        lo, hi = w.indptr[i], w.indptr[i + 1]
        if hi > lo:
            out[..., i, :] = (w.values[lo:hi, None].astype(np.float64) * b[..., w.indices[lo:hi], :]).sum(-2)
    return out


def check_poisoned(got: np.ndarray, ref: np.ndarray, tol: float) -> None:
    assert np.array_equal(np.isnan(got), np.isnan(ref)), "NaN where the sparse product has none, or none where it has"
    assert np.array_equal(np.isposinf(got), np.isposinf(ref)) and np.array_equal(np.isneginf(got), np.isneginf(ref))
    finite = np.isfinite(ref)
    assert np.allclose(got[finite], ref[finite], rtol=tol, atol=tol)


FORMS = [
    ("kn", TileConfig(4, 2, 1, 4)),
    ("kn", TileConfig(1, 1, 1, 4)),
    ("kn", TileConfig(2, 1, 1, 4, 1, 6)),
    ("nk", TileConfig(2, 2, 1, 4)),
    ("nk", TileConfig(2, 1, 1, 4, 1, transpose_x=True)),
    ("kn", CsrConfig(8, 4, 1)),
    ("nk", CsrConfig(8, 4, 1)),
]
FORM_IDS = ["row_groups", "row_per_block", "split_k", "nk_staged", "nk_transposed", "small_n_kn", "small_n_nk"]


def test_the_problem_is_what_the_tests_say():
    w, b = poison_weight(), poisoned_b()
    dense = w.to_dense()
    assert not dense[:, UNUSED].any() and not dense[5].any()
    assert 0 < np.count_nonzero(dense[:, 3]) < M
    ref = sparse_reference(w, b)
    assert np.isnan(ref[1, :, 2]).sum() == np.count_nonzero(dense[:, 3]) and np.isnan(ref).sum() == 8
    assert ref[0, 2, 4] == np.inf and ref[0, 6, 4] == -np.inf and np.isfinite(np.delete(ref[0], [2, 6], 0)).all()
    assert (ref[:, 5] == 0).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout,config", FORMS, ids=FORM_IDS)
def test_non_finite_b_reaches_exactly_the_rows_using_its_column(layout, config, dtype):
    w, b = poison_weight(), poisoned_b()
    if isinstance(config, CsrConfig):
        plan = make_csr_plan(w, N, dtype, layout, config)
    else:
        plan = make_plan(w, N, dtype, layout, config)
    if config == FORMS[2][1]:
        assert plan.mapping == "split-k"
    operand = b if layout == "kn" else np.swapaxes(b, -1, -2).copy()
    got = (run_csr if isinstance(config, CsrConfig) else run_plan)(plan, operand)
    if layout == "nk":
        got = np.swapaxes(got, -1, -2)
    rounded = _decode(_encode(b, dtype), dtype)  # B as the kernel reads it (W's values are exact in bf16)
    check_poisoned(got, sparse_reference(w, rounded), {"float32": 1e-5, "bfloat16": 3e-2}[dtype])
