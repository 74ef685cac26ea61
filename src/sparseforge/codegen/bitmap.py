"""Lowering target: the bitmap decode kernel (plan/bitmap.py). Pure: render_bitmap(plan) -> PTX.

Parameters: B (kn: [batch,] K x N; nk with N = 1: [batch,] 1 x K), C ([batch,] M x N; nk: N x M), values
(the kernel's dtype), masks (uint64 [M, words]), offsets (int32 [M, steps]), bias (fp32, or null).
A warp per row. Lane s keeps offsets[row, s]; per step (32 mask words, 2048 columns) each lane loads its
word, the warp turns the words' bit counts into prefix sums by shuffle, and each lane walks its set bits
from the highest: bit b of word w is column 64 w + b, and its value sits at offset + prefix + rank, so the
values are read in order with no index stored. `unroll` bits a lane per iteration: their value and B
loads go out together, each predicated on the word still holding a bit. Sums stay in fp32 per column of N;
a fixed-order butterfly adds the lanes, lane 0 adds bias and the residual (where the plan has one),
applies ReLU (max.NaN) and stores.
"""
from __future__ import annotations

from ..plan.bitmap import WORD, BitmapPlan
from ..plan.config import WARP
from .emitter import Emitter, load_operand, operand_value, widen
from .ptx import KernelSource, data_kernel, half_registers


