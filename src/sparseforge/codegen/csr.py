"""Lowering target: the small-N kernel over padded CSR (plan/csr.py). Pure: render_csr(plan) -> PTX.

Parameters: B (kn: [batch,] K x N; nk: [batch,] N x K), C (kn: M x N; nk: N x M), values (the kernel's
dtype), column indices (int32), rows (int32 pairs: first slot, real end), bias (fp32, or null).
A block holds warps_per_block warps; a warp holds 32 / lanes_per_row rows, each row's lanes taking its
nonzeros 4 at a time (one vector load of 4 indices, one of 4 values), and `columns` output columns from
column tile ctaid.x. Each nonzero's B values sit at constant offsets from one address computed from its
column index. Lanes past a row's end keep their predicates off; rows past M still join the butterfly
(the shuffle needs the whole warp) but load and store nothing.
"""
from __future__ import annotations

from ..plan.csr import NNZ_PER_STEP, CsrPlan
from .emitter import Emitter
from .ptx import PTX_VERSION, KernelSource



def _widen(e: Emitter, dtype: str, dst: str, half: str) -> None:
    """fp32 `dst` from a 16-bit register `half`."""
    if dtype == "bfloat16":
        e.lines([f"cvt.u32.u16 {dst}, {half};", f"shl.b32 {dst}, {dst}, 16;"])
    else:
        e.line(f"cvt.f32.f16 {dst}, {half};")


def _load_values(e: Emitter, plan: CsrPlan) -> None:
    """%w0..3 = the step's 4 weights as fp32."""
    if plan.element_bytes == 4:
        e.line("ld.global.nc.v4.b32 {%w0, %w1, %w2, %w3}, [%rdv];")
        return
    e.line("ld.global.nc.v2.b32 {%vw0, %vw1}, [%rdv];")
    for i in range(NNZ_PER_STEP):
        word = f"%vw{i // 2}"
        if plan.dtype == "bfloat16":
            e.line(f"shl.b32 %w{i}, {word}, 16;" if i % 2 == 0 else f"and.b32 %w{i}, {word}, -65536;")
        else:
            e.lines([f"mov.b32 {{%hv0, %hv1}}, {word};", f"cvt.f32.f16 %w{i}, %hv{i % 2};"])


def _operand_offsets(plan: CsrPlan) -> tuple[int, int]:
    """(bytes between B rows k and k+1, bytes between output columns n and n+1 of the operand)."""
    es = plan.element_bytes
    return (plan.N * es, es) if plan.layout == "kn" else (es, plan.K * es)


