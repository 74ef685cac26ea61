"""Lowering target: the small-N kernel over padded CSR (plan.py). Pure: render_csr(plan) -> PTX.

Parameters: B (kn: [batch,] K x N; nk: [batch,] N x K), C (kn: M x N; nk: N x M), values (the kernel's
dtype), column indices (uint16 where K <= 65536, else int32), rows (int32 pairs: first slot, real end),
bias (fp32, or null).
A block holds warps_per_block warps; a warp holds 32 / lanes_per_row rows, each row's lanes taking its
nonzeros 4 at a time (one vector load of 4 indices, one of 4 values), and `columns` output columns from
column tile ctaid.x. Each nonzero's B values sit at constant offsets from one address computed from its
column index. Lanes past a row's end keep their predicates off; rows past M still join the butterfly
(the shuffle needs the whole warp) but load and store nothing.
"""
from __future__ import annotations

from ...plan.config import WARP
from .plan import NNZ_PER_STEP, CsrPlan
from ...codegen.emitter import Emitter, load_operand, operand_value, widen
from ...codegen.ptx import KernelSource, data_kernel, half_registers



def _load_values(e: Emitter, plan: CsrPlan, u: int, offset: int, guard: str, ahead: bool = False) -> None:
    """Issue sub-step u's load of 4 weights: fp32 straight into %w{4u}.., 16-bit into %vw{2u}, %vw{2u+1}
    (ahead: the prefetched next step's registers, %wn / %vwn)."""
    address = f"[%rdv+{offset}]" if offset else "[%rdv]"
    n = "n" if ahead else ""
    if plan.element_bytes == 4:
        w = [f"%w{n}{NNZ_PER_STEP * u + i}" for i in range(NNZ_PER_STEP)]
        e.line(f"{guard}ld.global.nc.v4.b32 {{{', '.join(w)}}}, {address};")
    else:
        e.line(f"{guard}ld.global.nc.v2.b32 {{%vw{n}{2 * u}, %vw{n}{2 * u + 1}}}, {address};")


def _load_indices(e: Emitter, plan: CsrPlan, u: int, offset: int, guard: str, ahead: bool = False) -> None:
    """Issue sub-step u's load of 4 column indices: 32-bit straight into %c{4u}.., 16-bit (K <= 65536) as
    two words %ci{2u}, %ci{2u+1} (ahead: the prefetched next step's registers, %cn / %cin)."""
    address = f"[%rdi+{offset}]" if offset else "[%rdi]"
    n = "n" if ahead else ""
    if plan.index_bytes == 4:
        c = [f"%c{n}{NNZ_PER_STEP * u + i}" for i in range(NNZ_PER_STEP)]
        e.line(f"{guard}ld.global.nc.v4.u32 {{{', '.join(c)}}}, {address};")
    else:
        e.line(f"{guard}ld.global.nc.v2.u32 {{%ci{n}{2 * u}, %ci{n}{2 * u + 1}}}, {address};")


def _unpack_indices(e: Emitter, plan: CsrPlan, u: int) -> None:
    """16-bit indices of sub-step u to %c{4u}..%c{4u+3} (little-endian: the first index is the low half)."""
    if plan.index_bytes == 4:
        return
    for i in range(NNZ_PER_STEP):
        c, word = f"%c{NNZ_PER_STEP * u + i}", f"%ci{2 * u + i // 2}"
        e.line(f"and.b32 {c}, {word}, 65535;" if i % 2 == 0 else f"shr.u32 {c}, {word}, 16;")


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
    return (plan.N * es, es) if plan.layout == "kn" or plan.staged else (es, plan.K * es)


def _step(e: Emitter, plan: CsrPlan) -> None:
    """One iteration of a lane: `unroll` steps of 4 nonzeros (each predicated on the row's real end) x the
    lane's column tile. All index and value loads first, then all B loads, then the FMAs."""
    lanes, unroll = plan.config.lanes_per_row, plan.config.unroll
    for u in range(unroll):
        offset = u * lanes * NNZ_PER_STEP
        guard = ""
        if u:  # later steps may lie past the row's padded slots (past the arrays, on the last row)
            e.lines([f"add.u32 %t, %rp, {offset};", f"setp.lt.u32 %pu{u}, %t, %rend;"])
            guard = f"@%pu{u} "
        _load_indices(e, plan, u, offset * plan.index_bytes, guard)
        _load_values(e, plan, u, offset * plan.element_bytes, guard)
    _compute(e, plan)


def _issue_ahead(e: Emitter, plan: CsrPlan, ahead: int) -> None:
    """prefetch: the index and value loads of the step `ahead` slots past %rp (%rdi / %rdv already point at
    it) into the next-step registers, every sub-step guarded by the row's real end (none past it is read:
    the last row's padding ends the arrays)."""
    lanes = plan.config.lanes_per_row
    for u in range(plan.config.unroll):
        offset = u * lanes * NNZ_PER_STEP
        e.lines([f"add.u32 %t, %rp, {ahead + offset};", f"setp.lt.u32 %pf{u}, %t, %rend;"])
        _load_indices(e, plan, u, offset * plan.index_bytes, f"@%pf{u} ", ahead=True)
        _load_values(e, plan, u, offset * plan.element_bytes, f"@%pf{u} ", ahead=True)


