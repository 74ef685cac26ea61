"""A small interpreter for the PTX subset sparseforge's generators emit (SpMM, packed 2:4 GEMV and its dense
writer): integer address arithmetic, branches and jump tables, calls with .param blocks, 16-bit widening, byte
permutes, 64-bit shifts and word unpacking, fp32 FMAs, stores and atomic adds; shared memory with bar.sync and butterfly, indexed and up warp shuffles (a block's
warps run one at a time as far as barriers let them, the lowest or the highest first, turning at each barrier; a barrier holds
its threads until all arrive, a shuffle needs every live lane of the warp at it, and loads and stores must be aligned to their size). It lets CI run generated kernels numerically,
not just assemble them.

cp.async is asynchronous here as on the GPU: a copy's destination reads as poison (0xFF bytes) from its issue
until the issuing thread's cp.async.wait_group / wait_all retires its group, and only then holds the data. So a
read before the wait that covers it, or a copy issued over a buffer another warp still reads, gives NaN or a
wild offset instead of passing by luck of the interpreter's order.

Semantics follow the PTX ISA for these instructions; fma.rn.f32 is exact in float64 (a 24x24-bit product)
and rounded once to fp32, like the hardware's fused multiply-add.
"""
from __future__ import annotations

import re

import numpy as np

_MASK = {8: 0xFF, 16: 0xFFFF, 32: 0xFFFFFFFF, 64: 0xFFFFFFFFFFFFFFFF}
_LABEL = re.compile(r"^([$A-Za-z_][\w$]*):$")  # nvcc's labels start with $
# a static shared variable a function declares in its body (nvcc's `__shared__ bool last;`): type, name, count
_SHARED = re.compile(r"^\.shared \.align \d+ (\.[bfsu]\d+) (\w+)(?:\[(\d+)\])?;$")


def _signed(value: int, bits: int) -> int:
    return value - (1 << bits) if value >> (bits - 1) else value


def _f32(bits: int) -> float:
    return float(np.uint32(bits).view(np.float32))


def _bits32(value: float) -> int:
    return int(np.float32(value).view(np.uint32))


def _half(bits: int, bf16: bool) -> float:
    if bf16:
        return _f32(bits << 16)
    return float(np.uint16(bits).view(np.float16))


def _to_half(value: float, bf16: bool) -> int:
    if bf16:  # round to nearest even on the top 16 bits of the fp32 pattern
        bits = _bits32(value)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return int(np.float16(value).view(np.uint16))


class Memory:
    """Global memory as named numpy buffers placed at fake device addresses."""

    def __init__(self):
        self.regions: list[tuple[int, np.ndarray]] = []
        self._next = 0x1000_0000

    def place(self, array: np.ndarray) -> int:
        base = self._next
        self.regions.append((base, array.reshape(-1).view(np.uint8)))
        self._next += (array.nbytes + 0xFFFF) & ~0xFFFF or 0x10000
        return base

    def _find(self, address: int, size: int) -> tuple[np.ndarray, int]:
        for base, data in self.regions:
            if base <= address and address + size <= base + data.size:
                return data, address - base
        raise IndexError(f"access of {size} bytes at {address:#x} is outside every buffer")

    def read(self, address: int, size: int) -> int:
        data, offset = self._find(address, size)
        return int.from_bytes(data[offset:offset + size].tobytes(), "little")

    def write(self, address: int, size: int, value: int) -> None:
        data, offset = self._find(address, size)
        data[offset:offset + size] = np.frombuffer(value.to_bytes(size, "little"), dtype=np.uint8)


