"""Runtime: compilers, the disk cache, module loading and launches."""
from .cache import KernelCache, cache_key
from .compiler import CompileError, DriverCompiler, PtxasCompiler, default_compiler, find_tool
from .kernel import SpmmKernel, build_kernel

__all__ = ["CompileError", "DriverCompiler", "KernelCache", "PtxasCompiler", "SpmmKernel", "build_kernel",
           "cache_key", "default_compiler", "find_tool"]
