"""The one dtype helper: any spelling of a floating dtype sparseforge knows -> its canonical name.

Accepts torch dtypes, numpy dtypes and strings ("torch.float16", "float16", "fp16", "half", ...) without
importing torch, so formats/ and plan/ stay importable on machines without it. Callers decide which of the
names they support and raise their own error for the rest.
"""
from __future__ import annotations

from typing import Any

_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
            "fp64": "float64", "double": "float64"}
KNOWN = ("float32", "float16", "bfloat16", "float64")
KERNEL_DTYPES = ("float32", "float16", "bfloat16")  # what the generated kernels take and return (fp32 accumulation)
SHORT_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # the CLI's --dtype spellings


def dtype_name(dtype: Any) -> str | None:
    """"float32", "float16", "bfloat16" or "float64" for any spelling of those, else None."""
    name = str(dtype).replace("torch.", "")
    name = _ALIASES.get(name, name)
    return name if name in KNOWN else None


def kernel_dtype_name(dtype: Any) -> str:
    """The canonical name of a dtype the kernels take, or a TypeError naming the ones they do."""
    name = dtype_name(dtype)
    if name not in KERNEL_DTYPES:
        raise TypeError(f"dtype {dtype} is not supported; use torch.float32, torch.float16 or torch.bfloat16")
    return name
