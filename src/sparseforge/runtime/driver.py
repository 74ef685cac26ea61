"""The CUDA driver through cuda-python (cuda.bindings): contexts, module loading, linking, launches.

Imported lazily: nothing here runs on a machine without a GPU unless a kernel is actually launched.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

from cuda.bindings import driver as cu


class CudaError(RuntimeError):
    pass


def check(result):
    """cuda.bindings returns (status, *values): raise on failure, return the values."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if status != cu.CUresult.CUDA_SUCCESS:
        _, text = cu.cuGetErrorString(status)
        raise CudaError(f"CUDA driver error {status.name}: {text.decode() if text else ''}")
    return values[0] if len(values) == 1 else tuple(values)


@lru_cache(maxsize=None)
def init_driver() -> None:
    check(cu.cuInit(0))


def driver_version() -> int:
    init_driver()
    return check(cu.cuDriverGetVersion())


def use_device(ordinal: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread."""
    init_driver()
    ctx = _primary_context(ordinal)
    check(cu.cuCtxSetCurrent(ctx))


@lru_cache(maxsize=None)
def _primary_context(ordinal: int):
    device = check(cu.cuDeviceGet(ordinal))
    return check(cu.cuDevicePrimaryCtxRetain(device))


DEFAULT_DYNAMIC_SHARED = 48 * 1024  # what a launch may ask without raising the function's limit first


class LoadedKernel:
    """A kernel function in a loaded module; launch() puts it on a given stream."""

    def __init__(self, cubin: bytes, name: str, ordinal: int):
        use_device(ordinal)
        self.ordinal = ordinal
        self.module = check(cu.cuModuleLoadData(cubin))
        self.function = check(cu.cuModuleGetFunction(self.module, name.encode()))
        self._types = (ctypes.c_void_p, ctypes.c_void_p)

    def close(self) -> None:
        """Unload the module (its functions can no longer be launched). For modules loaded for a while only,
        such as the copies a rotated timing makes; a kernel's own module lives as long as the process."""
        if self.module is not None:
            use_device(self.ordinal)  # a module is unloaded from the current context: its device's
            check(cu.cuModuleUnload(self.module))
            self.module = self.function = None

    def launch(self, grid: tuple[int, int, int], block: int, stream: int, b_ptr: int, c_ptr: int) -> None:
        self.launch_args(grid, block, stream, (b_ptr, c_ptr), self._types)

    def launch_args(self, grid: tuple[int, int, int], block: int, stream: int, args: tuple, types: tuple) -> None:
        """A launch with any parameters: values and their ctypes types, in the kernel's order."""
        check(cu.cuLaunchKernel(self.function, grid[0], grid[1], grid[2], block, 1, 1, 0,
                                cu.CUstream(stream), (args, types), 0))

    def packed(self, block: int, params: int, shared_bytes: int = 0) -> "PackedLaunch":
        """A launch of this function whose parameter block (`params` 64-bit values) is built once, with
        `shared_bytes` of dynamic shared memory a block (over 48 KB: the function is allowed it first, as
        CUDA requires; a GPU that has less says so here, before any launch)."""
        from .launch import PackedLaunch

        if shared_bytes > DEFAULT_DYNAMIC_SHARED:
            attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            status, = cu.cuFuncSetAttribute(self.function, attribute, shared_bytes)
            if status != cu.CUresult.CUDA_SUCCESS:
                raise CudaError(f"the kernel needs {shared_bytes} bytes of shared memory a block, more than this "
                                f"GPU allows ({status}): compile it for this GPU's arch (csr-staged's limits "
                                "are per arch), or use a mapping that does not stage B (stage_b=False)")
        return PackedLaunch(self.function, block, params, shared_bytes)

    def attribute(self, attribute) -> int:
        return check(cu.cuFuncGetAttribute(attribute, self.function))

    @property
    def registers(self) -> int:
        return self.attribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS)

    @property
    def local_bytes(self) -> int:
        return self.attribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)


def link_ptx(modules: tuple[str, ...]) -> bytes:
    """Compile and link PTX modules with the driver's JIT linker; returns the cubin."""
    init_driver()
    use_device(0)
    state = check(cu.cuLinkCreate(0, [], []))
    try:
        for i, text in enumerate(modules):
            data = text.encode() + b"\0"
            check(cu.cuLinkAddData(state, cu.CUjitInputType.CU_JIT_INPUT_PTX, data, len(data),
                                   f"m{i}.ptx".encode(), 0, [], []))
        cubin_ptr, size = check(cu.cuLinkComplete(state))
        return ctypes.string_at(int(cubin_ptr), size)
    finally:
        cu.cuLinkDestroy(state)
