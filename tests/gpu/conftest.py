"""Fixtures of the GPU tests (collected everywhere; the tests themselves skip without a GPU)."""
import numpy as np
import pytest

HALF_TOLERANCE = {"float16": 5e-3, "bfloat16": 3e-2}  # relative error of a 16-bit kernel against float64


def _matches_float64(kernel, w, dtype, layout: str, batch=(), bias=None, relu=False, residual=False, seed=0):
    """The kernel on two fresh inputs (and residuals) into NaN-poisoned outputs, against W (rounded to the
    kernel's dtype) times them in float64 plus bias and residual, then ReLU: every output written and the relative
    error within the 16-bit tolerance."""
    import torch

    name = str(dtype).replace("torch.", "")
    wd = torch.from_numpy(w.astype(name).to_dense().astype(np.float64)).cuda()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(2):  # fresh inputs each time: the same function of any valid input
        b = torch.randn((*batch, *kernel.in_shape), device="cuda", generator=gen).to(dtype)
        out = torch.full((*batch, *kernel.out_shape), float("nan"), device="cuda", dtype=dtype)
        extra = {}
        ref = wd @ b.double() if layout == "kn" else b.double() @ wd.T
        if bias is not None:
            b32 = torch.as_tensor(bias, device="cuda").to(torch.float32).double()
            ref = ref + (b32[:, None] if layout == "kn" else b32)
        if residual:
            r = torch.randn(out.shape, device="cuda", generator=gen).to(dtype)
            extra["residual"] = r
            ref = ref + r.double()
        if relu:
            ref = ref.clamp_min(0)
        kernel(b, out=out, **extra)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), "an output element was never written"
        scale, err = ref.norm().item(), (out.double() - ref).norm().item()
        assert err <= HALF_TOLERANCE[name] * scale or scale == err == 0, (err, scale)


@pytest.fixture
def matches_float64():
    """_matches_float64: a 16-bit SpMM kernel checked against float64 on fresh inputs."""
    return _matches_float64
