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


def widen(e: Emitter, dtype: str, dst: str, half: str) -> None:
    """fp32 register `dst` from a 16-bit register `half` holding a float16 or bfloat16."""
    if dtype == "bfloat16":
        e.lines([f"cvt.u32.u16 {dst}, {half};", f"shl.b32 {dst}, {dst}, 16;"])
    else:
        e.line(f"cvt.f32.f16 {dst}, {half};")


def silu_times(e: Emitter, gate: str, acc: str) -> None:
    """acc = silu(gate) * acc = gate / (1 + 2^(-gate log2 e)) * acc, in fp32 (scratch: %f). The gated MLP's
    epilogue (the Llama MLP's silu(G x) * (U x))."""
    e.lines([f"mul.f32 %f, {gate}, 0fBFB8AA3B;", "ex2.approx.ftz.f32 %f, %f;", "add.f32 %f, %f, 0f3F800000;",
             "rcp.approx.ftz.f32 %f, %f;", f"mul.f32 %f, {gate}, %f;", f"mul.f32 {acc}, {acc}, %f;"])


def load_operand(e: Emitter, element_bytes: int, elements: int, tag, first: int, guard: str, address: str,
                 space: str = "global.nc") -> None:
    """One (vector) load of `elements` operand values starting at element `first` of slot `tag`, into the
    registers operand_value reads: fp32 into %x{tag}_{i}; 16-bit singles into %hx{tag}_{i}, pairs into the
    words %xw{tag}_{i/2}. guard: a predicate register, or "" for none. The CSR, csr-columns, bitmap and
    convolution kernels share this naming. space: "global.nc", or "shared" (csr-staged's copy of B)."""
    if element_bytes == 4:
        regs = [f"%x{tag}_{first + i}" for i in range(elements)]
        kind = {1: "b32", 2: "v2.b32", 4: "v4.b32"}[elements]
    else:
        regs = [f"%hx{tag}_{first}"] if elements == 1 else [f"%xw{tag}_{first // 2 + i}" for i in range(elements // 2)]
        kind = {1: "b16", 2: "b32", 4: "v2.b32", 8: "v4.b32"}[elements]
    target = regs[0] if len(regs) == 1 else "{" + ", ".join(regs) + "}"
    e.line(f"{'@' + guard + ' ' if guard else ''}ld.{space}.{kind} {target}, {address};")


def operand_value(e: Emitter, dtype: str, element_bytes: int, width: int, tag, i: int) -> str:
    """The fp32 register of operand element i of slot `tag` (load_operand's), widening 16-bit values."""
    x = f"%x{tag}_{i}"
    if element_bytes == 2:
        if width == 1:
            widen(e, dtype, x, f"%hx{tag}_{i}")
        elif dtype == "bfloat16":
            word = f"%xw{tag}_{i // 2}"
            e.line(f"shl.b32 {x}, {word}, 16;" if i % 2 == 0 else f"and.b32 {x}, {word}, -65536;")
        else:
            e.lines([f"mov.b32 {{%hv0, %hv1}}, %xw{tag}_{i // 2};", f"cvt.f32.f16 {x}, %hv{i % 2};"])
    return x
