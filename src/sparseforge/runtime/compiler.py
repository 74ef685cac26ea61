"""Compilers: PTX modules -> one linked cubin. Small interchangeable classes with one job.

PtxasCompiler (preferred, measured): each module assembled by its own `ptxas -c` process, all in parallel,
then `nvlink` joins them. ptxas time grows faster than linearly with module size (a 26k-nonzero kernel:
66-104 s as one module, 2.5 s as 39 modules on 2 cores), so many small modules beat one large one.
DriverCompiler: the CUDA driver's JIT linker (no toolkit needed), modules compiled one after another.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

from .. import env


class CompileError(RuntimeError):
    """The generated source did not assemble or link; the message carries the tool's diagnostics."""


def _candidate_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]) / "bin")
    dirs += [Path("/usr/local/cuda/bin"), *sorted(Path("/usr/local").glob("cuda-*/bin"))]
    try:  # the nvidia-cuda-nvcc wheel ships ptxas
        import nvidia.cuda_nvcc as wheel

        dirs.append(Path(list(wheel.__path__)[0]) / "bin")
    except Exception:
        pass
    return dirs


@lru_cache(maxsize=None)
def find_tool(name: str) -> str | None:
    for folder in _candidate_dirs():
        candidate = folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name)


@lru_cache(maxsize=None)
def tool_version(path: str) -> str:
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1] if out.strip() else "unknown"


class PtxasCompiler:
    name = "ptxas+nvlink"

    def __init__(self, ptxas: str, nvlink: str, jobs: int | None = None):
        self.ptxas, self.nvlink = ptxas, nvlink
        self.jobs = jobs or env.cpu_cores()

    @classmethod
    def available(cls) -> "PtxasCompiler | None":
        ptxas, nvlink = find_tool("ptxas"), find_tool("nvlink")
        return cls(ptxas, nvlink) if ptxas and nvlink else None

    @property
    def version(self) -> str:
        return f"{self.name} {tool_version(self.ptxas)} / {tool_version(self.nvlink)}"

    def _assemble(self, folder: Path, index: int, source: str, arch: int) -> Path:
        ptx, obj = folder / f"m{index}.ptx", folder / f"m{index}.o"
        ptx.write_text(source)
        done = subprocess.run([self.ptxas, f"-arch=sm_{arch}", "-c", "-o", str(obj), str(ptx)],
                              capture_output=True, text=True)
        if done.returncode:
            raise CompileError(f"ptxas failed on module {index}:\n{done.stderr[-4000:]}")
        return obj

    def compile(self, modules: tuple[str, ...], arch: int) -> bytes:
        with tempfile.TemporaryDirectory(prefix="sparseforge-") as tmp:
            folder = Path(tmp)
            with ThreadPoolExecutor(min(self.jobs, len(modules))) as pool:
                objects = list(pool.map(lambda im: self._assemble(folder, im[0], im[1], arch), enumerate(modules)))
            linked = folder / "kernel.cubin"
            done = subprocess.run([self.nvlink, f"-arch=sm_{arch}", "-o", str(linked), *map(str, objects)],
                                  capture_output=True, text=True)
            if done.returncode:
                raise CompileError(f"nvlink failed:\n{done.stderr[-4000:]}")
            return linked.read_bytes()


class DriverCompiler:
    """cuLink* of the CUDA driver: PTX in, cubin out, on any machine with a driver."""

    name = "driver-jit"

    @property
    def version(self) -> str:
        from .driver import driver_version

        return f"{self.name} {driver_version()}"

    def compile(self, modules: tuple[str, ...], arch: int) -> bytes:
        from .driver import link_ptx

        return link_ptx(modules)


def default_compiler():
    return PtxasCompiler.available() or DriverCompiler()
