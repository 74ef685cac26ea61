"""Argument errors of the public SpMM API that need no GPU to raise (and the no-GPU error itself)."""
import numpy as np
import pytest
import torch

from sparseforge import SparseMatrix, compile_spmm, spmm

W = SparseMatrix.from_dense(np.eye(4, dtype=np.float32))


@pytest.mark.parametrize("kwargs, error, message", [
    ({"dtype": torch.int8}, TypeError, "dtype"),
    ({"layout": "mk"}, ValueError, "layout"),
    ({"n": 0}, ValueError, "positive integer"),
    ({"device": "cpu"}, ValueError, "CUDA device"),
])
def test_bad_arguments(kwargs, error, message):
    args = {"n": 8, **kwargs}
    with pytest.raises(error, match=message):
        compile_spmm(W, **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where no GPU exists")
def test_no_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        compile_spmm(W, 8)


def test_spmm_rejects_non_tensors_and_bad_rank():
    with pytest.raises(TypeError, match="torch.Tensor"):
        spmm(W, np.ones((4, 8)))
    with pytest.raises(ValueError, match="2-D or 3-D"):
        spmm(W, torch.ones(4))