class Function:
    """A body as instructions parsed once: (guard, op, args), or ("call", block lines) for a call block."""

    def __init__(self, name: str, lines: list[str]):
        self.name, self.code, self.labels, self.tables = name, [], {}, {}
        self.shared: dict[str, int] = {}  # static .shared variables declared in the body: name -> bytes
        i = 0
        while i < len(lines):
            line = lines[i]
            if m := _SHARED.match(line):
                self.shared[m.group(2)] = int(m.group(1)[1:].lstrip("bfsu") or 8) // 8 * int(m.group(3) or 1)
            elif m := _LABEL.match(line):
                self.labels[m.group(1)] = len(self.code)
            elif m := re.match(r"(\w+): \.branchtargets (.*);$", line):
                self.tables[m.group(1)] = m.group(2).split(", ")
            elif line == "{":
                end = lines.index("}", i)
                self.code.append((None, "call", lines[i + 1:end]))
                i = end
            elif not line.startswith((".reg", ".pragma")):  # declarations and hints: nothing to run
                guard = None
                if line.startswith("@"):
                    guard, line = line.split(" ", 1)
                    guard = guard[1:]
                op, args = _op_args(line)
                self.code.append((guard, op, args))
            i += 1


def parse(text: str) -> dict[str, Function]:
    """Every .entry and .func body of a (multi-module) PTX text, by name."""
    functions, name, body, depth = {}, None, [], 0
    for raw in text.splitlines():
        line = raw.split("//")[0].strip()
        if line.startswith("{") and line != "{":  # an inline-asm scope (cuda_fp16.h's): its lines run as they are
            line = line[1:].strip()
        if line.endswith(";}"):
            line = line[:-1]
        if not line:
            continue
        if name is None:
            if m := re.match(r"\.visible \.(?:entry|func) (?:\([^)]*\) )?(\w+)\(", line):
                name, body, depth = m.group(1), [], 0
            continue
        if depth == 0 and line != "{":  # the rest of the header: parameter list, .maxntid
            continue
        if line == "{":
            depth += 1
            if depth == 1:
                continue
        elif line == "}":
            depth -= 1
            if depth == 0:
                functions[name] = Function(name, body)
                name = None
                continue
        body.append(line)
    return functions


class _Registers(dict):
    """PTX registers start undefined; reading one before writing is legal (e.g. a value whose predicated
    load was skipped, then stored under the same predicate). Such reads give NaN bits, so any that reached
    an output would show."""

    def __missing__(self, name: str) -> int:
        return 0x7FC07FC0


