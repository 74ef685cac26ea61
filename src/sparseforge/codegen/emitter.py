"""A tiny line buffer for PTX text: indentation, comments, and register-count bookkeeping."""
from __future__ import annotations

import struct


def f32_immediate(value: float) -> str:
    """A float as a PTX fp32 immediate (exact bit pattern, e.g. 0f3F800000 for 1.0)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


class Emitter:
    def __init__(self):
        self._lines: list[str] = []
        self.max_index: dict[str, int] = {}

    def line(self, text: str) -> None:
        self._lines.append(text if text.endswith(":") else "    " + text)

    def lines(self, texts) -> None:
        for text in texts:
            self.line(text)

    def comment(self, text: str) -> None:
        self._lines.append(f"    // {text}")

    def label(self, name: str) -> None:
        self._lines.append(f"{name}:")

    def reg(self, prefix: str, index: int) -> str:
        """Name register %<prefix><index> and remember how many of that prefix to declare."""
        self.max_index[prefix] = max(self.max_index.get(prefix, -1), index)
        return f"%{prefix}{index}"

    def extend(self, other: "Emitter") -> None:
        """Append another emitter's lines, keeping its register counts."""
        self._lines.extend(other._lines)
        for prefix, top in other.max_index.items():
            self.max_index[prefix] = max(self.max_index.get(prefix, -1), top)

    def text(self) -> str:
        return "\n".join(self._lines)