def _bits(e: Emitter, plan: BitmapPlan) -> None:
    """One iteration of a lane's walk over its word: up to `unroll` set bits, highest first."""
    es, n, width, u = plan.element_bytes, plan.N, plan.load_width, plan.config.unroll
    for i in range(u):
        guard = "" if i == 0 else f"@%pb{i} "
        if i:
            e.line(f"setp.ne.u64 %pb{i}, %mask, 0;")
        e.lines([f"{guard}bfind.u64 %bit{i}, %mask;", f"{guard}shl.b64 %rdm, %one, %bit{i};",
                 f"{guard}xor.b64 %mask, %mask, %rdm;",
                 f"add.u32 %t, %colbase, %bit{i};", f"mad.wide.u32 %rdx{i}, %t, {n * es}, %rdb;",
                 f"sub.u32 %t, %p, {i};", f"mad.wide.u32 %rdw{i}, %t, {es}, %rdv;"])
        if es == 4:
            e.line(f"{guard}ld.global.nc.b32 %w{i}, [%rdw{i}];")
        else:
            e.line(f"{guard}ld.global.nc.b16 %hw{i}, [%rdw{i}];")
        for v in range(n // width):
            address = f"[%rdx{i}+{v * width * es}]" if v else f"[%rdx{i}]"
            load_operand(e, es, width, i, v * width, guard[1:-1] if guard else "", address)
    for i in range(u):
        guard = "" if i == 0 else f"@%pb{i} "
        if es == 2:
            widen(e, plan.dtype, f"%w{i}", f"%hw{i}")
        for j in range(n):
            x = operand_value(e, plan.dtype, es, width, i, j)
            e.line(f"{guard}fma.rn.f32 %acc{j}, %w{i}, {x}, %acc{j};")
    e.line(f"sub.u32 %p, %p, {u};")


def render_bitmap(plan: BitmapPlan) -> KernelSource:
    c, es, n = plan.config, plan.element_bytes, plan.N
    u, width = c.unroll, plan.load_width
    e = Emitter()
    e.comment(f"a warp per row, {c.warps_per_block} rows a block, {u} set bits a lane per iteration, N = {n}")
    e.lines(["mov.u32 %rtid, %tid.x;", "and.b32 %lane, %rtid, 31;", "shr.u32 %t, %rtid, 5;",
             "mov.u32 %row, %ctaid.y;", f"mad.lo.u32 %row, %row, {c.warps_per_block}, %t;",
             f"setp.ge.u32 %pt, %row, {plan.M};", "@%pt bra DONE;",  # the whole warp leaves: no shuffle waits
             "mov.u32 %t, %ctaid.z;", "cvt.u64.u32 %rdz, %t;", "mov.b64 %one, 1;"])
    e.comment("lane s < steps: offsets[row, s], the first value of step s")
    e.lines(["mov.u32 %off, 0;", f"setp.lt.u32 %pt, %lane, {plan.steps};",
             "ld.param.u64 %rdt, [p_offsets];", "cvta.to.global.u64 %rdt, %rdt;",
             f"mad.lo.u32 %t, %row, {plan.steps}, %lane;", "mad.wide.u32 %rdt, %t, 4, %rdt;",
             "@%pt ld.global.nc.u32 %off, [%rdt];",
             "ld.param.u64 %rdk, [p_masks];", "cvta.to.global.u64 %rdk, %rdk;",
             f"mul.lo.u32 %t, %row, {plan.words};", "mad.wide.u32 %rdk, %t, 8, %rdk;",
             "ld.param.u64 %rdv, [p_values];", "cvta.to.global.u64 %rdv, %rdv;",
             "ld.param.u64 %rdb, [p_b];", "cvta.to.global.u64 %rdb, %rdb;",
             f"mul.lo.u64 %rdt, %rdz, {plan.K * n * es};", "add.s64 %rdb, %rdb, %rdt;"])
    e.lines([f"mov.f32 %acc{j}, 0f00000000;" for j in range(n)])
    e.line("mov.u32 %s, 0;")
    e.label("STEP")
    e.lines(["shfl.sync.idx.b32 %vbase, %off, %s, 31, -1;",
             f"mad.lo.u32 %wd, %s, {WARP}, %lane;", "mov.b64 %mask, 0;",
             f"setp.lt.u32 %pt, %wd, {plan.words};", "mad.wide.u32 %rdt, %wd, 8, %rdk;",
             "@%pt ld.global.nc.u64 %mask, [%rdt];", "popc.b64 %cnt, %mask;", "mov.u32 %incl, %cnt;"])
    e.comment("inclusive prefix sum of the words' bit counts over the lanes")
    offset = 1
    while offset < WARP:
        e.lines([f"shfl.sync.up.b32 %t|%pu, %incl, {offset}, 0, -1;", "@%pu add.u32 %incl, %incl, %t;"])
        offset *= 2
    e.comment("the value of the word's highest set bit: offset + exclusive prefix + count - 1")
    e.lines(["add.u32 %p, %vbase, %incl;", "sub.u32 %p, %p, 1;", f"mul.lo.u32 %colbase, %wd, {WORD};"])
    e.label("BITS")
    e.lines(["setp.eq.u64 %pt, %mask, 0;", "@%pt bra BITS_DONE;"])
    _bits(e, plan)
    e.line("bra BITS;")
    e.label("BITS_DONE")
    e.lines(["add.u32 %s, %s, 1;", f"setp.lt.u32 %pt, %s, {plan.steps};", "@%pt bra STEP;"])
    e.comment("butterfly over the warp: a fixed order of additions, the same result every run")
    offset = WARP // 2
    while offset:
        for j in range(n):
            e.lines([f"shfl.sync.bfly.b32 %f, %acc{j}, {offset}, 31, -1;", f"add.f32 %acc{j}, %acc{j}, %f;"])
        offset //= 2
    e.lines(["setp.ne.u32 %pt, %lane, 0;", "@%pt bra DONE;"])
    if plan.bias is not None:
        e.lines(["ld.param.u64 %rdt, [p_bias];", "cvta.to.global.u64 %rdt, %rdt;",
                 "mad.wide.u32 %rdt, %row, 4, %rdt;", "ld.global.nc.b32 %f, [%rdt];"])
        e.lines([f"add.f32 %acc{j}, %acc{j}, %f;" for j in range(n)])
    # kn: C[row, j] at (row * N + j); nk (N = 1): Y[0, row], the same address (the residual's alike)
    e.lines([f"mul.lo.u64 %rdt, %rdz, {plan.M * n * es};", f"mad.wide.u32 %rdt, %row, {n * es}, %rdt;"])
    if plan.residual:
        e.lines(["ld.param.u64 %rdc, [p_residual];", "cvta.to.global.u64 %rdc, %rdc;", "add.s64 %rdc, %rdc, %rdt;"])
        for j in range(n):
            address = f"[%rdc+{j * es}]" if j else "[%rdc]"
            if es == 4:
                e.line(f"ld.global.nc.b32 %f, {address};")
            else:
                e.line(f"ld.global.nc.b16 %ho, {address};")
                widen(e, plan.dtype, "%f", "%ho")
            e.line(f"add.f32 %acc{j}, %acc{j}, %f;")
    if plan.relu:
        e.lines([f"max.NaN.f32 %acc{j}, %acc{j}, 0f00000000;" for j in range(n)])
    e.lines(["ld.param.u64 %rdc, [p_c];", "cvta.to.global.u64 %rdc, %rdc;", "add.s64 %rdc, %rdc, %rdt;"])
    cvt = "cvt.rn.bf16.f32" if plan.dtype == "bfloat16" else "cvt.rn.f16.f32"
    for j in range(n):
        address = f"[%rdc+{j * es}]" if j else "[%rdc]"
        if es == 4:
            e.line(f"st.global.b32 {address}, %acc{j};")
        else:
            e.lines([f"{cvt} %ho, %acc{j};", f"st.global.b16 {address}, %ho;"])
    e.label("DONE")
    e.line("ret;")
    loads = n // width
    decl = [".reg .pred %pt, %pu" + "".join(f", %pb{i}" for i in range(1, u)) + ";",
            ".reg .b32 %rtid, %lane, %row, %t, %off, %s, %vbase, %wd, %cnt, %incl, %p, %colbase, "
            + ", ".join(f"%bit{i}" for i in range(u)) + ";",
            ".reg .b32 %f, " + ", ".join(f"%acc{j}" for j in range(n)) + ", "
            + ", ".join(f"%w{i}" for i in range(u)) + ", "
            + ", ".join(f"%x{i}_{j}" for i in range(u) for j in range(n)) + ";",
            ".reg .b16 %ho, %hv0, %hv1" + "".join(f", %hw{i}" for i in range(u)) + ";",
            ".reg .b64 %rdz, %rdt, %rdk, %rdv, %rdb, %rdc, %rdm, %one, %mask, "
            + ", ".join([f"%rdx{i}" for i in range(u)] + [f"%rdw{i}" for i in range(u)]) + ";"]
    if es == 2:
        decl += half_registers(width, u, loads if width == 1 else n)
    return data_kernel(plan, "decode SpMM over a bitmap + packed values (W as data)",
                       ("p_b", "p_c", "p_values", "p_masks", "p_offsets", "p_bias")
                       + (("p_residual",) if plan.residual else ()), decl, e.text())