class Thread:
    def __init__(self, functions: dict[str, Function], headers: dict[str, dict], memory: Memory, tid: int,
                 ctaid: tuple[int, int, int], nctaid: tuple[int, int, int] = (1, 1, 1), ntid: int = 0):
        self.functions, self.headers, self.memory = functions, headers, memory
        self.special = {"%tid.x": tid, "%ctaid.x": ctaid[0], "%ctaid.y": ctaid[1], "%ctaid.z": ctaid[2],
                        "%nctaid.x": nctaid[0], "%nctaid.y": nctaid[1], "%nctaid.z": nctaid[2]}
        if ntid:  # the block's threads (blockDim.x; one-dimensional blocks)
            self.special.update({"%ntid.x": ntid, "%ntid.y": 1, "%ntid.z": 1})
        # cp.async copies in flight: those issued since the last commit_group, then the committed groups, oldest
        # first; each copy (destination, size, data) lands when a wait retires its group
        self.uncommitted: list[tuple[int, int, int]] = []
        self.groups: list[list[tuple[int, int, int]]] = []

    def retire_copies(self, keep: int) -> None:
        """Land every committed group but the newest `keep` (cp.async.wait_group keep)."""
        while len(self.groups) > keep:
            for dst, size, data in self.groups.pop(0):
                self.memory.write(dst, size, data)

    def run(self, name: str, params: dict[str, bytearray]):
        """Execute function `name` with its .param inputs (a generator: it yields at each bar.sync and
        returns the .param space after it, i.e. the results)."""
        fn = self.functions[name]
        self.regs, self.preds, self.params = _Registers(), {}, params
        i, code, steps = 0, fn.code, 0
        while i < len(code):
            steps += 1
            if steps > 2_000_000:
                raise RuntimeError(f"{name} does not terminate")
            guard, op, args = code[i]
            i += 1
            if guard and self.preds[guard.lstrip("!")] == guard.startswith("!"):
                continue
            if op == "call":
                yield from self._call_block(args)
            elif op == "bar.sync":
                yield
            elif op == "bar.warp.sync":  # the warp's lanes meet here, like at a shuffle that moves nothing
                yield ("wsync", 0, 0)
            elif op == "shfl.sync.bfly.b32":  # the warp's lanes meet here: the runner swaps the values
                dst, _, pred = args[0].partition("|")  # d|p: the partner lane is in range (always, full warp)
                self.regs[dst] = yield ("bfly", self._val(args[1]), self._val(args[2]))
                if pred:
                    self.preds[pred] = True
            elif op == "shfl.sync.idx.b32":  # every lane reads lane `b` of its warp
                self.regs[args[0]] = yield ("idx", self._val(args[1]), self._val(args[2]))
            elif op == "shfl.sync.up.b32":  # lane reads lane - b; in range or not in the predicate (d|p)
                dst, _, pred = args[0].partition("|")
                delta = self._val(args[2])
                value = yield ("up", self._val(args[1]), delta)
                lane = self.special["%tid.x"] & 31
                self.regs[dst] = value
                if pred:
                    self.preds[pred] = lane >= delta
            elif op.startswith("ldmatrix.sync.aligned.m8n8"):  # the warp reads 8x8 tiles: lanes give row addresses
                targets = _vector(args[0])
                words = yield ("ldsm", self._address(args[1]), op + str(len(targets)))
                for t, word in zip(targets, words):
                    self.regs[t] = word
            elif op.startswith("mma.sync.aligned.m16n8k16"):  # the warp's fragments meet at the tensor cores
                d, a, b, c = (_vector(x) for x in args)
                out = yield ("mma", tuple(tuple(self._val(x) for x in part) for part in (a, b, c)), op)
                for t, word in zip(d, out):
                    self.regs[t] = word
            elif op == "ret":
                return params
            elif op in ("bra", "bra.uni"):
                i = fn.labels[args[0]]
            elif op == "brx.idx":
                i = fn.labels[fn.tables[args[1]][self._val(args[0])]]
            else:
                self._execute(op, args)
        return params

    def _call_block(self, block: list[str]) -> None:
        frame: dict[str, bytearray] = {}
        after = []
        called = None
        for line in block:
            if m := re.match(r"\.param \.(?:align \d+ )?\.?b(\d+) (\w+)(?:\[(\d+)\])?;", line):
                size = int(m.group(3)) if m.group(3) else int(m.group(1)) // 8
                frame[m.group(2)] = bytearray(size)
            elif line.startswith("call.uni"):
                called = line
            elif called is None:
                self._execute(*_op_args(line), frame)
            else:
                after.append(line)
        m = re.match(r"call\.uni (?:\((\w+)\), )?(\w+), \(([^)]*)\);", called)
        ret, target, names = m.group(1), m.group(2), [a.strip() for a in m.group(3).split(",") if a.strip()]
        saved = (self.regs, self.preds, self.params)
        callee_params = {}
        header = self.headers[target]
        for declared, passed in zip(header["inputs"], names):
            callee_params[declared] = bytearray(frame[passed])
        if ret:
            callee_params[header["output"]] = bytearray(len(frame[ret]))
        result = yield from self.run(target, callee_params)
        self.regs, self.preds, self.params = saved
        if ret:
            frame[ret] = result[header["output"]]
        for line in after:
            self._execute(*_op_args(line), frame)

    # -- values ------------------------------------------------------------------------------------
    def _val(self, token: str) -> int:
        if token in self.special:
            return self.special[token]
        if token.startswith("%") or token in self.regs:  # inline asm names its scoped registers without %
            return self.regs[token]
        if token.startswith("0f"):
            return int(token[2:], 16)
        return int(token, 0) & _MASK[64]

    def _address(self, token: str) -> int:
        """[%reg], [%reg+N], [%reg+-N], or a shared variable by name ([name], [name+N])."""
        m = re.fullmatch(r"\[(%?[\w$]+)(?:\+(-?\d+))?\]", token)
        base = self.special[m.group(1)] if m.group(1) in self.special else self.regs[m.group(1)]
        return base + int(m.group(2) or 0)

    # -- instructions ----------------------------------------------------------------------------
    def _execute(self, op: str, args: list[str], frame: dict | None = None) -> None:
        r, v = self.regs, self._val
        parts = op.split(".")
        head = parts[0]
        if head in ("ld", "st") and parts[1] == "param":
            space = frame if frame is not None else self.params
            m = re.fullmatch(r"\[(\w+)(?:\+(\d+))?\]", args[1] if head == "ld" else args[0])
            buf, offset = space[m.group(1)], int(m.group(2) or 0)
            size = int(parts[-1][1:]) // 8
            if head == "ld":
                r[args[0]] = int.from_bytes(buf[offset:offset + size], "little")
            else:
                buf[offset:offset + size] = (v(args[1]) & _MASK[size * 8]).to_bytes(size, "little")
            return
        if op.startswith(("cp.async.ca.shared.global", "cp.async.cg.shared.global")):
            size = int(args[2])
            dst, src = self._address(args[0]), self._address(args[1])
            _check_aligned(op, dst, size)
            _check_aligned(op, src, size)
            copied = self._val(args[3]) if len(args) > 3 else size  # src-size: the bytes past it are zeros
            assert 0 <= copied <= size, f"{op}: src-size {copied} over the copy's {size}"
            # the source must be inside an array even where nothing is read from it (src-size 0)
            data = self.memory.read(src, copied) if copied else self.memory.read(src, 1) * 0
            self.memory.write(dst, size, (1 << size * 8) - 1)  # poison while in flight
            self.uncommitted.append((dst, size, data))
            return
        if op == "prefetch.global.L2":  # a hint, but only ever of W's own lines: the address must be readable
            self.memory.read(self._address(args[0]), 1)
            return
        if op in ("cp.async.commit_group", "cp.async.wait_all"):  # wait_all commits what is open, then waits
            self.groups.append(self.uncommitted)
            self.uncommitted = []
            if op == "cp.async.wait_all":
                self.retire_copies(0)
            return
        if op.startswith("cp.async.wait_group"):
            self.retire_copies(int(v(args[0])))
            return
        if head == "ld":  # ld.{global[.nc],shared}.{b16,u16,b32,v2.b32,v4.b32}
            size = int(parts[-1][1:]) // 8
            targets = _vector(args[0])
            address = self._address(args[1])
            _check_aligned(op, address, size * len(targets))
            for j, t in enumerate(targets):
                r[t] = self.memory.read(address + j * size, size)
            return
        if head == "st":
            size = int(parts[-1][1:]) // 8
            _check_aligned(op, self._address(args[0]), size * len(_vector(args[1])))
            for j, s in enumerate(_vector(args[1])):
                self.memory.write(self._address(args[0]) + j * size, size, v(s) & _MASK[size * 8])
            return
        if head == "red":
            self._atomic_add(parts[-1], self._address(args[0]), v(args[1]))
            return
        if op == "popc.b32":
            r[args[0]] = bin(v(args[1]) & _MASK[32]).count("1")
            return
        if op == "bfind.u32":
            word = v(args[1]) & _MASK[32]
            r[args[0]] = word.bit_length() - 1 if word else 0xFFFFFFFF
            return
        if op == "popc.b64":
            r[args[0]] = bin(v(args[1]) & _MASK[64]).count("1")
            return
        if op == "bfind.u64":  # the highest set bit's position; 0xFFFFFFFF for 0
            word = v(args[1]) & _MASK[64]
            r[args[0]] = word.bit_length() - 1 if word else 0xFFFFFFFF
            return
        if op == "mov.b64":
            if args[0].startswith("{"):  # unpack a 64-bit value into two 32-bit words (low first)
                lo, hi = _vector(args[0])
                word = v(args[1]) & _MASK[64]
                r[lo], r[hi] = word & _MASK[32], word >> 32
            else:
                r[args[0]] = v(args[1]) & _MASK[64]
            return
        if op == "mov.b16":
            r[args[0]] = v(args[1]) & 0xFFFF
            return
        if op == "cvta.to.global.u64" or op in ("mov.u32", "mov.u64") or (op == "mov.b32" and "{" not in "".join(args)):
            r[args[0]] = v(args[1])
            return
        if op == "mov.b32":
            if args[0].startswith("{"):  # unpack a 32-bit word into two halves (low first)
                lo, hi = _vector(args[0])
                word = v(args[1])
                r[lo], r[hi] = word & 0xFFFF, word >> 16
            else:
                lo, hi = _vector(args[1])
                r[args[0]] = v(lo) | (v(hi) << 16)
            return
        if head in ("setp",):
            cmp, a, b = parts[1], v(args[1]), v(args[2])
            if parts[-1] in ("s32", "s64"):  # two's complement: a negative value compares below zero
                bits = int(parts[-1][1:])
                a, b = (_signed(x & _MASK[bits], bits) for x in (a, b))
            self.preds[args[0]] = {"ge": a >= b, "ne": a != b, "lt": a < b, "eq": a == b, "gt": a > b}[cmp]
            return
        if op == "and.pred":
            self.preds[args[0]] = self.preds[args[1]] and self.preds[args[2]]
            return
        if op == "or.pred":
            self.preds[args[0]] = self.preds[args[1]] or self.preds[args[2]]
            return
        if op == "clz.b32":
            r[args[0]] = 32 - (v(args[1]) & _MASK[32]).bit_length()
            return
        if op == "not.b32":
            r[args[0]] = ~v(args[1]) & _MASK[32]
            return
        if op == "bfi.b32":  # d = b with len bits from position pos replaced by a's low bits
            a, b, pos, length = v(args[1]), v(args[2]), v(args[3]) & 0xFF, v(args[4]) & 0xFF
            field = ((1 << length) - 1) << pos
            r[args[0]] = ((b & ~field) | ((a << pos) & field)) & _MASK[32]
            return
        if op == "membar.gl":  # threads run one at a time here: every store is already visible
            return
        if head == "atom" and parts[-2] == "inc":  # atom.global.inc.u32: d = old; old >= b wraps to 0, else old + 1
            address = self._address(args[1])
            old = r[args[0]] = self.memory.read(address, 4)
            self.memory.write(address, 4, 0 if old >= (v(args[2]) & _MASK[32]) else old + 1)
            return
        if head == "atom" and parts[-2] == "add":  # atom.global.add.{u32,f32}: d = the old value
            address = self._address(args[1])
            r[args[0]] = self.memory.read(address, 4)
            if parts[-1] == "f32":
                self._atomic_add("f32", address, v(args[2]))
            else:
                self.memory.write(address, 4, (self.memory.read(address, 4) + v(args[2])) & _MASK[32])
            return
        if head == "cvt" and all(t[0] in "us" and t[1:].isdigit() for t in parts[1:3]):  # integer widths
            (to, source), value = parts[1:3], v(args[1])
            width = int(source[1:])
            value &= _MASK[width] if width >= 16 else (1 << width) - 1
            if source[0] == "s" and value >> (width - 1):  # sign-extended into the wider type
                value -= 1 << width
            r[args[0]] = value & _MASK[int(to[1:])]
            return
        if op == "cvt.u16.u32":
            r[args[0]] = v(args[1]) & 0xFFFF
            return
        if op in ("selp.u16", "selp.b16", "selp.u32", "selp.b32", "selp.u64", "selp.b64"):
            r[args[0]] = v(args[1]) if self.preds[args[3]] else v(args[2])
            return
        if op == "fma.rn.f32":
            exact = _f32(v(args[1])) * _f32(v(args[2])) + _f32(v(args[3]))
            r[args[0]] = _bits32(exact)
            return
        if op == "add.f32":
            r[args[0]] = _bits32(_f32(v(args[1])) + _f32(v(args[2])))
            return
        if op == "mul.f32":
            r[args[0]] = _bits32(_f32(v(args[1])) * _f32(v(args[2])))
            return
        if op in ("ex2.approx.ftz.f32", "ex2.approx.f32"):  # exact here; the GPU's is within 2 ulp
            x = _f32(v(args[1]))
            with np.errstate(over="ignore"):
                r[args[0]] = _bits32(np.exp2(np.float64(x)))
            return
        if op in ("rcp.approx.ftz.f32", "rcp.approx.f32"):
            x = np.float64(_f32(v(args[1])))
            with np.errstate(divide="ignore"):
                r[args[0]] = _bits32(np.float64(1.0) / x)
            return
        if op == "mov.f32":
            r[args[0]] = v(args[1])
            return
        if op == "bfe.u32":
            r[args[0]] = (v(args[1]) >> v(args[2])) & ((1 << v(args[3])) - 1)
            return
        if op == "prmt.b32":  # default mode: selector nibbles pick bytes of {b, a}
            pool = (v(args[1]) | (v(args[2]) << 32)).to_bytes(8, "little")
            sel = v(args[3])
            r[args[0]] = int.from_bytes(bytes(pool[(sel >> (4 * i)) & 7] for i in range(4)), "little")
            return
        if op == "max.NaN.f32":  # NaN if either operand is NaN (plain max.f32 would drop it)
            a, b = _f32(v(args[1])), _f32(v(args[2]))
            r[args[0]] = _bits32(a if a != a else b if b != b else max(a, b))
            return
        if op in ("cvt.f32.f16", "cvt.f32.bf16"):  # a b16 register (undefined: NaN bits)
            r[args[0]] = _bits32(_half(v(args[1]) & 0xFFFF, op.endswith("bf16")))
            return
        if op == "cvt.u32.u16" or op == "cvt.u64.u32":
            r[args[0]] = v(args[1])
            return
        if op in ("cvt.rn.f16.f32", "cvt.rn.bf16.f32"):
            r[args[0]] = _to_half(_f32(v(args[1])), "bf16" in op)
            return
        bits = 64 if parts[-1] in ("u64", "s64", "b64") or "wide" in parts else 32
        a = [v(x) for x in args[1:]]
        result = {"shr": lambda: a[0] >> a[1], "shl": lambda: a[0] << a[1], "and": lambda: a[0] & a[1],
                  "add": lambda: a[0] + a[1], "sub": lambda: a[0] - a[1], "xor": lambda: a[0] ^ a[1], "or": lambda: a[0] | a[1],
                  "div": lambda: a[0] // a[1], "rem": lambda: a[0] % a[1], "min": lambda: min(a), "mul": lambda: a[0] * a[1],
                  "mad": lambda: a[0] * a[1] + a[2], "max": lambda: max(a)}[head]()
        r[args[0]] = result & _MASK[bits]

    def _atomic_add(self, kind: str, address: int, value: int) -> None:
        mem = self.memory
        if kind == "f32":
            mem.write(address, 4, _bits32(_f32(mem.read(address, 4)) + _f32(value)))
            return
        bf16 = kind.startswith("bf16")
        lanes = 2 if kind.endswith("x2") else 1
        for j in range(lanes):
            old = _half(mem.read(address + 2 * j, 2), bf16)
            mem.write(address + 2 * j, 2, _to_half(old + _half((value >> (16 * j)) & 0xFFFF, bf16), bf16))


