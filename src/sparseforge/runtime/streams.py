"""torch's current CUDA stream as the raw handle a driver launch takes, without making a Stream object."""
from __future__ import annotations


def current_stream_handle(device_index: int) -> int:
    """cudaStream_t of torch's current stream on a device (the capturing one under CUDA graph capture)."""
    import torch  # here, not at the top: runtime/kernel.py imports this module and loads torch lazily

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Inductor's code calls: no Stream object
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream
