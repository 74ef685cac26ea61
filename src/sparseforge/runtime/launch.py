"""A kernel launch with its parameter block built once, straight through libcuda's cuLaunchKernel (ctypes).

Separate from driver.py so that it imports without cuda-python's driver module (and its tests run on a
machine without a GPU); driver.py is imported only to initialise the driver and to name an error.
"""
from __future__ import annotations

import ctypes
import threading
from functools import lru_cache


@lru_cache(maxsize=1)
def _raw_launch():
    """libcuda's cuLaunchKernel through ctypes, argument types declared once. cuda-python's wrapper builds a
    parameter object from (values, types) on every call (tens of microseconds of host time);
    the driver itself needs only an array of pointers to the values."""
    from .driver import init_driver

    init_driver()  # cuda-python has loaded libcuda.so.1: this opens the same library, not a second driver
    function = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    function.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    function.restype = ctypes.c_int
    return function


class PackedLaunch:
    """A kernel launch whose parameter block is built once: `params` 64-bit values (device pointers, the only
    parameters the generated kernels take) and the array of pointers to them that cuLaunchKernel reads.
    fix(i, value) sets a value that never changes (W's device arrays); a call sets the ones that change (input,
    output: by default the leading ones) and launches. The driver copies the values at launch, so the block is reused at once; a lock
    covers setting and launching, because ctypes releases the GIL during the driver call."""

    def __init__(self, function, block: int, params: int, shared_bytes: int = 0):
        self._values = (ctypes.c_uint64 * max(params, 1))()
        base = ctypes.addressof(self._values)
        self._pointers = (ctypes.c_void_p * max(params, 1))(*(base + 8 * i for i in range(max(params, 1))))
        self._function = ctypes.c_void_p(int(function))
        self._block, self._shared = block, shared_bytes  # shared_bytes: dynamic shared memory a block gets
        self.shape = (block, params, shared_bytes)
        self._lock = threading.Lock()

    def fix(self, index: int, value: int) -> None:
        self._values[index] = value

    def __call__(self, grid: tuple[int, int, int], stream: int, *values: int, first: int = 0) -> None:
        """Launch on `stream` with values[j] as parameter first + j (the others as fixed or last set)."""
        with self._lock:
            for i, value in enumerate(values, first):
                self._values[i] = value
            status = _raw_launch()(self._function, grid[0], grid[1], grid[2], self._block, 1, 1, self._shared,
                                   stream, self._pointers, None)
        if status:
            from .driver import CudaError, check, cu

            try:
                code = cu.CUresult(status)
            except ValueError:  # a status this cuda-python does not name
                raise CudaError(f"CUDA driver error {status} from cuLaunchKernel") from None
            check(code)