def _check_aligned(op: str, address: int, size: int) -> None:
    """A load or store of `size` bytes (the whole vector) must be aligned to it, as on the hardware."""
    if address % size:
        raise RuntimeError(f"misaligned {op}: address {address:#x} is not a multiple of {size}")


def _split_args(rest: str) -> list[str]:
    out, depth, current = [], 0, ""
    for ch in rest:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        out.append(current.strip())
    return out


def _op_args(line: str) -> tuple[str, list[str]]:
    op, _, rest = line.rstrip(";").partition(" ")
    return op, _split_args(rest)


def _vector(token: str) -> list[str]:
    return [t.strip() for t in token.strip("{}").split(",")] if token.startswith("{") else [token]


def _headers(text: str) -> dict[str, dict]:
    """Each .func's input parameter names in order, and its return parameter's name."""
    found = {}
    for m in re.finditer(r"\.visible \.func (?:\(\.param [^)]*? (\w+)\[\d+\]\) )?(\w+)\(([^)]*)\)", text):
        inputs = [p.split()[-1].split("[")[0] for p in m.group(3).split(",") if p.strip()]
        found[m.group(2)] = {"inputs": inputs, "output": m.group(1)}
    return found


def launch(text: str, entry: str, grid: tuple[int, int, int], threads: int, *args, shared_bytes: int = 0) -> None:
    """Run kernel `entry` of `text` over the grid. args, in the entry's parameter order: numpy arrays
    (placed in global memory, written in place; None for a null pointer) or integers. shared_bytes: the
    launch's dynamic shared memory, the size of the module's `.extern .shared` array (which must have one)."""
    functions, memory, headers = parse(text), Memory(), _headers(text)
    shared = re.search(r"\.shared \.align \d+ \.b8 (\w+)\[(\d+)\];", text)
    dynamic = re.search(r"\.extern \.shared \.align \d+ \.b8 (\w+)\[\];", text)
    if bool(dynamic) != bool(shared_bytes):
        raise ValueError(f"the module {'declares' if dynamic else 'has no'} dynamic shared memory, launched with "
                         f"shared_bytes={shared_bytes}")
    declared = re.search(rf"\.visible \.entry {entry}\(([^)]*)\)", text).group(1)
    params = {}
    for decl, value in zip(re.findall(r"\.param \.[ub](\d+) (\w+)", declared), args, strict=True):
        size, name = int(decl[0]) // 8, decl[1]
        number = memory.place(value) if isinstance(value, np.ndarray) else int(value or 0)
        params[name] = number.to_bytes(size, "little")
    # blocks one after another, the last first: a GPU runs them in any order (a K split's last arrival is then
    # not its last block)
    for z in reversed(range(grid[2])):
        for y in reversed(range(grid[1])):
            for x in reversed(range(grid[0])):
                symbols = {}
                if shared:  # each block its own shared memory, poisoned so unstaged reads show
                    symbols[shared.group(1)] = memory.place(np.full(int(shared.group(2)), 0xFF, np.uint8))
                if dynamic:
                    symbols[dynamic.group(1)] = memory.place(np.full(shared_bytes, 0xFF, np.uint8))
                for function in functions.values():  # static shared variables of function bodies, per block
                    for name, size in function.shared.items():
                        symbols[name] = memory.place(np.full(size, 0xFF, np.uint8))
                block = []
                for tid in range(threads):
                    thread = Thread(functions, headers, memory, tid, (x, y, z), grid, threads)
                    thread.special.update(symbols)
                    block.append(thread.run(entry, {k: bytearray(val) for k, val in params.items()}))
                _run_block(block, memory, reverse=(x + y + z) % 2 == 1)


