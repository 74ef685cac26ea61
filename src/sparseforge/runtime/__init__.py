"""Runtime: the one path from kernel source to a loaded, timed kernel: compilers, the disk cache, one
cache-key recipe, one loader, launches, the timing that decisions use (timing.py), and the pool that
compiles many problems' candidates ahead of measuring them (prebuild.py)."""
from .cache import KernelCache, cache_key
from .compiler import CompileError, DriverCompiler, PtxasCompiler, default_compiler, find_tool
from .kernel import (Built, SpmmKernel, build_kernel, compile_plan, compile_sketch, compile_source, kernel_key,
                     load_kernel)

__all__ = ["Built", "CompileError", "DriverCompiler", "KernelCache", "PtxasCompiler", "SpmmKernel", "build_kernel",
           "cache_key", "compile_plan", "compile_sketch", "compile_source", "default_compiler", "find_tool", "kernel_key",
           "load_kernel"]
