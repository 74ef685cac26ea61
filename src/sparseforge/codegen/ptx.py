"""Lowering a Plan to PTX: every nonzero weight an immediate FMA operand, every operand read at a constant
offset from the lane's base in shared memory.

render(plan) is a pure function: the same plan always gives the same text, and nothing here touches a GPU.
Kernel shape: a block = one column tile (32*vec columns; nk: 32 tokens) x warps_per_block row groups, one
warp per group. For each chunk of K the block stages the operand into shared memory (operands.py), then
a jump table (brx.idx) on the warp's group sends it to that group's section: straight-line code that
reads each needed k once, widens 16-bit inputs to fp32 and feeds every row with a nonzero there, in fp32
accumulators (bias preloaded). The last chunk's section adds the residual where the plan has one (read
at the output's offset from its own base), applies ReLU, rounds and stores. Where a thread's columns are
adjacent in the output (kn, a convolution in NCHW) a row's vec values are one vector store; where they are
not (nk, a convolution in NHWC: columns M apart) each column is stored apart, and runs of adjacent rows the
plan names (plan.store_runs) are one vector instead.

Each (group, chunk) section is a separate function (kn with chunk_k: each run of groups_per_block groups,
all its chunks inline), and the functions are packed into several modules compiled apart: ptxas time
grows faster than linearly with function and module size.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan, RowGroup
from .emitter import Emitter, f32_immediate, widen
from .operands import RegionBases, operand_for

PTX_VERSION = "8.0"
MODULE_INSTRUCTIONS = 3000  # instructions per compiled module (see compiler.py for the measurements)
_LOAD_KIND = {(4, 1): "b32", (4, 2): "v2.b32", (4, 4): "v4.b32", (2, 1): "b16", (2, 2): "b32", (2, 4): "v2.b32"}
_REG_KINDS = {"a": "b32", "b": "b32", "x": "b32", "w": "b32", "rc": "b32", "h": "b16", "o": "b16", "rh": "b16",
              "rx": "b16", "pk": "pred", "q": "b32", "qw": "b32", "qh": "b16"}


@dataclass(frozen=True)
class KernelSource:
    name: str
    modules: tuple[str, ...]   # modules[0] holds the entry; the rest hold the sections it calls
    shared_bytes: int          # static shared memory of the entry

    @property
    def text(self) -> str:
        return "\n// ---- module boundary ----\n".join(self.modules)


@dataclass(frozen=True)
class Output:
    """Where a thread's sums go: the output's base registers, the byte strides between W's rows and between
    the thread's consecutive columns in it (kn / NCHW: N*es and es; nk / NHWC: es and M*es), and the
    residual's base registers (laid out as the output, at the same offsets) where the plan adds one."""
    bases: RegionBases
    row_stride: int
    column_stride: int
    residual: RegionBases | None = None

    @property
    def registers(self) -> list[str]:
        return self.bases.registers + (self.residual.registers if self.residual else [])

    def section_prologue(self, e: Emitter) -> None:
        """A storing section's own base registers, from its parameters p_c (and p_r)."""
        self.bases.emit(e, ["ld.param.u64 %rdc0, [p_c];"])
        if self.residual:
            self.residual.emit(e, ["ld.param.u64 %rdr0, [p_r];"])

    @property
    def params(self) -> list[str]:
        return [".param .b64 p_c"] + ([".param .b64 p_r"] if self.residual else [])

    def call_lines(self) -> tuple[list[str], list[str]]:
        """(lines storing the bases into a call's parameters, the parameter names)."""
        lines = [".param .b64 p_c;", "st.param.b64 [p_c], %rdc0;"]
        if self.residual:
            lines += [".param .b64 p_r;", "st.param.b64 [p_r], %rdr0;"]
        return lines, ["p_c"] + (["p_r"] if self.residual else [])