def _run_block(block: list, memory: Memory, reverse: bool = False) -> None:
    """One warp at a time runs until each of its threads waits at bar.sync or has exited, its lanes in turns up
    to their next warp shuffle; then the next warp (the lowest first, or with `reverse` the highest; the order
    turns at every barrier, so even a one-block grid has each end of the block run ahead). So a warp runs as far
    ahead of the others as barriers let it, which is how a missing barrier shows. A thread at
    bar.sync waits until every live thread of the block is there (threads that exited count as arrived, as on
    sm_70+). At a shuffle every live lane of the warp must be at the same shuffle (its kind and operand), as
    shfl.sync with a full mask requires, and the partner lane must be there too."""
    live, replies, waiting = dict(enumerate(block)), {}, set()
    while live:
        running = [tid >> 5 for tid in live if tid not in waiting]
        warp_now = (max if reverse else min)(running) if running else None
        stops = {}
        for tid, thread in live.items():
            if tid in waiting or tid >> 5 != warp_now:
                continue
            try:
                stops[tid] = thread.send(replies.get(tid))
            except StopIteration:
                stops[tid] = "exit"
        replies = {}
        for tid in [t for t, stop in stops.items() if stop == "exit"]:
            del live[tid], stops[tid]
        waiting |= {tid for tid, stop in stops.items() if stop is None}
        stops = {tid: stop for tid, stop in stops.items() if stop is not None}
        if waiting and waiting >= set(live):
            waiting = set()  # everyone arrived: the barrier opens
            reverse = not reverse  # the other end's warp runs ahead to the next barrier
        warps: dict[int, set] = {}
        for tid, stop in stops.items():
            warps.setdefault(tid >> 5, set()).add((stop[0], stop[2]))
        for warp, kinds in warps.items():
            lanes = [t for t in live if t >> 5 == warp and t not in waiting]
            if len(kinds) > 1 or any(t not in stops for t in lanes):
                raise RuntimeError(f"warp {warp}: its lanes are not all at one shuffle ({sorted(kinds)}; "
                                   f"{sum(t in stops for t in lanes)} of {len(lanes)} live lanes there)")
        for warp, kinds in warps.items():
            kind, op = next(iter(kinds))
            if kind in _COLLECTIVE:  # every lane's reply depends on all 32 lanes' operands
                lanes = {tid & 31: stop[1] for tid, stop in stops.items() if tid >> 5 == warp}
                if len(lanes) != 32:
                    raise RuntimeError(f"warp {warp}: {op} needs all 32 lanes, {len(lanes)} are there")
                for lane, reply in _COLLECTIVE[kind](op, lanes, memory).items():
                    replies[(warp << 5) | lane] = reply
        for tid, stop in stops.items():  # butterfly (lane ^ offset), indexed (lane b), up (lane - b)
            if stop[0] in _COLLECTIVE:
                continue
            partner = {"bfly": lambda: tid ^ stop[2], "idx": lambda: (tid & ~31) | (stop[2] & 31), "wsync": lambda: tid,
                       "up": lambda: tid - stop[2] if (tid & 31) >= stop[2] else tid}[stop[0]]()
            if partner not in stops:
                raise RuntimeError(f"lane {tid} shuffles with {partner}, which is not at the shuffle")
            replies[tid] = stops[partner][1]


