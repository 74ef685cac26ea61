"""Refusing a benchmark whose dense operands cannot fit, before anything is allocated.

Both modes build W densely (the reference; cuBLAS on the GPU) and a dense B: a matrix with K = 2^30
columns would otherwise ask numpy or torch for tens of GiB and fail half-way, or get the process killed.
The byte counts below follow what cpu.run_case_cpu and gpu.run_case allocate; keep them in step.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..suite import Case

# numpy storage per element (bfloat16 values are held in float32, see formats/csr.py) and torch's on the GPU
_HOST_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 4}
_GPU_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2}


def host_bytes_available() -> int:
    """Memory this process can still take: Linux's MemAvailable (else all physical memory), capped by the
    container's cgroup limit where there is one."""
    available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            available = min(available, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return available


def gpu_bytes_available() -> int:
    import torch

    return torch.cuda.mem_get_info()[0]


def bytes_needed(case: Case, dtype: str, gpu: bool) -> dict[str, tuple[int, int]]:
    """{"host" / "GPU": (bytes of the dense W and its float64 copy, bytes of B, C and their references)}."""
    m, k, n = case.M, case.K, case.N
    if not gpu:  # W dense, then float64; B, the reference and the result in float64 at N <= 64
        n_check = min(n, 64)
        return {"host": (m * k * (_HOST_ELEMENT[dtype] + 8), (k + 2 * m) * n_check * 8)}
    es = _GPU_ELEMENT[dtype]
    # GPU: W in dtype and float64; four inputs (generated in float32) and one in float64; three outputs in
    # dtype, the reference and the error's copy in float64
    return {"host": (m * k * _HOST_ELEMENT[dtype], 0),
            "GPU": (m * k * (es + 8), k * n * (4 * es + 4 + 8) + m * n * (3 * es + 16))}


def check_fits(jobs: list[tuple[Case, str, str]], gpu: bool) -> None:
    """Raise ValueError naming the first (case, dtype, layout) job whose dense operands exceed the memory
    available now, with the size it would need."""
    available = {"host": host_bytes_available(), **({"GPU": gpu_bytes_available()} if gpu else {})}
    for case, dtype, _ in jobs:
        for where, (weight, operands) in bytes_needed(case, dtype, gpu).items():
            if weight + operands > available[where]:
                raise ValueError(
                    f"{case.path} ({case.M} x {case.K}, N = {case.N}, {dtype}) needs {_size(weight + operands)} of "
                    f"{where} memory for its dense operands (W as a dense matrix: {_size(weight)}; B and C: "
                    f"{_size(operands)}), and {_size(available[where])} is available; leave this matrix out "
                    "(a smaller --n / --batch / --tokens shrinks only B and C)")


def _size(count: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    step = 0
    while count >= 1024 and step < len(units) - 1:
        count, step = count / 1024, step + 1
    return f"{count:.1f} {units[step]}"