def _take_ahead(e: Emitter, plan: CsrPlan) -> None:
    """prefetch: the step's raw index and value words from the registers the previous step loaded them into."""
    slots, words = NNZ_PER_STEP * plan.config.unroll, 2 * plan.config.unroll
    index = ("%c", slots) if plan.index_bytes == 4 else ("%ci", words)
    value = ("%w", slots) if plan.element_bytes == 4 else ("%vw", words)
    e.lines([f"mov.b32 {name}{i}, {name}n{i};" for name, count in (index, value) for i in range(count)])


def _compute(e: Emitter, plan: CsrPlan) -> None:
    """The step's work once its indices and values are in registers: unpack, B loads, FMAs."""
    es, width, cols = plan.element_bytes, plan.load_width, plan.config.columns
    lanes, unroll = plan.config.lanes_per_row, plan.config.unroll
    k_stride, n_stride = _operand_offsets(plan)
    slots = NNZ_PER_STEP * unroll
    for u in range(unroll):
        _unpack_indices(e, plan, u)
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
            load_operand(e, es, width, s, v * width, guard, address, "shared" if plan.staged else "global.nc")
    for s in range(slots):
        for j in range(cols):
            x = operand_value(e, plan.dtype, es, width, s, j)
            e.line(f"@%pq{s}_{j // width} fma.rn.f32 %acc{j}, %w{s}, {x}, %acc{j};")


def _store(e: Emitter, plan: CsrPlan, done: str = "DONE") -> None:
    """Lane 0 of each valid row: bias, the residual, ReLU, round, store its column tile; the others go to
    `done`."""
    es, cols = plan.element_bytes, plan.config.columns
    e.lines(["setp.ne.u32 %pt, %rsub, 0;", f"@%pt bra {done};", "setp.ge.u32 %pt, %rrow, %rM;", f"@%pt bra {done};"])
    if plan.bias is not None:
        e.lines(["ld.param.u64 %rdt, [p_bias];", "cvta.to.global.u64 %rdt, %rdt;",
                 "mad.wide.u32 %rdt, %rrow, 4, %rdt;", "ld.global.nc.b32 %f, [%rdt];"])
        e.lines([f"add.f32 %acc{j}, %acc{j}, %f;" for j in range(cols)])
    m_stride, n_stride = (plan.N * es, es) if plan.layout == "kn" else (es, plan.M * es)
    # the element offset of this lane's first output, from the output's base (the residual's alike)
    e.lines([f"mul.lo.u64 %rdt, %rdz, {plan.M * plan.N * es};",
             f"mul.wide.u32 %rdc, %rn0, {n_stride};", "add.s64 %rdt, %rdt, %rdc;",
             f"mad.wide.u32 %rdt, %rrow, {m_stride}, %rdt;"])
    if plan.residual:
        # plain loads, not .nc: out may be the residual itself (an in-place add), which .nc's read-only rule forbids
        e.lines(["ld.param.u64 %rdc, [p_residual];", "cvta.to.global.u64 %rdc, %rdc;", "add.s64 %rdc, %rdc, %rdt;"])
        for j in range(cols):
            address = f"[%rdc+{j * n_stride}]" if j else "[%rdc]"
            guard = f"%pn{j // plan.load_width}"
            if es == 4:
                e.line(f"@{guard} ld.global.b32 %f, {address};")
            else:
                e.lines(["mov.b16 %ho, 0;", f"@{guard} ld.global.b16 %ho, {address};"])
                widen(e, plan.dtype, "%f", "%ho")
            e.line(f"@{guard} add.f32 %acc{j}, %acc{j}, %f;")
    if plan.relu:
        e.lines([f"max.NaN.f32 %acc{j}, %acc{j}, 0f00000000;" for j in range(cols)])
    e.lines(["ld.param.u64 %rdc, [p_c];", "cvta.to.global.u64 %rdc, %rdc;", "add.s64 %rdc, %rdc, %rdt;"])
    cvt = "cvt.rn.bf16.f32" if plan.dtype == "bfloat16" else "cvt.rn.f16.f32"
    for j in range(cols):
        offset = j * n_stride
        address = f"[%rdc+{offset}]" if offset else "[%rdc]"
        guard = f"%pn{j // plan.load_width}"
        if es == 4:
            e.line(f"@{guard} st.global.b32 {address}, %acc{j};")
        else:
            e.lines([f"{cvt} %ho, %acc{j};", f"@{guard} st.global.b16 {address}, %ho;"])