def _step(e: Emitter, plan: CsrPlan) -> None:
    """One step of a lane: 4 nonzeros (predicated on the row's real end) x the lane's column tile."""
    es, width, cols = plan.element_bytes, plan.load_width, plan.config.columns
    k_stride, n_stride = _operand_offsets(plan)
    e.line("ld.global.nc.v4.u32 {%c0, %c1, %c2, %c3}, [%rdi];")
    _load_values(e, plan)
    for i in range(NNZ_PER_STEP):
        e.lines([f"add.u32 %t, %rp, {i};", f"setp.lt.u32 %pz{i}, %t, %rend;",
                 f"mad.wide.u32 %rdx{i}, %c{i}, {k_stride}, %rdb;"])
    loads = cols // width
    for i in range(NNZ_PER_STEP):
        for v in range(loads):
            guard = f"%pq{i}_{v}"
            e.line(f"and.pred {guard}, %pz{i}, %pn{v};")
            offset = v * width * n_stride
            address = f"[%rdx{i}+{offset}]" if offset else f"[%rdx{i}]"
            if es == 4:
                regs = [f"%x{i}_{v * width + j}" for j in range(width)]
                kind = {1: "b32", 2: "v2.b32", 4: "v4.b32"}[width]
            else:
                regs = [f"%hx{i}_{v * width + j}" for j in range(width)] if width == 1 else \
                    [f"%xw{i}_{v * (width // 2) + j}" for j in range(width // 2)]
                kind = {1: "b16", 2: "b32", 4: "v2.b32", 8: "v4.b32"}[width]
            target = regs[0] if len(regs) == 1 else "{" + ", ".join(regs) + "}"
            e.line(f"@{guard} ld.global.nc.{kind} {target}, {address};")
    for i in range(NNZ_PER_STEP):
        for j in range(cols):
            x = f"%x{i}_{j}"
            if es == 2:
                if width == 1:
                    _widen(e, plan.dtype, x, f"%hx{i}_{j}")
                elif plan.dtype == "bfloat16":
                    word = f"%xw{i}_{j // 2}"
                    e.line(f"shl.b32 {x}, {word}, 16;" if j % 2 == 0 else f"and.b32 {x}, {word}, -65536;")
                else:
                    e.lines([f"mov.b32 {{%hv0, %hv1}}, %xw{i}_{j // 2};", f"cvt.f32.f16 {x}, %hv{j % 2};"])
            e.line(f"@%pq{i}_{j // width} fma.rn.f32 %acc{j}, %w{i}, {x}, %acc{j};")


def _store(e: Emitter, plan: CsrPlan) -> None:
    """Lane 0 of each valid row: bias, ReLU, round, store its column tile."""
    es, cols = plan.element_bytes, plan.config.columns
    e.lines(["setp.ne.u32 %pt, %rsub, 0;", "@%pt bra DONE;", "setp.ge.u32 %pt, %rrow, %rM;", "@%pt bra DONE;"])
    if plan.bias is not None:
        e.lines(["ld.param.u64 %rdt, [p_bias];", "cvta.to.global.u64 %rdt, %rdt;",
                 "mad.wide.u32 %rdt, %rrow, 4, %rdt;", "ld.global.nc.b32 %f, [%rdt];"])
        e.lines([f"add.f32 %acc{j}, %acc{j}, %f;" for j in range(cols)])
    if plan.relu:
        e.lines([f"max.f32 %acc{j}, %acc{j}, 0f00000000;" for j in range(cols)])
    m_stride, n_stride = (plan.N * es, es) if plan.layout == "kn" else (es, plan.M * es)
    e.lines(["ld.param.u64 %rdc, [p_c];", "cvta.to.global.u64 %rdc, %rdc;",
             f"mul.lo.u64 %rdt, %rdz, {plan.M * plan.N * es};", "add.s64 %rdc, %rdc, %rdt;",
             f"mul.wide.u32 %rdt, %rn0, {n_stride};", "add.s64 %rdc, %rdc, %rdt;",
             f"mad.wide.u32 %rdc, %rrow, {m_stride}, %rdc;"])
    cvt = "cvt.rn.bf16.f32" if plan.dtype == "bfloat16" else "cvt.rn.f16.f32"
    for j in range(cols):
        offset = j * n_stride
        address = f"[%rdc+{offset}]" if offset else "[%rdc]"
        guard = f"%pn{j // plan.load_width}"
        if es == 4:
            e.line(f"@{guard} st.global.b32 {address}, %acc{j};")
        else:
            e.lines([f"{cvt} %ho, %acc{j};", f"@{guard} st.global.b16 {address}, %ho;"])


def render_csr(plan: CsrPlan) -> KernelSource:
    c, es = plan.config, plan.element_bytes
    cols, width = c.columns, plan.load_width
    lanes = c.lanes_per_row
    e = Emitter()
    e.comment(f"{lanes} lanes per row, {c.rows_per_block} rows per block, {cols} columns per lane")
    e.lines(["mov.u32 %rM, " + str(plan.M) + ";",
             "mov.u32 %rtid, %tid.x;", f"and.b32 %rsub, %rtid, {lanes - 1};",
             "mov.u32 %t, %ctaid.y;", f"mul.lo.u32 %rrow, %t, {c.rows_per_block};",
             f"shr.u32 %t, %rtid, {lanes.bit_length() - 1};", "add.u32 %rrow, %rrow, %t;",
             "mov.u32 %t, %ctaid.z;", "cvt.u64.u32 %rdz, %t;",
             "mov.u32 %t, %ctaid.x;", f"mul.lo.u32 %rn0, %t, {cols};"])
    e.comment("which of the lane's column loads fall inside N")
    for v in range(cols // width):
        e.lines([f"add.u32 %t, %rn0, {v * width};", f"setp.lt.u32 %pn{v}, %t, {plan.N};"])
    e.comment("the row's slots: [start, end); rows past M get an empty range and only join the butterfly")
    e.lines(["mov.u32 %rp, 0;", "mov.u32 %rend, 0;", "setp.ge.u32 %pt, %rrow, %rM;", "@%pt bra RANGE_DONE;",
             "ld.param.u64 %rdt, [p_rows];", "cvta.to.global.u64 %rdt, %rdt;",
             "mad.wide.u32 %rdt, %rrow, 8, %rdt;", "ld.global.nc.v2.u32 {%rp, %rend}, [%rdt];"])
    e.label("RANGE_DONE")
    e.lines([f"mad.lo.u32 %rp, %rsub, {NNZ_PER_STEP}, %rp;",
             "ld.param.u64 %rdi, [p_cols];", "cvta.to.global.u64 %rdi, %rdi;", "mad.wide.u32 %rdi, %rp, 4, %rdi;",
             "ld.param.u64 %rdv, [p_values];", "cvta.to.global.u64 %rdv, %rdv;",
             f"mad.wide.u32 %rdv, %rp, {es}, %rdv;"])
    k_stride, n_stride = _operand_offsets(plan)
    e.comment("B base of this batch entry and column tile")
    e.lines(["ld.param.u64 %rdb, [p_b];", "cvta.to.global.u64 %rdb, %rdb;",
             f"mul.lo.u64 %rdt, %rdz, {plan.K * plan.N * es};", "add.s64 %rdb, %rdb, %rdt;",
             f"mul.wide.u32 %rdt, %rn0, {n_stride};", "add.s64 %rdb, %rdb, %rdt;"])
    e.lines([f"mov.f32 %acc{j}, 0f00000000;" for j in range(cols)])
    step = lanes * NNZ_PER_STEP
    e.label("STEP")
    e.lines(["setp.ge.u32 %pt, %rp, %rend;", "@%pt bra REDUCE;"])
    _step(e, plan)
    e.lines([f"add.u32 %rp, %rp, {step};", f"add.s64 %rdi, %rdi, {step * 4};", f"add.s64 %rdv, %rdv, {step * es};",
             "bra.uni STEP;"])
    e.label("REDUCE")
    e.comment("butterfly over the row's lanes: a fixed order of additions, the same result every run")
    offset = lanes // 2
    while offset:
        for j in range(cols):
            e.lines([f"shfl.sync.bfly.b32 %f, %acc{j}, {offset}, 31, -1;", f"add.f32 %acc{j}, %acc{j}, %f;"])
        offset //= 2
    _store(e, plan)
    e.label("DONE")
    e.line("ret;")
    regs_x = ", ".join(f"%x{i}_{j}" for i in range(NNZ_PER_STEP) for j in range(cols))
    preds = ", ".join([f"%pz{i}" for i in range(NNZ_PER_STEP)] + [f"%pn{v}" for v in range(cols // width)]
                      + [f"%pq{i}_{v}" for i in range(NNZ_PER_STEP) for v in range(cols // width)])
    decl = [f".reg .pred %pt, {preds};",
            ".reg .b32 %rM, %rtid, %rsub, %rrow, %rn0, %rp, %rend, %t, %c<4>, %vw<2>;",
            ".reg .b32 %f, %w<4>, " + ", ".join(f"%acc{j}" for j in range(cols)) + f", {regs_x};",
            ".reg .b16 %ho, %hv0, %hv1;",
            ".reg .b64 %rdz, %rdt, %rdi, %rdv, %rdb, %rdc, " + ", ".join(f"%rdx{i}" for i in range(NNZ_PER_STEP)) + ";"]
    if es == 2:
        if width == 1:
            decl.append(".reg .b16 " + ", ".join(f"%hx{i}_{j}" for i in range(NNZ_PER_STEP) for j in range(cols)) + ";")
        else:
            decl.append(".reg .b32 " + ", ".join(f"%xw{i}_{j}" for i in range(NNZ_PER_STEP)
                                                 for j in range(cols // 2)) + ";")
    text = "\n".join([
        f"// sparseforge generated kernel: {plan.name}",
        f"// small-N SpMM over padded CSR (values and indices as data), W {plan.M}x{plan.K}, N {plan.N}, "
        f"layout {plan.layout}, {plan.dtype} in, fp32 accumulate",
        f".version {PTX_VERSION}", f".target sm_{plan.arch}", ".address_size 64", "",
        f".visible .entry {plan.name}(", "    .param .u64 p_b,", "    .param .u64 p_c,", "    .param .u64 p_values,",
        "    .param .u64 p_cols,", "    .param .u64 p_rows,", "    .param .u64 p_bias", ")",
        f".maxntid {c.threads}, 1, 1", "{"] + ["    " + d for d in decl] + [e.text(), "}", ""])
    return KernelSource(plan.name, (text,), 0)
