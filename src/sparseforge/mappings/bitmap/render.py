"""Lowering target: the bitmap decode kernel (plan.py). Pure: render_bitmap(plan) -> PTX.

Parameters: x (kn: [batch,] K x 1; nk: [batch,] 1 x K: the same vector), C ([batch,] M x 1 or 1 x M),
values (the kernel's dtype), masks (uint32 [M, words, 32]), row_starts (int32 [M]), bias (fp32, or null),
then the residual where the plan adds one.

Shared memory: x (K values, staged once per block by every thread with 16-byte loads), then one value
buffer per warp (the largest block: 1024 values). Per row a warp loads its lanes' mask words (one
coalesced 128-byte load a word), and per word t:
1. scans the lanes' bit counts by shuffle: a lane's first value in the block, and the block's size;
2. copies the block from global memory into its buffer (16-byte loads, lanes side by side), between two
   warp barriers (the previous word's walk has finished reading the buffer; the copy is complete). The
   loads are issued a word ahead (two register sets): word t + 1's block, and at the last word the next
   row's masks, are in flight while word t is walked;
3. each lane walks its word's set bits from the highest (bfind, clear): bit b is column 1024 t + 32 b +
   lane, whose x sits in shared bank `lane` for every b (no conflicts), and its value is the lane's next one
   in the buffer. `unroll` bits an iteration, each predicated on the word still holding a bit.
Sums are fp32; a fixed-order butterfly adds the lanes; lane 0 adds bias and the residual, applies ReLU
(max.NaN) and stores.
"""
from __future__ import annotations

from .plan import VALUE_ALIGN, WORD_COLUMNS, BitmapPlan
from ...plan.config import WARP
from ...codegen.emitter import Emitter, widen
from ...codegen.ptx import KernelSource, data_kernel

CHUNK = 16          # bytes of one copy load
STAGE_BATCH = 4     # staging loads a thread issues before their stores