def _stage_b(e: Emitter, plan: CsrPlan) -> None:
    """csr-staged: the block copies this batch entry's B into shared memory at %rds, K rows of N elements
    (kn: B as it lies, one contiguous copy in the widest unit its size allows; nk: X (N x K) transposed,
    element by element, reads coalesced), four loads a thread in flight, then waits for every thread."""
    es, threads, total = plan.element_bytes, plan.threads, plan.K * plan.N * plan.element_bytes
    e.comment("stage B in shared memory: this batch entry's, K rows of N elements")
    e.lines(["mov.u64 %rds, staged;", "ld.param.u64 %rdb, [p_b];", "cvta.to.global.u64 %rdb, %rdb;",
             f"mul.lo.u64 %rdt, %rdz, {total};", "add.s64 %rdb, %rdb, %rdt;"])
    if plan.layout == "kn":
        unit = next(u for u in (16, 8, 4, 2) if total % u == 0 and u >= es)
        kind, regs = {16: ("v4.b32", 4), 8: ("v2.b32", 2), 4: ("b32", 1), 2: ("b16", 1)}[unit]
    else:
        unit, kind, regs = es, ("b32" if es == 4 else "b16"), 1
    names = [[f"%sv{j}_{r}" if unit > 2 else f"%sh{j}" for r in range(regs)] for j in range(4)]
    e.lines([f"mul.lo.u32 %roff, %rtid, {unit};"])
    e.label("STAGE")
    e.lines([f"setp.ge.u32 %pt, %roff, {total};", "@%pt bra STAGED;"])
    for j in range(4):
        target = names[j][0] if regs == 1 else "{" + ", ".join(names[j]) + "}"
        e.lines([f"add.u32 %t, %roff, {j * threads * unit};", f"setp.lt.u32 %ps{j}, %t, {total};",
                 "cvt.u64.u32 %rdt, %t;", "add.s64 %rdt, %rdt, %rdb;", f"@%ps{j} ld.global.nc.{kind} {target}, [%rdt];"])
    for j in range(4):
        target = names[j][0] if regs == 1 else "{" + ", ".join(names[j]) + "}"
        e.line(f"add.u32 %t, %roff, {j * threads * unit};")
        if plan.layout == "nk":  # element i = t / es of X (N x K) is (n, k) = (i / K, i % K): to k * N + n
            e.lines([f"shr.u32 %t, %t, {es.bit_length() - 1};", f"div.u32 %t2, %t, {plan.K};",
                     f"mul.lo.u32 %t3, %t2, {plan.K};", "sub.u32 %t, %t, %t3;",
                     f"mad.lo.u32 %t, %t, {plan.N}, %t2;", f"mul.lo.u32 %t, %t, {es};"])
        e.lines(["cvt.u64.u32 %rdt, %t;", "add.s64 %rdt, %rdt, %rds;", f"@%ps{j} st.shared.{kind} [%rdt], {target};"])
    e.lines([f"add.u32 %roff, %roff, {4 * threads * unit};", "bra.uni STAGE;"])
    e.label("STAGED")
    e.line("bar.sync 0;")


def _row_range(e: Emitter, row: str, first: str, end: str) -> None:
    """prefetch: (first slot, real end) of `row` into first / end, (0, 0) past M (predicated, no branch)."""
    e.lines([f"mov.u32 {first}, 0;", f"mov.u32 {end}, 0;", f"setp.lt.u32 %pr, {row}, %rM;",
             "ld.param.u64 %rdt, [p_rows];", "cvta.to.global.u64 %rdt, %rdt;",
             f"mad.wide.u32 %rdt, {row}, 8, %rdt;", f"@%pr ld.global.nc.v2.u32 {{{first}, {end}}}, [%rdt];"])


def _slot_pointers(e: Emitter, plan: CsrPlan) -> None:
    """The lane's first slot of the row (%rp) and its index and value addresses (%rdi, %rdv)."""
    e.lines([f"mad.lo.u32 %rp, %rsub, {NNZ_PER_STEP}, %rp;",
             "ld.param.u64 %rdi, [p_cols];", "cvta.to.global.u64 %rdi, %rdi;",
             f"mad.wide.u32 %rdi, %rp, {plan.index_bytes}, %rdi;",
             "ld.param.u64 %rdv, [p_values];", "cvta.to.global.u64 %rdv, %rdv;",
             f"mad.wide.u32 %rdv, %rp, {plan.element_bytes}, %rdv;"])


def _global_b_base(e: Emitter, plan: CsrPlan) -> None:
    e.comment("B base of this batch entry and column tile")
    e.lines(["ld.param.u64 %rdb, [p_b];", "cvta.to.global.u64 %rdb, %rdb;",
             f"mul.lo.u64 %rdt, %rdz, {plan.K * plan.N * plan.element_bytes};", "add.s64 %rdb, %rdb, %rdt;",
             f"mul.wide.u32 %rdt, %rn0, {_operand_offsets(plan)[1]};", "add.s64 %rdb, %rdb, %rdt;"])


