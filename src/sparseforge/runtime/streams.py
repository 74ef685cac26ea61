"""torch's current CUDA stream as the raw handle a driver launch takes, without making a Stream object."""
from __future__ import annotations


def current_stream_handle(device_index: int) -> int:
    """cudaStream_t of torch's current stream on a device (the capturing one under CUDA graph capture)."""
    import torch  # here, not at the top: runtime/kernel.py imports this module and loads torch lazily

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Inductor's code calls: no Stream object
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def ready_dense_fallback(weight, bias=None) -> None:
    """Run one tiny dense call like `F.linear(x, weight, bias)` now, outside any CUDA graph capture.

    A layer's dense fallback may first run inside a capture, where cuBLAS cannot create its handles
    (CUBLAS_STATUS_NOT_INITIALIZED, and the capture is lost): one call here creates them for the device."""
    import torch
    import torch.nn.functional as F

    if not weight.is_cuda or torch.cuda.is_current_stream_capturing():
        return
    with torch.no_grad(), torch.cuda.device(weight.device):
        # two rows and the bias: the dispatch a real fallback call takes (cuBLASLt's bias epilogue too)
        rows = min(2, weight.shape[0])
        F.linear(weight.new_zeros(2, weight.shape[-1]), weight[:rows], None if bias is None else bias[:rows])