def _ldmatrix(op: str, addresses: dict[int, int], memory: Memory) -> dict[int, tuple[int, ...]]:
    """ldmatrix .x1/.x2/.x4 (b16, no .trans): matrix i's 8 rows of 16 bytes start at the addresses of lanes
    8 i .. 8 i + 7; lane l receives, of each matrix, the word holding row l // 4, elements 2 (l % 4) and
    2 (l % 4) + 1."""
    count = int(op[-1])
    if ".trans" in op:
        raise NotImplementedError("ldmatrix .trans")
    for lane in range(8 * count):
        if addresses[lane] % 16:
            raise RuntimeError(f"misaligned {op}: row address {addresses[lane]:#x} of lane {lane}")
    return {lane: tuple(memory.read(addresses[8 * i + lane // 4] + 4 * (lane % 4), 4) for i in range(count))
            for lane in range(32)}


def _mma(op: str, fragments: dict[int, tuple], memory: Memory) -> dict[int, tuple[int, ...]]:
    """mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: D = A B + C, A 16 x 16, B 16 x 8, fp32 C and D. Lane l
    (g = l // 4, t = l % 4) holds A[g][2t..], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..] (pairs), B[2t..][g],
    B[2t+8..][g] and C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]. The products are exact in float64, the sum
    rounded once to fp32 (the hardware's own accumulation order differs in the last bits)."""
    if ".row.col.f32." not in op or not op.endswith(".f32"):
        raise NotImplementedError(op)
    bf16 = ".bf16." in op
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane, (a, b, c) in fragments.items():
        g, t = divmod(lane, 4)
        for reg, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[row, col], A[row, col + 1] = _half(a[reg] & 0xFFFF, bf16), _half(a[reg] >> 16 & 0xFFFF, bf16)
        for reg, k in enumerate((2 * t, 2 * t + 8)):
            B[k, g], B[k + 1, g] = _half(b[reg] & 0xFFFF, bf16), _half(b[reg] >> 16 & 0xFFFF, bf16)
        C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1] = (_f32(x) for x in c)
    with np.errstate(invalid="ignore", over="ignore"):
        D = A @ B + C
    out = {}
    for lane in range(32):
        g, t = divmod(lane, 4)
        out[lane] = tuple(_bits32(D[row, col]) for row, col in ((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)))
    return out


_COLLECTIVE = {"ldsm": _ldmatrix, "mma": _mma}