def _reduce(e: Emitter, plan: CsrPlan) -> None:
    e.comment("butterfly over the row's lanes: a fixed order of additions, the same result every run")
    offset = plan.config.lanes_per_row // 2
    while offset:
        for j in range(plan.config.columns):
            e.lines([f"shfl.sync.bfly.b32 %f, %acc{j}, {offset}, 31, -1;", f"add.f32 %acc{j}, %acc{j}, %f;"])
        offset //= 2


def _body(e: Emitter, plan: CsrPlan) -> None:
    """The kernel without prefetch: per row, its range, then steps that each wait on their own loads."""
    c, staged = plan.config, plan.staged
    lanes = c.lanes_per_row
    if staged:
        _stage_b(e, plan)
        e.comment("persistent: this block takes row blocks ctaid.y, ctaid.y + nctaid.y, ...")
        e.line("mov.u32 %rblk, %ctaid.y;")
        e.label("ROWS")
        e.lines([f"mul.lo.u32 %rrow, %rblk, {c.rows_per_block};", "setp.ge.u32 %pt, %rrow, %rM;", "@%pt bra DONE;"])
    else:
        e.line("mov.u32 %rblk, %ctaid.y;")
    e.lines([f"mul.lo.u32 %rrow, %rblk, {c.rows_per_block};",
             f"shr.u32 %t, %rtid, {lanes.bit_length() - 1};", "add.u32 %rrow, %rrow, %t;"])
    e.comment("the row's slots: [start, end); rows past M get an empty range and only join the butterfly")
    e.lines(["mov.u32 %rp, 0;", "mov.u32 %rend, 0;", "setp.ge.u32 %pt, %rrow, %rM;", "@%pt bra RANGE_DONE;",
             "ld.param.u64 %rdt, [p_rows];", "cvta.to.global.u64 %rdt, %rdt;",
             "mad.wide.u32 %rdt, %rrow, 8, %rdt;", "ld.global.nc.v2.u32 {%rp, %rend}, [%rdt];"])
    e.label("RANGE_DONE")
    _slot_pointers(e, plan)
    if staged:
        e.comment("B rows from the shared copy (one column tile: the lane's columns start at 0)")
        e.line("mov.u64 %rdb, %rds;")
    else:
        _global_b_base(e, plan)
    e.lines([f"mov.f32 %acc{j}, 0f00000000;" for j in range(c.columns)])
    step = lanes * NNZ_PER_STEP * c.unroll
    e.label("STEP")
    e.lines(["setp.ge.u32 %pt, %rp, %rend;", "@%pt bra REDUCE;"])
    _step(e, plan)
    e.lines([f"add.u32 %rp, %rp, {step};", f"add.s64 %rdi, %rdi, {step * plan.index_bytes};",
             f"add.s64 %rdv, %rdv, {step * plan.element_bytes};", "bra.uni STEP;"])
    e.label("REDUCE")
    _reduce(e, plan)
    _store(e, plan, "NEXT" if staged else "DONE")
    if staged:
        e.label("NEXT")
        e.lines(["mov.u32 %t, %nctaid.y;", "add.u32 %rblk, %rblk, %t;", "bra.uni ROWS;"])


def _pipelined_body(e: Emitter, plan: CsrPlan) -> None:
    """The kernel with prefetch (CsrConfig.prefetch): each step issues the next step's index and value loads
    before its own B loads and FMAs; csr-staged also loads the next row's range during a row, and the first
    row's first step is in flight while the block copies B."""
    c, staged = plan.config, plan.staged
    lanes, rows = c.lanes_per_row, c.rows_per_block
    step = lanes * NNZ_PER_STEP * c.unroll
    e.lines(["mov.u32 %rblk, %ctaid.y;", f"mul.lo.u32 %rrow, %rblk, {rows};",
             f"shr.u32 %t, %rtid, {lanes.bit_length() - 1};", "add.u32 %rrow, %rrow, %t;"])
    e.comment("the first row's slots [start, end) (empty past M) and its first step's loads")
    _row_range(e, "%rrow", "%rp", "%rend")
    _slot_pointers(e, plan)
    _issue_ahead(e, plan, 0)
    if staged:
        _stage_b(e, plan)
        e.comment("B rows from the shared copy (one column tile: the lane's columns start at 0)")
        e.line("mov.u64 %rdb, %rds;")
    else:
        _global_b_base(e, plan)
    e.label("ROW")
    if staged:
        e.comment("persistent: the row block nctaid.y on, its range loaded while this row runs")
        e.lines(["mov.u32 %t, %nctaid.y;", f"mad.lo.u32 %rrown, %t, {rows}, %rrow;"])
        _row_range(e, "%rrown", "%rpn", "%rendn")
    e.lines([f"mov.f32 %acc{j}, 0f00000000;" for j in range(c.columns)])
    e.label("STEP")
    e.lines(["setp.ge.u32 %pt, %rp, %rend;", "@%pt bra REDUCE;"])
    _take_ahead(e, plan)
    e.lines([f"add.s64 %rdi, %rdi, {step * plan.index_bytes};", f"add.s64 %rdv, %rdv, {step * plan.element_bytes};"])
    _issue_ahead(e, plan, step)
    _compute(e, plan)
    e.lines([f"add.u32 %rp, %rp, {step};", "bra.uni STEP;"])
    e.label("REDUCE")
    _reduce(e, plan)
    _store(e, plan, "NEXT" if staged else "DONE")
    if staged:
        e.label("NEXT")
        e.comment("the next row block (the same for the whole block: a uniform exit), its range already here")
        e.lines(["mov.u32 %t, %nctaid.y;", "add.u32 %rblk, %rblk, %t;", f"mul.lo.u32 %t, %rblk, {rows};",
                 "setp.ge.u32 %pt, %t, %rM;", "@%pt bra DONE;",
                 "mov.u32 %rrow, %rrown;", "mov.u32 %rp, %rpn;", "mov.u32 %rend, %rendn;"])
        _slot_pointers(e, plan)
        _issue_ahead(e, plan, 0)
        e.line("bra.uni ROW;")


