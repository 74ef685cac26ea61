"""compile_conv2d / compile_conv1d refuse bad input with the problem named, before any GPU is needed."""
import numpy as np
import pytest
import torch

from sparseforge import SparseMatrix, compile_conv1d, compile_conv2d
from sparseforge.plan.csr import CsrColumnsConfig


def _weight(cout=8, cin=4, k=3):
    return torch.randn(cout, cin, k, k)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(layout="nhwc"), ValueError, "only 'nchw'"),
    (dict(W=torch.randn(8, 36)), ValueError, "Conv2d weight"),
    (dict(W=SparseMatrix.from_dense(np.ones((8, 36), np.float32))), ValueError, "pass kernel_size"),
    (dict(input_shape=(1, 5, 8, 8)), ValueError, "needs Cout x 45"),
    (dict(groups=3), ValueError, "must divide channels"),
    (dict(kernel_size=5), ValueError, "does not match"),
    (dict(config=CsrColumnsConfig(4)), ValueError, "columns in"),
    (dict(bias=np.ones(3)), ValueError, "bias must have M = 8"),
    (dict(dtype=torch.float64), TypeError, "float64"),
    (dict(padding=(1, 2, 3)), TypeError, "padding must be an int or a pair"),
])
def test_bad_arguments_are_named_before_the_gpu(kwargs, error, message):
    args = dict(W=_weight(), input_shape=(1, 4, 8, 8), padding=1)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        compile_conv2d(args.pop("W"), args.pop("input_shape"), **args)


def test_a_good_call_without_a_gpu_says_so():
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        compile_conv2d(_weight(), (1, 4, 8, 8), padding=1)
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        compile_conv1d(torch.randn(100, 300, 5), (1, 300, 64))


def test_conv1d_refusals():
    with pytest.raises(ValueError, match="Conv1d weight"):
        compile_conv1d(torch.randn(100, 300), (1, 300, 64))
    with pytest.raises(ValueError, match="batch, channels, length"):
        compile_conv1d(torch.randn(100, 300, 3), (300, 64))
    with pytest.raises(ValueError, match="kernel_size=k"):
        compile_conv1d(SparseMatrix.from_dense(np.ones((4, 9), np.float32)), (1, 3, 64))
