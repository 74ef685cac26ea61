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


def dtype_name(dtype: Any) -> str | None:
    """"float32", "float16", "bfloat16" or "float64" for any spelling of those, else None."""
    name = str(dtype).replace("torch.", "")
    name = _ALIASES.get(name, name)
    return name if name in KNOWN else None