def render_csr(plan: CsrPlan) -> KernelSource:
    c, es = plan.config, plan.element_bytes
    cols, width = c.columns, plan.load_width
    lanes, staged = c.lanes_per_row, plan.staged
    e = Emitter()
    e.comment(f"{lanes} lanes per row, {c.rows_per_block} rows per block, {cols} columns per lane"
              + (f"; B staged in shared memory, {c.ctas} persistent blocks" if staged else "")
              + ("; the next step's loads issued ahead" if c.prefetch else ""))
    e.lines(["mov.u32 %rM, " + str(plan.M) + ";",
             "mov.u32 %rtid, %tid.x;", f"and.b32 %rsub, %rtid, {lanes - 1};",
             "mov.u32 %t, %ctaid.z;", "cvt.u64.u32 %rdz, %t;",
             "mov.u32 %t, %ctaid.x;", f"mul.lo.u32 %rn0, %t, {cols};"])
    e.comment("which of the lane's column loads fall inside N")
    for v in range(cols // width):
        e.lines([f"add.u32 %t, %rn0, {v * width};", f"setp.lt.u32 %pn{v}, %t, {plan.N};"])
    (_pipelined_body if c.prefetch else _body)(e, plan)
    e.label("DONE")
    e.line("ret;")
    slots = NNZ_PER_STEP * c.unroll
    regs_x = ", ".join(f"%x{i}_{j}" for i in range(slots) for j in range(cols))
    preds = ", ".join([f"%pz{i}" for i in range(slots)] + [f"%pn{v}" for v in range(cols // width)]
                      + [f"%pu{u}" for u in range(1, c.unroll)]
                      + [f"%pq{i}_{v}" for i in range(slots) for v in range(cols // width)]
                      + ([f"%ps{j}" for j in range(4)] if staged else [])
                      + ([f"%pf{u}" for u in range(c.unroll)] + ["%pr"] if c.prefetch else []))
    decl = [f".reg .pred %pt, {preds};",
            f".reg .b32 %rM, %rtid, %rsub, %rrow, %rblk, %rn0, %rp, %rend, %t, %c<{slots}>, %vw<{2 * c.unroll}>, %ci<{2 * c.unroll}>;",
            f".reg .b32 %f, %w<{slots}>, " + ", ".join(f"%acc{j}" for j in range(cols)) + f", {regs_x};",
            ".reg .b16 %ho, %hv0, %hv1;",
            ".reg .b64 %rdz, %rdt, %rdi, %rdv, %rdb, %rdc, " + ", ".join(f"%rdx{i}" for i in range(slots)) + ";"]
    if c.prefetch:
        decl.append(f".reg .b32 %rrown, %rpn, %rendn, %cn<{slots}>, %wn<{slots}>, %vwn<{2 * c.unroll}>, "
                    f"%cin<{2 * c.unroll}>;")
    shared = ""
    if staged:
        decl += [".reg .b32 %roff, %t2, %t3, " + ", ".join(f"%sv{j}_{r}" for j in range(4) for r in range(4)) + ";",
                 ".reg .b16 %sh<4>;", ".reg .b64 %rds;"]
        # dynamic: the launch gives plan.dynamic_shared_bytes (over the 48 KB a static declaration may have)
        shared = ".extern .shared .align 16 .b8 staged[];"
    if es == 2:
        decl += half_registers(width, slots, cols)
    return data_kernel(plan, "small-N SpMM over padded CSR (values and indices as data)"
                       + (", B staged in shared memory" if staged else ""),
                       ("p_b", "p_c", "p_values", "p_cols", "p_rows", "p_bias") + (("p_residual",) if plan.residual else ()),
                       decl, e.text(), 0, shared)


# -- csr-columns: a warp per row, lanes across N, nonzeros broadcast by shuffle ------------------------------

def _columns_layout(plan: CsrPlan) -> list[tuple[int, int]]:
    """Per load v of a nonzero: (column offset of lane 0's first element from the tile start, elements).
    Vector loads: lane l holds columns l*C..l*C+C-1 (one load). Else C single loads 32 columns apart."""
    c, width = plan.config.columns, plan.load_width
    if width == c:
        return [(0, c)]
    return [(v * WARP, 1) for v in range(c)]


class DenseRows:
    """The operand of csr-columns SpMM: B (kn, [batch,] K x N); a nonzero's index is its B row."""
    params = ("p_b", "p_c", "p_values", "p_cols", "p_rows", "p_bias")
    title = "SpMM over padded CSR, a warp per row with lanes across N (values and indices as data)"

    def registers(self, plan) -> list[str]:
        return [".reg .b64 %rdb, " + ", ".join(f"%rdx{j}" for j in range(WARP)) + ";"]

    def output_strides(self, plan) -> tuple[int, int]:
        """(elements between C's rows, between its columns): C is M x N."""
        return plan.N, 1

    def setup(self, e: Emitter, plan) -> None:
        es = plan.element_bytes
        e.comment("B base of this batch entry and of the lane's first column")
        e.lines(["ld.param.u64 %rdb, [p_b];", "cvta.to.global.u64 %rdb, %rdb;",
                 f"mul.lo.u64 %rdt, %rdz, {plan.K * plan.N * es};", "add.s64 %rdb, %rdb, %rdt;",
                 f"mul.wide.u32 %rdt, %rn0, {es};", "add.s64 %rdb, %rdb, %rdt;"])

    def nonzero(self, e: Emitter, plan, j: int) -> None:
        e.line(f"mad.wide.u32 %rdx{j}, %cj{j}, {plan.N * plan.element_bytes}, %rdb;")

    def load(self, e: Emitter, plan, j: int, v: int, offset: int) -> str:
        """Emit the predicate of nonzero j's load v (named %pq{j}_{v}); return its address."""
        e.line(f"and.pred %pq{j}_{v}, %pj{j}, %pn{v};")
        return f"[%rdx{j}+{offset * plan.element_bytes}]" if offset else f"[%rdx{j}]"


def render_csr_columns(plan: CsrPlan) -> KernelSource:
    """Sputnik's one-dimensional tiling over padded CSR. Per chunk of 32 slots a lane loads one (index,
    value) pair; then, for each of the chunk's 32 nonzeros in turn, the warp broadcasts it by shuffle and
    every lane loads its columns of that B row (consecutive lanes, consecutive columns) at one address
    computed from the index, and adds value x B into fp32 accumulators. The 32 steps are unrolled with
    their own registers, so the B loads of a chunk are all in flight together (ptxas schedules them)."""
    return render_columns(plan, DenseRows())


def render_columns(plan, operand) -> KernelSource:
    """The csr-columns kernel over any operand (DenseRows; codegen/conv.py's implicit im2col): the chunk
    loop, the shuffles, the warps' reduction and the epilogue are shared, the operand says where a
    nonzero's inputs are and when they exist, and where the outputs go (operand.output_strides).
    plan.residual: the epilogue adds R (same layout as the output, parameter p_residual) before ReLU."""
    c, es = plan.config, plan.element_bytes
    cols, width, S, R = c.columns, plan.load_width, c.warps_per_row, c.rows_per_block
    loads = _columns_layout(plan)
    lane_stride = cols if width == cols else 1  # columns between lane l and lane l + 1
    e = Emitter()
    e.comment(f"{S} warp(s) per row, {R} rows per block, {cols} columns per lane, loads of {width}")
    e.lines(["mov.u32 %rtid, %tid.x;", "and.b32 %lane, %rtid, 31;", "shr.u32 %warp, %rtid, 5;",
             f"and.b32 %wr, %warp, {S - 1};", f"shr.u32 %t, %warp, {S.bit_length() - 1};",
             "mov.u32 %rrow, %ctaid.y;", f"mad.lo.u32 %rrow, %rrow, {R}, %t;",
             "mov.u32 %t, %ctaid.z;", "cvt.u64.u32 %rdz, %t;",
             "mov.u32 %rn0, %ctaid.x;", f"mul.lo.u32 %rn0, %rn0, {c.tile_columns};",
             f"mad.lo.u32 %rn0, %lane, {lane_stride}, %rn0;"])
    e.comment("which of the lane's loads fall inside N (a vector never straddles N: N % width == 0)")
    for v, (offset, _) in enumerate(loads):
        e.lines([f"add.u32 %t, %rn0, {offset};", f"setp.lt.u32 %pn{v}, %t, {plan.N};"])
    e.comment("the row's slots [start, end); rows past M get an empty range (they still reach the barrier)")
    e.lines(["mov.u32 %rp, 0;", "mov.u32 %rend, 0;", f"setp.ge.u32 %pt, %rrow, {plan.M};", "@%pt bra RANGE_DONE;",
             "ld.param.u64 %rdt, [p_rows];", "cvta.to.global.u64 %rdt, %rdt;",
             "mad.wide.u32 %rdt, %rrow, 8, %rdt;", "ld.global.nc.v2.u32 {%rp, %rend}, [%rdt];"])
    e.label("RANGE_DONE")
    e.lines([f"mad.lo.u32 %rp, %wr, {WARP}, %rp;",
             "ld.param.u64 %rdi, [p_cols];", "cvta.to.global.u64 %rdi, %rdi;",
             "ld.param.u64 %rdv, [p_values];", "cvta.to.global.u64 %rdv, %rdv;"])
    operand.setup(e, plan)
    e.lines([f"mov.f32 %acc{j}, 0f00000000;" for j in range(cols)])

    def fetch(start: str, index: str, value: str, half: str, widen_now: bool) -> None:
        """Each lane's (index, value) of the chunk at slot `start`; past the row's end, value 0 and the
        operand's empty_slot (an index its loads treat as absent; 0 where the loads check %pj instead)."""
        e.lines([f"add.u32 %t, {start}, %lane;", "setp.lt.u32 %pl, %t, %rend;",
                 f"mov.u32 {index}, {getattr(operand, 'empty_slot', 0)};", f"mov.f32 {value}, 0f00000000;",
                 "mad.wide.u32 %rdt, %t, 4, %rdi;", f"@%pl ld.global.nc.u32 {index}, [%rdt];",
                 f"mad.wide.u32 %rdt, %t, {es}, %rdv;"])
        if es == 4:
            e.line(f"@%pl ld.global.nc.b32 {value}, [%rdt];")
        else:
            e.lines([f"mov.b16 {half}, 0;", f"@%pl ld.global.nc.b16 {half}, [%rdt];"])
            if widen_now:
                widen(e, plan.dtype, value, half)

    # Software pipelining: a chunk fetches the next chunk's (index, value) before its own loads and FMAs, so
    # the loop pays one memory round trip a chunk (the operand's loads), not two (slots, then operand). A
    # half-precision value is widened at the chunk's end, when the load has long arrived.
    e.comment("the first chunk's (index, value) per lane; each chunk then fetches the next one's first")
    fetch("%rp", "%ci", "%wv", "%hv0", True)
    e.label("CHUNK")
    e.lines(["setp.ge.u32 %pt, %rp, %rend;", "@%pt bra REDUCE;", "sub.u32 %cnt, %rend, %rp;",
             f"add.u32 %t2, %rp, {S * WARP};"])
    fetch("%t2", "%cin", "%wvn", "%hvn", False)
    e.comment("the chunk's nonzeros one by one: broadcast (index, value), load B's row segment, FMA")
    # Loads go a batch ahead of their FMAs: batch x columns B registers (ptxas hoists further where
    # registers allow). All 32 at 4 fp32 columns would want ~300 registers and spill.
    batch = max(4, min(WARP, 32 // plan.config.columns if es == 4 else 64 // plan.config.columns))
    for first in range(0, WARP, batch):
        js = range(first, first + batch)
        for j in js:
            e.lines([f"setp.gt.u32 %pj{j}, %cnt, {j};",
                     f"shfl.sync.idx.b32 %cj{j}, %ci, {j}, 31, -1;", f"shfl.sync.idx.b32 %wj{j}, %wv, {j}, 31, -1;"])
            operand.nonzero(e, plan, j)
            for v, (offset, n_el) in enumerate(loads):
                guard = f"%pq{j}_{v}"
                address = operand.load(e, plan, j, v, offset)
                load_operand(e, es, n_el, j, v * n_el, guard, address)
        for j in js:
            for i in range(cols):
                x = operand_value(e, plan.dtype, es, width, j, i)
                e.line(f"@%pq{j}_{0 if width == cols else i} fma.rn.f32 %acc{i}, %wj{j}, {x}, %acc{i};")
    e.lines([f"add.u32 %rp, %rp, {S * WARP};", "mov.b32 %ci, %cin;"])
    if es == 4:
        e.line("mov.b32 %wv, %wvn;")
    else:
        widen(e, plan.dtype, "%wv", "%hvn")
    e.line("bra.uni CHUNK;")
    e.label("REDUCE")
    shared = ""
    if S > 1:
        e.comment("warps 1..S-1 of a row leave their sums in shared memory; warp 0 adds them in warp order")
        shared = f".shared .align 16 .b8 partials[{R * (S - 1) * WARP * cols * 4}];"
        e.comment("warp w > 0 of row r owns slot r * (S - 1) + w - 1; warp 0 points at its row's first slot")
        e.lines(["mov.u64 %rds, partials;", "setp.ne.u32 %pt, %wr, 0;", "selp.u32 %t2, %wr, 1, %pt;",
                 f"shr.u32 %t, %warp, {S.bit_length() - 1};", f"mul.lo.u32 %t, %t, {S - 1};",
                 "add.u32 %t, %t, %t2;", "sub.u32 %t, %t, 1;",
                 f"mul.lo.u32 %t, %t, {WARP * cols};", f"mad.lo.u32 %t, %lane, {cols}, %t;",
                 "mad.wide.u32 %rdt, %t, 4, %rds;", "setp.eq.u32 %pt, %wr, 0;", "@%pt bra SUMMED;"])
        e.lines([f"st.shared.b32 [%rdt+{4 * i}], %acc{i};" if i else "st.shared.b32 [%rdt], %acc0;"
                 for i in range(cols)])
        e.label("SUMMED")
        e.line("bar.sync 0;")
        e.lines(["setp.ne.u32 %pt, %wr, 0;", "@%pt bra DONE;"])
        for w in range(1, S):
            base = (w - 1) * WARP * cols * 4
            for i in range(cols):
                e.lines([f"ld.shared.b32 %f, [%rdt+{base + 4 * i}];", f"add.f32 %acc{i}, %acc{i}, %f;"])
    else:
        e.label("SUMMED")
    e.lines([f"setp.ge.u32 %pt, %rrow, {plan.M};", "@%pt bra DONE;"])
    if plan.bias is not None:
        e.lines(["ld.param.u64 %rdt, [p_bias];", "cvta.to.global.u64 %rdt, %rdt;",
                 "mad.wide.u32 %rdt, %rrow, 4, %rdt;", "ld.global.nc.b32 %f, [%rdt];"])
        e.lines([f"add.f32 %acc{i}, %acc{i}, %f;" for i in range(cols)])
    row_stride, column_stride = (stride * es for stride in operand.output_strides(plan))
    e.lines(["ld.param.u64 %rdc, [p_c];", "cvta.to.global.u64 %rdc, %rdc;",
             f"mul.lo.u64 %rdt, %rdz, {plan.M * plan.N * es};", "add.s64 %rdt, %rdt, %rdc;",
             f"mul.wide.u32 %rdc, %rn0, {column_stride};", "add.s64 %rdc, %rdc, %rdt;",
             f"mad.wide.u32 %rdc, %rrow, {row_stride}, %rdc;"])

    def output_slot(i: int, base: str) -> tuple[str, str]:
        """(address from base, predicate) of the lane's output column i: the residual's and the output's."""
        offset = (i if width == cols else i * WARP) * column_stride
        return (f"[{base}+{offset}]" if offset else f"[{base}]"), ("%pn0" if width == cols else f"%pn{i}")

    if getattr(plan, "residual", False):
        e.comment("the residual R, laid out as the output: at the same offset from its base")
        e.lines(["ld.param.u64 %rdt, [p_residual];", "cvta.to.global.u64 %rdt, %rdt;",
                 "ld.param.u64 %rds, [p_c];", "cvta.to.global.u64 %rds, %rds;", "sub.s64 %rds, %rdc, %rds;",
                 "add.s64 %rdt, %rdt, %rds;"])
        for i in range(cols):
            address, guard = output_slot(i, "%rdt")
            if es == 4:
                e.line(f"@{guard} ld.global.b32 %f, {address};")
            else:
                e.lines(["mov.b16 %ho, 0;", f"@{guard} ld.global.b16 %ho, {address};"])
                widen(e, plan.dtype, "%f", "%ho")
            e.line(f"@{guard} add.f32 %acc{i}, %acc{i}, %f;")
    if plan.relu:
        e.lines([f"max.NaN.f32 %acc{i}, %acc{i}, 0f00000000;" for i in range(cols)])
    cvt = "cvt.rn.bf16.f32" if plan.dtype == "bfloat16" else "cvt.rn.f16.f32"
    for i in range(cols):
        address, guard = output_slot(i, "%rdc")
        if es == 4:
            e.line(f"@{guard} st.global.b32 {address}, %acc{i};")
        else:
            e.lines([f"{cvt} %ho, %acc{i};", f"@{guard} st.global.b16 {address}, %ho;"])
    e.label("DONE")
    e.line("ret;")
    n_loads = len(loads)
    preds = ", ".join([f"%pj{j}" for j in range(WARP)] + [f"%pn{v}" for v in range(n_loads)]
                      + [f"%pq{j}_{v}" for j in range(WARP) for v in range(n_loads)])
    decl = [f".reg .pred %pt, %pl, {preds};",
            ".reg .b32 %rtid, %lane, %warp, %wr, %rrow, %rn0, %rp, %rend, %t, %t2, %cnt, %ci, %cin, "
            + ", ".join(f"%cj{j}" for j in range(WARP)) + ";",
            ".reg .b32 %f, %wv, %wvn, " + ", ".join(f"%acc{i}" for i in range(cols)) + ", "
            + ", ".join(f"%wj{j}" for j in range(WARP)) + ", "
            + ", ".join(f"%x{j}_{i}" for j in range(WARP) for i in range(cols)) + ";",
            ".reg .b16 %ho, %hv0, %hv1, %hvn;",
            ".reg .b64 %rdz, %rdt, %rdi, %rdv, %rdc, %rds;", *operand.registers(plan)]
    if es == 2:
        decl += half_registers(width, WARP, cols)
    params = operand.params + (("p_residual",) if getattr(plan, "residual", False) else ())
    return data_kernel(plan, operand.title, params, decl, e.text(), R * (S - 1) * WARP * cols * 4, shared)
