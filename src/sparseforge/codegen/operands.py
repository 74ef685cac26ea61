"""Where the dense operand's value for (k, this thread's columns) lives: the only part of the lowering that
knows the memory layout. An implicit-im2col convolution changes this mapping and nothing else.

kn (B is K x N): direct coalesced loads at k*N*es from the lane's base (DirectKN). nk (X is N x K, lanes
are tokens): X is staged through shared memory, one chunk of K at a time, transposed so that a lane reads
its token's value at a constant offset (StagedNK). A convolution (plan/conv.py ConvTilePlan): lanes are
output pixels over a zero-bordered input, each nonzero at a constant offset from the pixel's window
(BorderedConvInput). Measured alternatives are in docs/history.md.
"""
from __future__ import annotations

from ..plan import Plan
from ..plan.conv import ConvTilePlan

_REGION = 1 << 31  # PTX address immediates are signed 32-bit: farther offsets get their own base register
STAGE_BYTES = 48 * 1024
MAX_IN_FLIGHT = 16  # staging loads issued before their stores, per thread


class RegionBases:
    """Base registers spaced 2**31 bytes apart, so any constant offset fits a PTX immediate."""

    def __init__(self, name: str, offsets: list[int]):
        self.name = name
        # every region up to the farthest offset: an address may fall in any of them
        self.regions = list(range(max((off // _REGION for off in offsets), default=0) + 1))

    def emit(self, e, base_lines: list[str]) -> None:
        e.lines(base_lines)
        for r in self.regions:
            if r:
                e.line(f"add.s64 %{self.name}{r}, %{self.name}0, {r * _REGION};")

    def address(self, offset: int) -> str:
        r = offset // _REGION
        rest = offset - r * _REGION
        return f"[%{self.name}{r}+{rest}]" if rest else f"[%{self.name}{r}]"

    @property
    def registers(self) -> list[str]:
        return [f"%{self.name}{r}" for r in self.regions]


def _widest(nbytes: int, limit: int = 16) -> int:
    for width in (16, 8, 4, 2):
        if width <= limit and nbytes % width == 0:
            return width
    return 1


class _Staged:
    """Common to both layouts: chunks of K, the stage buffer, a lane's base and the per-k offset."""

    space = "shared"

    def __init__(self, plan: Plan, row_elems: int):
        self.plan = plan
        self.row_bytes = row_elems * plan.element_bytes          # one k of the staged tile
        width = max(1, STAGE_BYTES // self.row_bytes)
        width = width - width % 16 if width >= 16 else width  # chunk edges stay on whole copy pieces
        self.chunk_width = min(plan.K, width)
        self.stage_bytes = self.chunk_width * self.row_bytes

    def chunks(self) -> list[tuple[int, int]]:
        k, w = self.plan.K, self.chunk_width
        return [(k0, min(k0 + w, k)) for k0 in range(0, k, w)]

    def address(self, k: int) -> str:
        offset = (k % self.chunk_width) * self.row_bytes
        return f"[%rs0+{offset}]" if offset else "[%rs0]"

    def section_prologue(self, e) -> None:
        e.line("ld.param.b32 %rs0, [p_s];")



class DirectKN:
    """B is [batch,] K x N row-major: a warp's 32 lanes read 32*vec consecutive columns of row k, a coalesced
    load at the constant offset k*N*es from the lane's base. No staging: the warps of a block sit side by
    side over columns and run the same group's code together, so each instruction fetched serves them all
    (with warps of different groups per block, instruction-cache misses made a 100k-nonzero kernel run at
    0.07 instructions per clock, measured on the H200)."""

    space = "global.nc"
    staged = False
    stage_bytes = 0

    def __init__(self, plan: Plan):
        self.plan = plan
        self.row_bytes = plan.N * plan.element_bytes
        self.bases = RegionBases("rdb", [plan.K * self.row_bytes])
        self.global_bases = RegionBases("rdg", [])

    def chunks(self) -> list[tuple[int, int]]:
        k, w = self.plan.K, self.plan.config.chunk_k or self.plan.K
        return [(k0, min(k0 + w, k)) for k0 in range(0, k, w)]

    def prologue(self, e) -> None:
        p = self.plan
        e.comment(f"B base: B + (batch*K*N + n) * {p.element_bytes}")
        e.lines([f"mul.lo.u64 %rdt0, %rdz, {p.K * p.N};", "cvt.u64.u32 %rdt1, %rn;", "add.u64 %rdt0, %rdt0, %rdt1;",
                 f"mad.lo.u64 %rdb, %rdt0, {p.element_bytes}, %rdB;"])

    def section_prologue(self, e) -> None:
        self.bases.emit(e, ["ld.param.u64 %rdb0, [p_b];"])

    def stage(self, e, k0: int, k1: int) -> None:
        return None

    def address(self, k: int) -> str:
        return self.bases.address(k * self.row_bytes)


class BorderedConvInput(DirectKN):
    """The convolution's input with a zero border, [batch,] Cin x Hp x Wp (plan/conv.py ConvTilePlan): the
    lane's column n is output pixel (oh, ow) = divmod(n, OW), its base the window's corner (oh*sh)*Wp +
    ow*sw, and column k of W (channel, tap) sits at the constant plan.input_offset(k) from it: one load at
    an immediate offset per nonzero, no masks (padding reads the border's zeros). The warp's 32 pixels are
    consecutive along output rows, so its loads are coalesced like DirectKN's (a stride of 2 spreads them
    over twice the bytes); chunks and sections as DirectKN's."""

    def __init__(self, plan: ConvTilePlan):
        self.plan = plan
        self.bases = RegionBases("rdb", [plan.operand_offset(k) * plan.element_bytes for k in range(plan.K)])
        self.global_bases = RegionBases("rdg", [])

    def prologue(self, e) -> None:
        p, g = self.plan, self.plan.geometry
        plane = p.plane * p.shifts  # one image's copies (plan.shifts: shifted by 0..shifts-1 elements)
        e.comment(f"input base: xp + (batch*{plane} + (oh*{g.stride[0]})*{g.bordered_width} + ow*{g.stride[1]}) * "
                  f"{p.element_bytes}, (oh, ow) = divmod(n, {g.out_width})")
        e.lines([f"div.u32 %rt1, %rn, {g.out_width};", f"rem.u32 %rt3, %rn, {g.out_width};",
                 f"mul.lo.u32 %rt1, %rt1, {g.stride[0] * g.bordered_width};",
                 f"mad.lo.u32 %rt1, %rt3, {g.stride[1]}, %rt1;", "cvt.u64.u32 %rdt1, %rt1;",
                 f"mul.lo.u64 %rdt0, %rdz, {plane};", "add.u64 %rdt0, %rdt0, %rdt1;",
                 f"mad.lo.u64 %rdb, %rdt0, {p.element_bytes}, %rdB;"])

    def address(self, k: int) -> str:
        return self.bases.address(self.plan.operand_offset(k) * self.plan.element_bytes)


class StagedNK(_Staged):
    staged = True

    """X is [batch,] N x K row-major (tokens x features): lanes are tokens. Warp w copies K-pieces
    w, w+W, ... of its lane's token row (contiguous along k) and writes them transposed, stage[k][token],
    rows padded to 33 elements so the transposed stores do not collide in one bank."""

    PAD = 1

    def __init__(self, plan: Plan):
        super().__init__(plan, 32 + self.PAD)
        es = plan.element_bytes
        self.width = _widest(plan.K * es, 16)
        self.elems = self.width // es
        self.global_bases = RegionBases("rdg", [plan.N * plan.K * es])

    def prologue(self, e) -> None:
        p, es = self.plan, self.plan.element_bytes
        e.comment("staging: lane = token row of X; warp w copies k-pieces w, w + warps, ...")
        e.lines([
            f"mul.lo.u64 %rdt0, %rdz, {p.N * p.K};", f"mad.wide.u32 %rdt0, %rn, {p.K}, %rdt0;",
            f"mul.wide.u32 %rdt1, %rwarp, {self.elems};", "add.u64 %rdt0, %rdt0, %rdt1;",
        ])
        self.global_bases.emit(e, [f"mad.lo.u64 %rdg0, %rdt0, {es}, %rdB;"])
        e.lines(["mov.u32 %rsb, stage;", f"mad.lo.u32 %rs0, %rlane, {es}, %rsb;",
                 f"mul.lo.u32 %rt1, %rwarp, {self.elems * self.row_bytes};", "add.u32 %rsw, %rs0, %rt1;"])

    def stage(self, e, k0: int, k1: int) -> None:
        warps = self.plan.config.warps_per_block
        kind, regs = {16: ("v4.b32", 4), 8: ("v2.b32", 2), 4: ("b32", 1), 2: ("b16", 1)}[self.width]
        e.comment(f"stage X[n0:n0+32, {k0}:{k1}] transposed into shared memory")
        e.line("bar.sync 0;")
        pieces = (k1 - k0 + self.elems - 1) // self.elems
        passes = (pieces + warps - 1) // warps
        for start in range(0, passes, MAX_IN_FLIGHT):
            self._stage_batch(e, list(range(start, min(passes, start + MAX_IN_FLIGHT))), k0, k1, kind, regs)
        e.line("bar.sync 0;")

    def _stage_batch(self, e, passes: list[int], k0: int, k1: int, kind: str, regs: int) -> None:
        es, warps = self.plan.element_bytes, self.plan.config.warps_per_block
        names = []
        for i, j in enumerate(passes):
            first = j * warps * self.elems
            e.lines([f"setp.lt.u32 %prow, %rwarp, {(k1 - k0 - first + self.elems - 1) // self.elems};",
                     f"and.pred %pk{i}, %prow, %ptok;"])
            e.max_index["pk"] = max(e.max_index.get("pk", -1), i)
            vals = [f"%rc{i * regs + r}" for r in range(regs)]
            e.max_index["rc"] = max(e.max_index.get("rc", -1), (i + 1) * regs - 1)
            if es == 2 and regs == 1 and kind == "b16":
                vals = [f"%rh{i}"]
                e.max_index["rh"] = max(e.max_index.get("rh", -1), i)
            target = vals[0] if len(vals) == 1 else "{" + ", ".join(vals) + "}"
            e.line(f"@%pk{i} ld.global.nc.{kind} {target}, {self.global_bases.address((k0 + first) * es)};")
            names.append((i, j, vals))
        for i, j, vals in names:
            first = j * warps * self.elems
            for elem in range(self.elems):
                offset = (first + elem) * self.row_bytes
                e.line(f"@%pk{i} st.shared.{'b32' if es == 4 else 'b16'} [%rsw+{offset}], "
                       f"{self._element(e, vals, elem, i)};")

    def _element(self, e, vals: list[str], elem: int, i: int) -> str:
        """Register holding element `elem` of a loaded piece (16-bit values are split out of words)."""
        if self.plan.element_bytes == 4:
            return vals[elem]
        if len(vals) == 1 and vals[0].startswith("%rh"):
            return vals[0]
        word = vals[elem // 2]
        index = i * 8 + elem
        e.max_index["rx"] = max(e.max_index.get("rx", -1), index)
        e.line(f"{'shr.u32 %rt3, ' + word + ', 16;' if elem % 2 else 'mov.b32 %rt3, ' + word + ';'}")
        e.line(f"cvt.u16.u32 %rx{index}, %rt3;")
        return f"%rx{index}"


def operand_for(plan: Plan):
    if plan.bordered:
        return BorderedConvInput(plan)
    return DirectKN(plan) if plan.direct else StagedNK(plan)