def _stage_x(e: Emitter, plan: BitmapPlan) -> None:
    """Every thread copies pieces tid, tid + threads, ... of x into shared memory: 16-byte pieces where
    K es allows (each batch entry's x then starts 16-byte aligned too), else the widest that divides it."""
    es, threads = plan.element_bytes, plan.config.threads
    width = next(w for w in (16, 8, 4, 2) if (plan.K * es) % w == 0)
    kind, regs = {16: ("v4.b32", 4), 8: ("v2.b32", 2), 4: ("b32", 1), 2: ("b16", 1)}[width]
    pieces = plan.K * es // width
    passes = -(-pieces // threads)
    e.comment(f"stage x: {pieces} pieces of {width} bytes over {threads} threads")
    e.lines([f"mul.wide.u32 %rdt, %rtid, {width};", "add.s64 %rdq, %rdb, %rdt;",
             f"mad.lo.u32 %rsq, %rtid, {width}, %rsx;"])
    for start in range(0, passes, STAGE_BATCH):
        batch = range(start, min(passes, start + STAGE_BATCH))
        for i in batch:
            j = i % STAGE_BATCH
            target = "%hx" if width == 2 else _regs("%st", j, regs)
            e.lines([f"add.u32 %t, %rtid, {i * threads};", f"setp.lt.u32 %ps{j}, %t, {pieces};",
                     f"@%ps{j} ld.global.nc.{kind} {target}, [%rdq+{i * threads * width}];"])
            if width == 2:  # one 16-bit register: store before the next load
                e.line(f"@%ps{j} st.shared.b16 [%rsq+{i * threads * width}], %hx;")
        if width == 2:
            continue
        for i in batch:
            j = i % STAGE_BATCH
            e.line(f"@%ps{j} st.shared.{kind} [%rsq+{i * threads * width}], {_regs('%st', j, regs)};")
    e.line("bar.sync 0;")


def _regs(prefix: str, i: int, count: int) -> str:
    names = [f"{prefix}{4 * i + j}" for j in range(count)]
    return names[0] if count == 1 else "{" + ", ".join(names) + "}"


def _quad(prefix: str, i: int) -> str:
    return ", ".join(f"{prefix}{4 * i + j}" for j in range(4))


def _copies(plan: BitmapPlan) -> int:
    """A lane's 16-byte chunks of the largest block (every bit of a word set)."""
    return WORD_COLUMNS * plan.element_bytes // CHUNK // WARP


def _scan_and_fetch(e: Emitter, plan: BitmapPlan, t: int) -> None:
    """Word t: scan the lanes' bit counts (a lane's first value %off{set} in the block, the padded block size)
    and issue the block's loads into register set t % 2, so they are in flight while word t - 1 is walked."""
    es, p = plan.element_bytes, t % 2
    e.comment(f"word {t} (columns {t * WORD_COLUMNS}..{(t + 1) * WORD_COLUMNS - 1}): scan, fetch its values")
    e.lines([f"popc.b32 %cnt, %w{t};", "mov.u32 %incl, %cnt;"])
    offset = 1
    while offset < WARP:
        e.lines([f"shfl.sync.up.b32 %t|%pu, %incl, {offset}, 0, -1;", "@%pu add.u32 %incl, %incl, %t;"])
        offset *= 2
    e.lines(["shfl.sync.idx.b32 %total, %incl, 31, 31, -1;", f"sub.u32 %off{p}, %incl, %cnt;",
             f"add.u32 %total, %total, {VALUE_ALIGN - 1};", f"and.b32 %total, %total, {-VALUE_ALIGN};",
             f"shr.u32 %nch, %total, {(CHUNK // es).bit_length() - 1};",  # 16-byte chunks of the block
             f"mul.wide.u32 %rdt, %vstart, {es};", "add.s64 %rdt, %rdv, %rdt;", "mad.wide.u32 %rdt, %lane, 16, %rdt;",
             "add.u32 %vstart, %vstart, %total;"])
    for i in range(_copies(plan)):
        e.lines([f"add.u32 %t, %lane, {i * WARP};", f"setp.lt.u32 %pc{p}_{i}, %t, %nch;",
                 f"@%pc{p}_{i} ld.global.nc.v4.b32 {{{_quad(f'%cp{p}_', i)}}}, [%rdt+{i * WARP * CHUNK}];"])


def _store_block(e: Emitter, plan: BitmapPlan, t: int) -> None:
    """Word t's values into the warp's buffer, between two warp barriers: every lane has finished walking
    word t - 1 before the buffer is overwritten, and the whole block is there before any lane reads it."""
    p = t % 2
    e.line("bar.warp.sync -1;")
    for i in range(_copies(plan)):
        e.line(f"@%pc{p}_{i} st.shared.v4.b32 [%rbl+{i * WARP * CHUNK}], {{{_quad(f'%cp{p}_', i)}}};")
    e.line("bar.warp.sync -1;")


def _walk(e: Emitter, plan: BitmapPlan, t: int) -> None:
    """The lane's set bits of word t, highest first, `unroll` an iteration."""
    es, u = plan.element_bytes, plan.config.unroll
    e.lines([f"mad.lo.u32 %rva, %off{t % 2}, {es}, %rbuf;", f"mov.u32 %wk, %w{t};"])
    e.label(f"WALK{t}")
    e.lines(["setp.eq.u32 %pt, %wk, 0;", f"@%pt bra WALKED{t};"])
    for i in range(u):
        guard = "" if i == 0 else f"@%pb{i} "
        if i:
            e.line(f"setp.ne.u32 %pb{i}, %wk, 0;")
        e.lines([f"{guard}bfind.u32 %bit{i}, %wk;", f"{guard}shl.b32 %t, 1, %bit{i};", f"{guard}xor.b32 %wk, %wk, %t;",
                 f"mad.lo.u32 %rxa{i}, %bit{i}, {WARP * es}, %rxw;"])
        if es == 4:
            e.lines([f"{guard}ld.shared.b32 %xf{i}, [%rxa{i}];", f"{guard}ld.shared.b32 %vf{i}, [%rva+{i * es}];"])
        else:
            e.lines([f"{guard}ld.shared.b16 %xh{i}, [%rxa{i}];", f"{guard}ld.shared.b16 %vh{i}, [%rva+{i * es}];"])
    for i in range(u):
        guard = "" if i == 0 else f"@%pb{i} "
        if es == 2:
            widen(e, plan.dtype, f"%xf{i}", f"%xh{i}")
            widen(e, plan.dtype, f"%vf{i}", f"%vh{i}")
        e.line(f"{guard}fma.rn.f32 %acc, %vf{i}, %xf{i}, %acc;")
    e.lines([f"add.u32 %rva, %rva, {u * es};", f"bra WALK{t};"])
    e.label(f"WALKED{t}")
    e.line(f"add.u32 %rxw, %rxw, {WORD_COLUMNS * es};")


def _fetch_masks(e: Emitter, plan: BitmapPlan, row: str, guard: str = "") -> None:
    """A row's mask words (one coalesced 128-byte load a word) and its first value's index, into %wn / %vn."""
    e.lines([f"mad.lo.u32 %t, {row}, {plan.words * WARP}, %lane;", "mad.wide.u32 %rdt, %t, 4, %rdm;"])
    for t in range(plan.words):
        e.line(f"{guard}ld.global.nc.u32 %wn{t}, [%rdt+{t * WARP * 4}];" if t else f"{guard}ld.global.nc.u32 %wn{t}, [%rdt];")
    e.lines([f"mad.wide.u32 %rdt, {row}, 4, %rdr;", f"{guard}ld.global.nc.u32 %vn, [%rdt];"])


def _epilogue(e: Emitter, plan: BitmapPlan) -> None:
    es = plan.element_bytes
    e.comment("butterfly over the warp: a fixed order of additions, the same result every run")
    offset = WARP // 2
    while offset:
        e.lines([f"shfl.sync.bfly.b32 %f, %acc, {offset}, 31, -1;", "add.f32 %acc, %acc, %f;"])
        offset //= 2
    e.lines(["setp.ne.u32 %pt, %lane, 0;", "@%pt bra STORED;"])
    if plan.bias is not None:
        e.lines(["ld.param.u64 %rdt, [p_bias];", "cvta.to.global.u64 %rdt, %rdt;",
                 "mad.wide.u32 %rdt, %row, 4, %rdt;", "ld.global.nc.b32 %f, [%rdt];", "add.f32 %acc, %acc, %f;"])
    # C[row] of this batch entry (kn: M x 1; nk: 1 x M: the same address); the residual's alike
    e.lines([f"mul.lo.u64 %rdt, %rdz, {plan.M * es};", f"mad.wide.u32 %rdt, %row, {es}, %rdt;"])
    if plan.residual:
        e.lines(["ld.param.u64 %rdc, [p_residual];", "cvta.to.global.u64 %rdc, %rdc;", "add.s64 %rdc, %rdc, %rdt;"])
        if es == 4:
            e.line("ld.global.nc.b32 %f, [%rdc];")
        else:
            e.line("ld.global.nc.b16 %hx, [%rdc];")
            widen(e, plan.dtype, "%f", "%hx")
        e.line("add.f32 %acc, %acc, %f;")
    if plan.relu:
        e.line("max.NaN.f32 %acc, %acc, 0f00000000;")
    e.lines(["ld.param.u64 %rdc, [p_c];", "cvta.to.global.u64 %rdc, %rdc;", "add.s64 %rdc, %rdc, %rdt;"])
    if es == 4:
        e.line("st.global.b32 [%rdc], %acc;")
    else:
        cvt = "cvt.rn.bf16.f32" if plan.dtype == "bfloat16" else "cvt.rn.f16.f32"
        e.lines([f"{cvt} %hx, %acc;", "st.global.b16 [%rdc], %hx;"])
    e.label("STORED")


def render_bitmap(plan: BitmapPlan) -> KernelSource:
    c, es, words = plan.config, plan.element_bytes, plan.words
    u = c.unroll
    e = Emitter()
    e.comment(f"lane l owns columns 32 j + l; {c.warps_per_block} warps a block, {c.rows_per_warp} rows a warp, "
              f"{words} mask words a lane, {u} set bits per iteration")
    e.lines(["mov.u32 %rtid, %tid.x;", "and.b32 %lane, %rtid, 31;", "shr.u32 %warp, %rtid, 5;",
             "mov.u32 %t, %ctaid.z;", "cvt.u64.u32 %rdz, %t;",
             "ld.param.u64 %rdb, [p_b];", "cvta.to.global.u64 %rdb, %rdb;",
             f"mul.lo.u64 %rdt, %rdz, {plan.K * es};", "add.s64 %rdb, %rdb, %rdt;", "mov.u32 %rsx, smem;"])
    _stage_x(e, plan)
    e.comment("this warp's rows, its value buffer, its lane's x column")
    e.lines(["mov.u32 %t, %ctaid.y;", f"mad.lo.u32 %t, %t, {c.warps_per_block}, %warp;",
             f"mul.lo.u32 %row, %t, {c.rows_per_warp};", f"add.u32 %rowend, %row, {c.rows_per_warp};",
             f"mad.lo.u32 %rbuf, %warp, {plan.buffer_bytes}, %rsx;", f"add.u32 %rbuf, %rbuf, {plan.x_bytes};",
             "mad.lo.u32 %rbl, %lane, 16, %rbuf;",
             "ld.param.u64 %rdm, [p_masks];", "cvta.to.global.u64 %rdm, %rdm;",
             "ld.param.u64 %rdv, [p_values];", "cvta.to.global.u64 %rdv, %rdv;",
             "ld.param.u64 %rdr, [p_row_starts];", "cvta.to.global.u64 %rdr, %rdr;"])
    e.line(f"setp.lt.u32 %pn, %row, {plan.M};")
    _fetch_masks(e, plan, "%row", "@%pn ")
    e.label("ROW")
    e.lines([f"setp.ge.u32 %pt, %row, {plan.M};", "@%pt bra DONE;",  # rows ascend: the whole warp is done
             "setp.ge.u32 %pt, %row, %rowend;", "@%pt bra DONE;"])
    e.lines([f"mov.u32 %w{t}, %wn{t};" for t in range(words)] + ["mov.u32 %vstart, %vn;"])
    e.lines(["mov.f32 %acc, 0f00000000;", f"mad.lo.u32 %rxw, %lane, {es}, %rsx;"])
    e.comment("software pipeline: word t + 1's values (and, at the last word, the next row's masks) are "
              "in flight while word t is walked")
    _scan_and_fetch(e, plan, 0)
    for t in range(words):
        _store_block(e, plan, t)
        if t + 1 < words:
            _scan_and_fetch(e, plan, t + 1)
        else:
            e.lines(["add.u32 %t, %row, 1;", f"setp.lt.u32 %pn, %t, {plan.M};", "setp.lt.u32 %pt, %t, %rowend;",
                     "and.pred %pn, %pn, %pt;", "add.u32 %rnext, %row, 1;"])
            _fetch_masks(e, plan, "%rnext", "@%pn ")
        _walk(e, plan, t)
    _epilogue(e, plan)
    e.lines(["add.u32 %row, %row, 1;", "bra ROW;"])
    e.label("DONE")
    e.line("ret;")
    copies = _copies(plan)
    decl = [".reg .pred %pt, %pu, %pn" + "".join(f", %pb{i}" for i in range(1, u))
            + "".join(f", %ps{i}" for i in range(STAGE_BATCH))
            + "".join(f", %pc{p}_{i}" for p in range(2) for i in range(copies)) + ";",
            ".reg .b32 %rtid, %lane, %warp, %t, %row, %rowend, %rnext, %rsx, %rsq, %rbuf, %rbl, %rva, %rxw, %vstart, "
            "%vn, %cnt, %incl, %total, %off0, %off1, %nch, %wk, %f, %acc, "
            + ", ".join([f"%w{t}" for t in range(words)] + [f"%wn{t}" for t in range(words)]
                        + [f"%bit{i}" for i in range(u)]
                        + [f"%rxa{i}" for i in range(u)] + [f"%xf{i}" for i in range(u)]
                        + [f"%vf{i}" for i in range(u)] + [f"%st{i}" for i in range(4 * STAGE_BATCH)]
                        + [f"%cp{p}_{i}" for p in range(2) for i in range(4 * copies)]) + ";",
            ".reg .b16 %hx" + "".join(f", %xh{i}, %vh{i}" for i in range(u)) + ";",
            ".reg .b64 %rdz, %rdt, %rdq, %rdb, %rdc, %rdm, %rdv, %rdr;"]
    shared = f".shared .align 16 .b8 smem[{plan.shared_bytes}];"
    return data_kernel(plan, "decode GEMV over a bitmap + packed values (W as data)",
                       ("p_b", "p_c", "p_values", "p_masks", "p_row_starts", "p_bias")
                       + (("p_residual",) if plan.residual else ()), decl, e.text(), plan.shared_bytes, shared)