def data_kernel(plan, title: str, params, decl: list[str], body: str, shared_bytes: int = 0,
                shared: str = "") -> KernelSource:
    """A one-module kernel that reads W as data (small-N CSR, csr-columns, conv, bitmap decode): the
    header, the entry with its .u64 parameters, .maxntid, the register declarations and the body."""
    text = "\n".join([
        f"// sparseforge generated kernel: {plan.name}",
        f"// {title}, W {plan.M}x{plan.K}, N {plan.N}, layout {plan.layout}, {plan.dtype} in, fp32 accumulate",
        f".version {PTX_VERSION}", f".target sm_{plan.arch}", ".address_size 64", "",
        *([shared, ""] if shared else []),
        f".visible .entry {plan.name}(", ",\n".join(f"    .param .u64 {p}" for p in params), ")",
        f".maxntid {plan.config.threads}, 1, 1",
        *([f".minnctapersm {plan.min_blocks}"] if getattr(plan, "min_blocks", 1) > 1 else []),
        "{"] + ["    " + d for d in decl] + [body, "}", ""])
    return KernelSource(plan.name, (text,), shared_bytes)


def half_registers(width: int, slots: int, columns: int) -> list[str]:
    """16-bit operand registers of the data kernels: per (slot, column) b16 values for scalar loads, or
    b32 pairs for vector loads; none in fp32."""
    if width == 1:
        return [".reg .b16 " + ", ".join(f"%hx{i}_{j}" for i in range(slots) for j in range(columns)) + ";"]
    return [".reg .b32 " + ", ".join(f"%xw{i}_{j}" for i in range(slots) for j in range(columns // 2)) + ";"]


def _vec(plan: Plan) -> int:
    return plan.config.vec if plan.layout == "kn" else 1


# -- inside a section ------------------------------------------------------------------------------
def _emit_load(e: Emitter, plan: Plan, operand, k: int, j: int) -> None:
    """Read the lane's value(s) for column k into fp32 registers %b{j*vec + v} (16-bit: raw first)."""
    es, vec = plan.element_bytes, _vec(plan)
    kind = _LOAD_KIND[(es, vec)]
    if es == 4:
        regs = [e.reg("b", j * vec + v) for v in range(vec)]
        target = regs[0] if vec == 1 else "{" + ", ".join(regs) + "}"
    elif vec == 1:
        target = e.reg("h", j)
    else:
        words = [e.reg("x", j * (vec // 2) + w) for w in range(vec // 2)]
        target = words[0] if len(words) == 1 else "{" + ", ".join(words) + "}"
    e.line(f"ld.{operand.space}.{kind} {target}, {operand.address(k)};")


def _emit_widen(e: Emitter, plan: Plan, j: int) -> None:
    if plan.element_bytes == 4:
        return
    vec, bf16 = _vec(plan), plan.dtype == "bfloat16"
    if vec == 1:
        b, h = e.reg("b", j), e.reg("h", j)
        if bf16:  # bf16 is the top half of an fp32
            e.lines([f"cvt.u32.u16 {b}, {h};", f"shl.b32 {b}, {b}, 16;"])
        else:
            e.line(f"cvt.f32.f16 {b}, {h};")
        return
    for w in range(vec // 2):
        x = e.reg("x", j * (vec // 2) + w)
        lo, hi = e.reg("b", j * vec + 2 * w), e.reg("b", j * vec + 2 * w + 1)
        if bf16:
            e.lines([f"shl.b32 {lo}, {x}, 16;", f"and.b32 {hi}, {x}, -65536;"])
        else:
            hl, hh = e.reg("h", 2 * (j * (vec // 2) + w)), e.reg("h", 2 * (j * (vec // 2) + w) + 1)
            e.lines([f"mov.b32 {{{hl}, {hh}}}, {x};", f"cvt.f32.f16 {lo}, {hl};", f"cvt.f32.f16 {hi}, {hh};"])


def _acc(e: Emitter, slot: int, v: int, vec: int) -> str:
    return e.reg("a", slot * vec + v)


def _emit_accumulate(e: Emitter, plan: Plan, group: RowGroup, operand, k0: int, k1: int, base: int = 0) -> None:
    """Software-pipelined: the reads of batch i+1 are issued before the FMAs of batch i. base: the group's
    first accumulator slot (runs keep several groups' accumulators in one function)."""
    vec, depth = _vec(plan), plan.config.load_batch
    columns = [c for c in group.columns if k0 <= c.k < k1]
    batches = [columns[i:i + depth] for i in range(0, len(columns), depth)]
    for column_index, column in enumerate(batches[0] if batches else []):
        _emit_load(e, plan, operand, column.k, column_index)
    for i, batch in enumerate(batches):
        if i + 1 < len(batches):
            for offset, column in enumerate(batches[i + 1]):
                _emit_load(e, plan, operand, column.k, (i + 1) * depth + offset)
        for offset, column in enumerate(batch):
            j = i * depth + offset
            _emit_widen(e, plan, j)
            for slot, weight in column.uses:
                imm = f32_immediate(weight)
                for v in range(vec):
                    a = _acc(e, base + slot, v, vec)
                    e.line(f"fma.rn.f32 {a}, {e.reg('b', j * vec + v)}, {imm}, {a};")


def _emit_init(e: Emitter, plan: Plan, group: RowGroup, base: int = 0) -> None:
    vec = _vec(plan)
    for slot, row in enumerate(group.rows):
        start = f32_immediate(plan.bias[row] if plan.bias is not None and group.segment == 0 else 0.0)
        for v in range(vec):
            e.line(f"mov.b32 {_acc(e, base + slot, v, vec)}, {start};")


def _pieces(e: Emitter, plan: Plan, group: RowGroup, out: Output, base: int) -> list[tuple[list[str], int]]:
    """The group's sums as (accumulators adjacent in the output, byte offset of the first from the thread's
    output base), each piece one vector store (or residual load). Columns adjacent (column_stride = es:
    kn, NCHW, or NHWC with one output channel): a row's vec columns. Else: per column, the runs of rows
    plan.store_runs names (rows adjacent, aligned)."""
    vec, es = _vec(plan), plan.element_bytes
    if out.column_stride == es:
        return [([_acc(e, base + slot, v, vec) for v in range(vec)], row * out.row_stride)
                for slot, row in enumerate(group.rows)]
    return [([_acc(e, base + first + i, v, vec) for i in range(count)],
             group.rows[first] * out.row_stride + v * out.column_stride)
            for v in range(vec) for first, count in plan.store_runs(group)]


def _emit_atomic_add(e: Emitter, plan: Plan, group: RowGroup, out: Output, base: int = 0) -> None:
    """A split group's partial sums added into the (zeroed) output: fp32 one value at a time, 16-bit types
    as packed pairs where a piece holds two neighbouring elements (f16x2 / bf16x2), else singly."""
    es = plan.element_bytes
    kind = {"float16": "f16", "bfloat16": "bf16"}.get(plan.dtype)
    cvt = "cvt.rn.bf16.f32" if plan.dtype == "bfloat16" else "cvt.rn.f16.f32"
    e.comment(f"rows {_rows_text(group.rows)} are split ({group.segment + 1} of {group.segments}): add, not store")
    for accs, offset in _pieces(e, plan, group, out, base):
        if es == 4:
            e.lines([f"@%pv red.global.add.f32 {out.bases.address(offset + i * es)}, {a};"
                     for i, a in enumerate(accs)])
            continue
        halves = [e.reg("o", i) for i in range(len(accs))]
        e.lines([f"{cvt} {h}, {a};" for h, a in zip(halves, accs)])
        if len(accs) == 1:
            e.line(f"@%pv red.global.add.noftz.{kind} {out.bases.address(offset)}, {halves[0]};")
            continue
        for i in range(len(accs) // 2):
            word = e.reg("w", i)
            e.lines([f"mov.b32 {word}, {{{halves[2 * i]}, {halves[2 * i + 1]}}};",
                     f"@%pv red.global.add.noftz.{kind}x2 {out.bases.address(offset + 2 * i * es)}, {word};"])


_WORDS = {1: "b32", 2: "v2.b32", 4: "v4.b32"}  # a vector of 32-bit words, by count


def _emit_residual(e: Emitter, plan: Plan, accs: list[str], address: str) -> None:
    """Add the residual's len(accs) adjacent values at `address` into the accumulators (one vector load, up
    to 16 bytes). A plain (coherent) load: the residual may be the output itself (an in-place add), each
    element read before this thread writes it."""
    vec, es = len(accs), plan.element_bytes
    if es == 4:
        regs = [e.reg("q", v) for v in range(vec)]
        e.line(f"@%pv ld.global.{_WORDS[vec]} {regs[0] if vec == 1 else '{' + ', '.join(regs) + '}'}, {address};")
    elif vec == 1:
        half, regs = e.reg("qh", 0), [e.reg("q", 0)]
        e.line(f"@%pv ld.global.b16 {half}, {address};")
        widen(e, plan.dtype, regs[0], half)
    else:
        words = [e.reg("qw", i) for i in range(vec // 2)]
        e.line(f"@%pv ld.global.{_WORDS[vec // 2]} "
               f"{words[0] if len(words) == 1 else '{' + ', '.join(words) + '}'}, {address};")
        regs = [e.reg("q", v) for v in range(vec)]
        for i, word in enumerate(words):
            lo, hi = regs[2 * i], regs[2 * i + 1]
            if plan.dtype == "bfloat16":  # bf16 is the top half of an fp32
                e.lines([f"shl.b32 {lo}, {word}, 16;", f"and.b32 {hi}, {word}, -65536;"])
            else:
                hl, hh = e.reg("qh", 2 * i), e.reg("qh", 2 * i + 1)
                e.lines([f"mov.b32 {{{hl}, {hh}}}, {word};", f"cvt.f32.f16 {lo}, {hl};", f"cvt.f32.f16 {hi}, {hh};"])
    e.lines([f"add.f32 {a}, {a}, {q};" for a, q in zip(accs, regs)])


def _emit_store(e: Emitter, plan: Plan, group: RowGroup, out: Output, base: int = 0) -> None:
    es = plan.element_bytes
    if group.partial:
        _emit_atomic_add(e, plan, group, out, base)
        return
    for accs, offset in _pieces(e, plan, group, out, base):
        count = len(accs)
        if out.residual:
            _emit_residual(e, plan, accs, out.residual.address(offset))
        if plan.relu:
            e.lines([f"max.NaN.f32 {a}, {a}, 0f00000000;" for a in accs])  # NaN stays NaN, as in torch.relu
        address = out.bases.address(offset)
        if es == 4:
            values = accs[0] if count == 1 else "{" + ", ".join(accs) + "}"
            e.line(f"@%pv st.global.{_WORDS[count]} {address}, {values};")
            continue
        cvt = "cvt.rn.bf16.f32" if plan.dtype == "bfloat16" else "cvt.rn.f16.f32"
        halves = [e.reg("o", i) for i in range(count)]
        e.lines([f"{cvt} {h}, {a};" for h, a in zip(halves, accs)])
        if count == 1:
            e.line(f"@%pv st.global.b16 {address}, {halves[0]};")
            continue
        words = [e.reg("w", i) for i in range(count // 2)]
        e.lines([f"mov.b32 {w}, {{{halves[2 * i]}, {halves[2 * i + 1]}}};" for i, w in enumerate(words)])
        values = words[0] if len(words) == 1 else "{" + ", ".join(words) + "}"
        e.line(f"@%pv st.global.{_WORDS[count // 2]} {address}, {values};")


def _declare(e: Emitter) -> list[str]:
    return [f".reg .{_REG_KINDS[prefix]} %{prefix}<{top + 1}>;" for prefix, top in sorted(e.max_index.items())]


def _section(plan: Plan, g: int, ci: int, k0: int, k1: int, operand, out: Output, first: bool,
             last: bool) -> tuple[str, str, list[str]]:
    """(function text, its .extern declaration, call-site lines) for group g on chunk ci."""
    group, vec = plan.groups[g], _vec(plan)
    name, n_acc = f"{plan.name}_g{g}_c{ci}", len(plan.groups[g].rows) * vec
    e = Emitter()
    piece = f" (piece {group.segment + 1} of {group.segments})" if group.partial else ""
    e.comment(f"group {g}: rows {_rows_text(group.rows)}{piece}; k {k0}..{k1 - 1}; {group.nnz} nonzeros and "
              f"{len(group.columns)} distinct k in all chunks")
    operand.section_prologue(e)
    if last:
        out.section_prologue(e)
        e.lines(["ld.param.b32 %rt0, [p_v];", "setp.ne.u32 %pv, %rt0, 0;"])
    if first:
        _emit_init(e, plan, group)
    else:
        e.lines([f"ld.param.b32 {_acc(e, j // vec, j % vec, vec)}, [acc_in+{4 * j}];" for j in range(n_acc)])
    _emit_accumulate(e, plan, group, operand, k0, k1)
    if last:
        _emit_store(e, plan, group, out)
    else:
        e.lines([f"st.param.b32 [acc_out+{4 * j}], {_acc(e, j // vec, j % vec, vec)};" for j in range(n_acc)])
    e.line("ret;")
    params = ([] if first else [f".param .align 16 .b8 acc_in[{4 * n_acc}]"])
    params.append(".param .b32 p_s" if operand.staged else ".param .b64 p_b")
    if last:
        params += out.params + [".param .b32 p_v"]
    ret = "" if last else f"(.param .align 16 .b8 acc_out[{4 * n_acc}]) "
    text, extern = _function(e, f"{ret}{name}({', '.join(params)})", operand, out, last)
    return text, extern, _call_site(name, n_acc, first, last, operand.staged, out)


def _inline_section(plan: Plan, g: int, operand, out: Output) -> Emitter:
    """Group g's code inline in the kernel (config.inline): the body _section would put in a function,
    reading the thread's B base and output base from the entry's registers."""
    group = plan.groups[g]
    e = Emitter()
    e.comment(f"group {g}: rows {_rows_text(group.rows)}; {group.nnz} nonzeros, {len(group.columns)} distinct k")
    operand.bases.emit(e, ["mov.u64 %rdb0, %rdb;"])
    e.line("setp.ne.u32 %pv, %rvalid, 0;")
    _emit_init(e, plan, group)
    _emit_accumulate(e, plan, group, operand, 0, plan.K)
    _emit_store(e, plan, group, out)
    return e


def _function(e: Emitter, header: str, operand, out: Output, stores: bool) -> tuple[str, str]:
    """(text, .extern declaration) of a .func with body e."""
    wide = (out.registers if stores else []) + ([] if operand.staged else operand.bases.registers)
    regs = [".reg .pred %pv;", ".reg .b32 %rt0, %rs0;"] + ([".reg .b64 " + ", ".join(wide) + ";"] if wide else [])
    text = "\n".join([f".visible .func {header}", "{"] + ["    " + r for r in regs + _declare(e)] + [e.text(), "}", ""])
    return text, f".extern .func {header};"


def _run_function(plan: Plan, r: int, operand, out: Output) -> tuple[str, str, list[str]]:
    """(function text, its .extern declaration, call-site lines) for run r (kn, chunk_k): the run's groups
    inline in one function, chunk-outer and group-inner, so a chunk's B rows are read by every group of
    the run back to back (L1 hits) while all the run's accumulators stay in registers. (Calling a function
    per (group, chunk) instead, accumulators passed through .param, measured 2.4-3.3x slower on the H200.)"""
    run, vec = plan.config.groups_per_block, _vec(plan)
    members = list(range(r * run, min(r * run + run, len(plan.groups))))
    width = max(len(g.rows) for g in plan.groups)  # accumulator slots per group
    name = f"{plan.name}_run{r}"
    e = Emitter()
    e.comment(f"run {r}: groups {members[0]}..{members[-1]}, {sum(plan.groups[g].nnz for g in members)} nonzeros")
    operand.section_prologue(e)
    out.section_prologue(e)
    e.lines(["ld.param.b32 %rt0, [p_v];", "setp.ne.u32 %pv, %rt0, 0;"])
    for i, g in enumerate(members):
        _emit_init(e, plan, plan.groups[g], i * width)
    for k0, k1 in operand.chunks():
        for i, g in enumerate(members):
            group = plan.groups[g]
            if any(k0 <= c.k < k1 for c in group.columns):
                e.comment(f"group {g}: rows {_rows_text(group.rows)}; k {k0}..{k1 - 1}")
                _emit_accumulate(e, plan, group, operand, k0, k1, i * width)
    for i, g in enumerate(members):
        _emit_store(e, plan, plan.groups[g], out, i * width)
    e.line("ret;")
    params = ", ".join([".param .b64 p_b"] + out.params + [".param .b32 p_v"])
    text, extern = _function(e, f"{name}({params})", operand, out, True)
    return text, extern, _call_site(name, len(plan.groups[members[0]].rows) * vec, True, True, False, out)


def _call_site(name: str, n_acc: int, first: bool, last: bool, staged: bool, out: Output) -> list[str]:
    if staged:
        lines, args = ["{", ".param .b32 p_s;", "st.param.b32 [p_s], %rs0;"], ["p_s"]
    else:
        lines, args = ["{", ".param .b64 p_b;", "st.param.b64 [p_b], %rdb;"], ["p_b"]
    if not first:
        lines += [f".param .align 16 .b8 acc_in[{4 * n_acc}];"]
        lines += [f"st.param.b32 [acc_in+{4 * j}], %a{j};" for j in range(n_acc)]
        args = ["acc_in"] + args
    if last:
        stores, names = out.call_lines()
        lines += stores + [".param .b32 p_v;", "st.param.b32 [p_v], %rvalid;"]
        args += names + ["p_v"]
        lines.append(f"call.uni {name}, ({', '.join(args)});")
    else:
        lines += [f".param .align 16 .b8 acc_out[{4 * n_acc}];", f"call.uni (acc_out), {name}, ({', '.join(args)});"]
        lines += [f"ld.param.b32 %a{j}, [acc_out+{4 * j}];" for j in range(n_acc)]
    return lines + ["}"]


# -- the entry -------------------------------------------------------------------------------------
def _output_bases(plan: Plan) -> tuple[Output, list[str]]:
    """The output's (and residual's) base registers with the byte strides between output rows of W and
    between the thread's columns (plan.output_strides), and the lines computing the output's: the batch
    entry's M*N elements in, then the thread's first column."""
    es, (rows, columns) = plan.element_bytes, plan.output_strides
    column = "cvt.u64.u32 %rdt1, %rn;" if columns == 1 else f"mul.wide.u32 %rdt1, %rn, {columns};"
    base = [f"mul.lo.u64 %rdt0, %rdz, {plan.M * plan.N};", column,
            "add.u64 %rdt0, %rdt0, %rdt1;", f"mad.lo.u64 %rdc0, %rdt0, {es}, %rdC;"]
    reach = [plan.M * rows * es, _vec(plan) * columns * es]  # the farthest offsets from the thread's base
    residual = RegionBases("rdr", reach) if getattr(plan, "residual", False) else None
    return Output(RegionBases("rdc", reach), rows * es, columns * es, residual), base


def _emit_prologue(e: Emitter, plan: Plan, operand, out: Output, out_lines: list[str]) -> None:
    cfg, vec = plan.config, _vec(plan)
    e.lines([
        "ld.param.u64 %rdB, [param_b];", "ld.param.u64 %rdC, [param_c];",
        "cvta.to.global.u64 %rdB, %rdB;", "cvta.to.global.u64 %rdC, %rdC;",
        "mov.u32 %rtid, %tid.x;", "shr.u32 %rwarp, %rtid, 5;", "and.b32 %rlane, %rtid, 31;",
        "mov.u32 %rt0, %ctaid.z;", "cvt.u64.u32 %rdz, %rt0;", "mov.u32 %rt0, %ctaid.x;",
    ])
    if operand.staged:
        e.lines(["mov.u32 %rt1, %ctaid.y;", f"mad.lo.u32 %rgid, %rt1, {cfg.warps_per_block}, %rwarp;",
                 f"min.u32 %rgid, %rgid, {len(plan.groups)};", "shl.b32 %rn0, %rt0, 5;", "add.u32 %rn, %rn0, %rlane;",
                 f"setp.lt.u32 %ptok, %rn, {plan.N};", "selp.u32 %rvalid, 1, 0, %ptok;"])
        e.comment("every thread stays to the end: the staging barriers need the whole block")
    else:
        e.comment("this thread's first column; threads past N leave (no barriers in this layout)")
        e.lines([f"mad.lo.u32 %rt1, %rt0, {cfg.threads}, %rtid;", f"mul.lo.u32 %rn, %rt1, {vec};",
                 f"setp.ge.u32 %pt, %rn, {plan.N};", "@%pt bra DONE;", "mov.u32 %rvalid, 1;",
                 "mov.u32 %rt1, %ctaid.y;", f"mul.lo.u32 %rgid, %rt1, {cfg.groups_per_block};",
                 f"add.u32 %rgend, %rgid, {cfg.groups_per_block};", f"min.u32 %rgend, %rgend, {len(plan.groups)};"])
    operand.prologue(e)
    e.comment("output base for this thread")
    out.bases.emit(e, out_lines)
    if out.residual:
        e.comment("the residual's, at the same offset from its own base")
        out.residual.emit(e, ["ld.param.u64 %rdt0, [param_r];", "cvta.to.global.u64 %rdt0, %rdt0;",
                              "sub.s64 %rdr0, %rdc0, %rdC;", "add.s64 %rdr0, %rdr0, %rdt0;"])


def _pack(functions: list[str], preamble: list[str]) -> list[str]:
    modules, current, size = [], [], 0
    for text in functions:
        current.append(text)
        size += text.count("\n")
        if size >= MODULE_INSTRUCTIONS:
            modules.append("\n".join(preamble + current))
            current, size = [], 0
    if current:
        modules.append("\n".join(preamble + current))
    return modules


def _entry_one_pass(entry: Emitter, plan: Plan, operand, sections) -> None:
    """Staged (nk): each warp its group, chunk by chunk. Direct (kn, one chunk): the block's groups in turn."""
    chunks = operand.chunks()
    if not operand.staged:
        entry.label("NEXT_GROUP")
        entry.lines(["setp.ge.u32 %pt, %rgid, %rgend;", "@%pt bra DONE;"])
    for ci, (k0, k1) in enumerate(chunks):
        operand.stage(entry, k0, k1)
        targets = [f"G{g}_C{ci}" for g in range(len(plan.groups))] + ([f"JOIN_C{ci}"] if operand.staged else [])
        entry.line(f"TABLE_C{ci}: .branchtargets {', '.join(targets)};")
        entry.line(f"brx.idx %rgid, TABLE_C{ci};")
        for g in range(len(plan.groups)):
            entry.label(f"G{g}_C{ci}")
            entry.lines(sections(g, ci, k0, k1, ci == 0, ci == len(chunks) - 1))
            entry.line(f"bra.uni JOIN_C{ci};")
        entry.label(f"JOIN_C{ci}")
    if not operand.staged:
        entry.lines(["add.u32 %rgid, %rgid, 1;", "bra.uni NEXT_GROUP;"])


def _entry_runs(entry: Emitter, plan: Plan, runs) -> None:
    """kn with chunk_k: block y runs run y (groups y*G .. y*G+G-1), one function per run."""
    count = -(-len(plan.groups) // plan.config.groups_per_block)
    entry.line("mov.u32 %rt1, %ctaid.y;")
    entry.line(f"TABLE_R: .branchtargets {', '.join(f'R{r}' for r in range(count))};")
    entry.line("brx.idx %rt1, TABLE_R;")
    for r in range(count):
        entry.label(f"R{r}")
        entry.lines(runs(r))
        entry.line("bra.uni DONE;")


def render(plan: Plan) -> KernelSource:
    """PTX of the kernel `plan.name` (parameters: B or X pointer, C or Y pointer), as linkable modules."""
    operand = operand_for(plan)
    out, out_lines = _output_bases(plan)
    entry = Emitter()
    _emit_prologue(entry, plan, operand, out, out_lines)
    functions, externs = [], []

    def sections(g, ci, k0, k1, first, last):
        if plan.config.inline:
            entry.extend(_inline_section(plan, g, operand, out))
            return []
        text, extern, call = _section(plan, g, ci, k0, k1, operand, out, first, last)
        functions.append(text)
        externs.append(extern)
        return call

    def runs(r):
        text, extern, call = _run_function(plan, r, operand, out)
        functions.append(text)
        externs.append(extern)
        return call

    if not operand.staged and len(operand.chunks()) > 1:
        _entry_runs(entry, plan, runs)
    else:
        _entry_one_pass(entry, plan, operand, sections)
    entry.label("DONE")
    entry.line("ret;")
    accs = max((len(g.rows) for g in plan.groups), default=1) * _vec(plan)
    entry.max_index.pop("a", None)  # inline groups name accumulators too; declared once below
    inline_bases = operand.bases.registers if plan.config.inline else []
    preamble = [f".version {PTX_VERSION}", f".target sm_{plan.arch}", ".address_size 64", ""]
    head = [f"// sparseforge generated kernel: {plan.name}",
            f"// W {plan.M}x{plan.K}, nnz {plan.nnz}, N {plan.N}, layout {plan.layout}, {plan.dtype} in, fp32 accumulate",
            *preamble] + ([f".shared .align 16 .b8 stage[{operand.stage_bytes}];", ""] if operand.staged else [""])
    decl = [".reg .pred %pt, %pv, %ptok, %prow;",
            ".reg .b32 %rtid, %rwarp, %rlane, %rgid, %rn, %rn0, %rt0, %rt1, %rt3, %rsb, %rs0, %rsw, %rvalid, "
            "%rgend;",
            ".reg .b64 " + ", ".join(["%rdB", "%rdC", "%rdz", "%rdt0", "%rdt1", "%rdb"] + operand.global_bases.registers
                                     + out.registers + inline_bases) + ";",
            f".reg .b32 %a<{accs}>;"] + _declare(entry)
    params = ["param_b", "param_c"] + (["param_r"] if out.residual else [])
    entry_text = [f".visible .entry {plan.name}(", ",\n".join(f"    .param .u64 {n}" for n in params), ")",
                  f".maxntid {plan.config.threads}, 1, 1", "{"] + ["    " + d for d in decl] + [entry.text(), "}", ""]
    entry_module = "\n".join(head + externs + [""] + entry_text)
    return KernelSource(plan.name, (entry_module, *_pack(functions, preamble)), operand.stage_bytes)


def _rows_text(rows: tuple[int, ...]) -> str:
    if len(rows) > 1 and rows == tuple(range(rows[0], rows[-1] + 1)):
        return f"{rows[0]}..{rows[-1]}"
    return ", ".join(map(str, rows))
