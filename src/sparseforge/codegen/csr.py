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


def _load_values(e: Emitter, plan: CsrPlan, u: int, offset: int, guard: str) -> None:
    """Issue sub-step u's load of 4 weights: fp32 straight into %w{4u}.., 16-bit into %vw{2u}, %vw{2u+1}."""
    address = f"[%rdv+{offset}]" if offset else "[%rdv]"
    if plan.element_bytes == 4:
        w = [f"%w{NNZ_PER_STEP * u + i}" for i in range(NNZ_PER_STEP)]
        e.line(f"{guard}ld.global.nc.v4.b32 {{{', '.join(w)}}}, {address};")
    else:
        e.line(f"{guard}ld.global.nc.v2.b32 {{%vw{2 * u}, %vw{2 * u + 1}}}, {address};")


def _unpack_values(e: Emitter, plan: CsrPlan, u: int) -> None:
    """16-bit weights of sub-step u to fp32 %w{4u}..%w{4u+3} (after every load is in flight)."""
    if plan.element_bytes == 4:
        return
    for i in range(NNZ_PER_STEP):
        w, word = f"%w{NNZ_PER_STEP * u + i}", f"%vw{2 * u + i // 2}"
        if plan.dtype == "bfloat16":
            e.line(f"shl.b32 {w}, {word}, 16;" if i % 2 == 0 else f"and.b32 {w}, {word}, -65536;")
        else:
            e.lines([f"mov.b32 {{%hv0, %hv1}}, {word};", f"cvt.f32.f16 {w}, %hv{i % 2};"])


def _operand_offsets(plan: CsrPlan) -> tuple[int, int]:
    """(bytes between B rows k and k+1, bytes between output columns n and n+1 of the operand)."""
    es = plan.element_bytes
    return (plan.N * es, es) if plan.layout == "kn" else (es, plan.K * es)


def _step(e: Emitter, plan: CsrPlan) -> None:
    """One iteration of a lane: `unroll` steps of 4 nonzeros (each predicated on the row's real end) x the
    lane's column tile. All index and value loads first, then all B loads, then the FMAs."""
    es, width, cols = plan.element_bytes, plan.load_width, plan.config.columns
    lanes, unroll = plan.config.lanes_per_row, plan.config.unroll
    k_stride, n_stride = _operand_offsets(plan)
    slots = NNZ_PER_STEP * unroll
    for u in range(unroll):
        c = [f"%c{NNZ_PER_STEP * u + i}" for i in range(NNZ_PER_STEP)]
        offset = u * lanes * NNZ_PER_STEP
        guard = ""
        if u:  # later steps may lie past the row's padded slots (past the arrays, on the last row)
            e.lines([f"add.u32 %t, %rp, {offset};", f"setp.lt.u32 %pu{u}, %t, %rend;"])
            guard = f"@%pu{u} "
        e.line(f"{guard}ld.global.nc.v4.u32 {{{', '.join(c)}}}, [%rdi{'+' + str(offset * 4) if offset else ''}];")
        _load_values(e, plan, u, offset * es, guard)
    for s in range(slots):
        offset = (s // NNZ_PER_STEP) * lanes * NNZ_PER_STEP + s % NNZ_PER_STEP
        e.lines([f"add.u32 %t, %rp, {offset};", f"setp.lt.u32 %pz{s}, %t, %rend;",
                 f"mad.wide.u32 %rdx{s}, %c{s}, {k_stride}, %rdb;"])
    loads = cols // width
    for u in range(unroll):
        _unpack_values(e, plan, u)
    for s in range(slots):
        for v in range(loads):
            guard = f"%pq{s}_{v}"
            e.line(f"and.pred {guard}, %pz{s}, %pn{v};")
            offset = v * width * n_stride
            address = f"[%rdx{s}+{offset}]" if offset else f"[%rdx{s}]"
            if es == 4:
                regs = [f"%x{s}_{v * width + j}" for j in range(width)]
                kind = {1: "b32", 2: "v2.b32", 4: "v4.b32"}[width]
            else:
                regs = [f"%hx{s}_{v * width + j}" for j in range(width)] if width == 1 else \
                    [f"%xw{s}_{v * (width // 2) + j}" for j in range(width // 2)]
                kind = {1: "b16", 2: "b32", 4: "v2.b32", 8: "v4.b32"}[width]
            target = regs[0] if len(regs) == 1 else "{" + ", ".join(regs) + "}"
            e.line(f"@{guard} ld.global.nc.{kind} {target}, {address};")
    for s in range(slots):
        for j in range(cols):
            x = f"%x{s}_{j}"
            if es == 2:
                if width == 1:
                    _widen(e, plan.dtype, x, f"%hx{s}_{j}")
                elif plan.dtype == "bfloat16":
                    word = f"%xw{s}_{j // 2}"
                    e.line(f"shl.b32 {x}, {word}, 16;" if j % 2 == 0 else f"and.b32 {x}, {word}, -65536;")
                else:
                    e.lines([f"mov.b32 {{%hv0, %hv1}}, %xw{s}_{j // 2};", f"cvt.f32.f16 {x}, %hv{j % 2};"])
            e.line(f"@%pq{s}_{j // width} fma.rn.f32 %acc{j}, %w{s}, {x}, %acc{j};")


def _store(e: Emitter, plan: CsrPlan) -> None:
    """Lane 0 of each valid row: bias, ReLU, round, store its column tile."""
    es, cols = plan.element_bytes, plan.config.columns
    e.lines(["setp.ne.u32 %pt, %rsub, 0;", "@%pt bra DONE;", "setp.ge.u32 %pt, %rrow, %rM;", "@%pt bra DONE;"])
    if plan.bias is not None:
        e.lines(["ld.param.u64 %rdt, [p_bias];", "cvta.to.global.u64 %rdt, %rdt;",
                 "mad.wide.u32 %rdt, %rrow, 4, %rdt;", "ld.global.nc.b32 %f, [%rdt];"])
        e.lines([f"add.f32 %acc{j}, %acc{j}, %f;" for j in range(cols)])
    if plan.relu:
        e.lines([f"max.NaN.f32 %acc{j}, %acc{j}, 0f00000000;" for j in range(cols)])
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
    step = lanes * NNZ_PER_STEP * c.unroll
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
    slots = NNZ_PER_STEP * c.unroll
    regs_x = ", ".join(f"%x{i}_{j}" for i in range(slots) for j in range(cols))
    preds = ", ".join([f"%pz{i}" for i in range(slots)] + [f"%pn{v}" for v in range(cols // width)]
                      + [f"%pu{u}" for u in range(1, c.unroll)]
                      + [f"%pq{i}_{v}" for i in range(slots) for v in range(cols // width)])
    decl = [f".reg .pred %pt, {preds};",
            f".reg .b32 %rM, %rtid, %rsub, %rrow, %rn0, %rp, %rend, %t, %c<{slots}>, %vw<{2 * c.unroll}>;",
            f".reg .b32 %f, %w<{slots}>, " + ", ".join(f"%acc{j}" for j in range(cols)) + f", {regs_x};",
            ".reg .b16 %ho, %hv0, %hv1;",
            ".reg .b64 %rdz, %rdt, %rdi, %rdv, %rdb, %rdc, " + ", ".join(f"%rdx{i}" for i in range(slots)) + ";"]
    if es == 2:
        if width == 1:
            decl.append(".reg .b16 " + ", ".join(f"%hx{i}_{j}" for i in range(slots) for j in range(cols)) + ";")
        else:
            decl.append(".reg .b32 " + ", ".join(f"%xw{i}_{j}" for i in range(slots)
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
