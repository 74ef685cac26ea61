"""Lowering target: the delta-runs decode kernel (plan.py). Pure: render_delta_runs(plan) -> PTX.

Parameters: X (kn: [batch,] K x N; nk: [batch,] N x K), C ([batch,] M x N or N x M), values (the kernel's
dtype), gaps (uint32 a slot), rows (int32 pairs: first slot, slots), bases (uint16 [M, 32]), bias (fp32, or
null), then the residual where the plan adds one.

1. Every thread of the block copies pieces of X into shared memory as [K][Np] (16-byte loads where K allows,
   the loads of a batch issued before their stores; fp32 where it fits and the config's x_bits allow, else
   16-bit), then a barrier.
2. Warp w of block b takes row b * warps + w (rows past M leave); in a persistent grid (ctas blocks), then rows
   b * warps + w + j * ctas * warps, the next row's record loaded while a row is summed. Lane l reads the row's
   (first slot, slots) and its run's base column, and walks slots l, l + 32, ... of its run: `ahead` slots a
   group, the next group's loads (one 32-bit gap word, one 8- or 16-byte load of values a slot) issued before
   the current group is summed (two register sets, the loop unrolled twice). Past its run a lane reloads its
   last slot and adds nothing (predicated), so no branch holds a load back.
3. A slot's entry e: column += gap e of the gap word (8 or 4 bits); the column's Np X values with one shared load; the
   value widened; an fma a column (N = 1: into one of two fp32 sums, even / odd entries, for two chains).
4. A fixed-order butterfly a column adds the lanes (deterministic, no atomics); lane 0 adds bias and the
   residual, applies ReLU (max.NaN) and stores.

A gated kernel (the Llama MLP's gate and up projections, plan.gate: the gate's format, parameters p_g*) walks
the warp's row of the gate first, keeps its butterflied sums, walks the same row of the up projection over the
same staged X, and stores silu(gate) * up: one launch and one copy of X where the model makes two GEMVs and
two elementwise kernels.
"""
from __future__ import annotations

from .plan import DeltaRunsPlan
from ...plan.config import WARP
from ...codegen.emitter import Emitter, silu_times, widen
from ...codegen.ptx import KernelSource, data_kernel

STAGE_BATCH = 4     # 16-byte pieces of X a thread loads before it stores them
ELEMENT_BATCH = 8   # single elements likewise, where K does not allow 16-byte pieces


def _widen_pair(e: Emitter, dtype: str, lo: str, hi: str, word: str) -> None:
    """fp32 registers lo, hi from a 32-bit word holding two 16-bit values (lo: the low half)."""
    if dtype == "bfloat16":
        e.lines([f"shl.b32 {lo}, {word}, 16;", f"and.b32 {hi}, {word}, -65536;"])
    else:
        e.lines([f"mov.b32 {{%h0, %h1}}, {word};", f"cvt.f32.f16 {lo}, %h0;", f"cvt.f32.f16 {hi}, %h1;"])


def _stage_x(e: Emitter, plan: DeltaRunsPlan) -> None:
    """X into shared memory as [K][Np], x_bytes a value. 16-byte pieces along X's contiguous dimension where its
    bytes allow (N = 1, or kn with N = Np: the same layout, copied as it is; nk: 8 k of one column, stored to
    their 8 places), else value by value; a batch of loads before its stores."""
    es, xb, threads, k, n, npad = plan.element_bytes, plan.x_bytes, plan.config.threads, plan.K, plan.N, plan.n_pad
    per = 16 // es
    straight = (plan.layout == "kn" or n == 1) and n == npad and (k * n * es) % 16 == 0
    if straight or (plan.layout == "nk" and (k * es) % 16 == 0):
        pieces = k * n // per
        passes = -(-pieces // threads)
        e.comment(f"stage X as [K][{npad}]: {pieces} pieces of {per} values over {threads} threads")
        e.lines(["mul.wide.u32 %rdt, %rtid, 16;", "add.s64 %rdq, %rdb, %rdt;"])
        for start in range(0, passes, STAGE_BATCH):
            batch = range(start, min(passes, start + STAGE_BATCH))
            for i in batch:
                j = i % STAGE_BATCH
                regs = ", ".join(f"%st{4 * j + r}" for r in range(4))
                e.lines([f"add.u32 %sp{j}, %rtid, {i * threads};", f"setp.lt.u32 %ps{j}, %sp{j}, {pieces};",
                         f"@%ps{j} ld.global.nc.v4.b32 {{{regs}}}, [%rdq+{i * threads * 16}];"])
            for i in batch:
                j = i % STAGE_BATCH
                words = [f"%st{4 * j + r}" for r in range(4)]
                if straight:  # X's bytes in order: smem offset piece * per * xb
                    e.line(f"mad.lo.u32 %rsq, %sp{j}, {per * xb}, %rsx;")
                    if xb == 2:
                        e.line(f"@%ps{j} st.shared.v4.b32 [%rsq], {{{', '.join(words)}}};")
                    else:
                        f = [f"%x{r}" for r in range(8)]
                        for r in range(4):
                            _widen_pair(e, plan.dtype, f[2 * r], f[2 * r + 1], words[r])
                        e.lines([f"@%ps{j} st.shared.v4.f32 [%rsq], {{{', '.join(f[:4])}}};",
                                 f"@%ps{j} st.shared.v4.f32 [%rsq+16], {{{', '.join(f[4:])}}};"])
                    continue
                # nk: piece p holds k0..k0+7 of column c (p = c * K / 8 + k0 / 8): value j to (k0 + j) * Np + c
                e.lines([f"div.u32 %t, %sp{j}, {k // per};", f"rem.u32 %d, %sp{j}, {k // per};",
                         f"mul.lo.u32 %d, %d, {per * npad * xb};", f"mad.lo.u32 %d, %t, {xb}, %d;",
                         "add.u32 %rsq, %d, %rsx;"])
                for r in range(4):
                    if xb == 2:
                        e.lines([f"mov.b32 {{%h0, %h1}}, {words[r]};",
                                 f"@%ps{j} st.shared.b16 [%rsq+{2 * r * npad * xb}], %h0;",
                                 f"@%ps{j} st.shared.b16 [%rsq+{(2 * r + 1) * npad * xb}], %h1;"])
                    else:
                        _widen_pair(e, plan.dtype, "%x0", "%x1", words[r])
                        e.lines([f"@%ps{j} st.shared.f32 [%rsq+{2 * r * npad * xb}], %x0;",
                                 f"@%ps{j} st.shared.f32 [%rsq+{(2 * r + 1) * npad * xb}], %x1;"])
    else:
        values = k * n
        passes = -(-values // threads)
        e.comment(f"stage X as [K][{npad}]: {values} values over {threads} threads")
        e.lines([f"mul.wide.u32 %rdt, %rtid, {es};", "add.s64 %rdq, %rdb, %rdt;"])
        for start in range(0, passes, ELEMENT_BATCH):
            batch = range(start, min(passes, start + ELEMENT_BATCH))
            for i in batch:
                j = i % ELEMENT_BATCH
                e.lines([f"add.u32 %sp{j}, %rtid, {i * threads};", f"setp.lt.u32 %pe{j}, %sp{j}, {values};",
                         f"@%pe{j} ld.global.nc.b16 %hs{j}, [%rdq+{i * threads * es}];"])
            for i in batch:
                j = i % ELEMENT_BATCH
                # value v of X: kn (k, c) = (v / N, v % N); nk (c, k) = (v / K, v % K)
                kk, cc = ("%t", "%d") if plan.layout == "kn" else ("%d", "%t")
                e.lines([f"div.u32 %t, %sp{j}, {n if plan.layout == 'kn' else k};",
                         f"rem.u32 %d, %sp{j}, {n if plan.layout == 'kn' else k};",
                         f"mul.lo.u32 {kk}, {kk}, {npad * xb};", f"mad.lo.u32 %rsq, {cc}, {xb}, {kk};",
                         "add.u32 %rsq, %rsq, %rsx;"])
                if xb == 2:
                    e.line(f"@%pe{j} st.shared.b16 [%rsq], %hs{j};")
                else:
                    widen(e, plan.dtype, "%x0", f"%hs{j}")
                    e.line(f"@%pe{j} st.shared.f32 [%rsq], %x0;")
    e.line("bar.sync 0;")


def _value_words(plan: DeltaRunsPlan, s: int, u: int) -> list[str]:
    """Register set s's 32-bit words of slot u's values (two 16-bit values each)."""
    return [f"%v{s}_{u}_{r}" for r in range(plan.format.per_slot // 2)]


def _load_group(e: Emitter, plan: DeltaRunsPlan, s: int, first: str, guard: str) -> None:
    """Register set s: the `ahead` slots from slot `first` of the lane's run (clamped to its last slot)."""
    per = plan.format.per_slot
    for u in range(plan.config.ahead):
        words = _value_words(plan, s, u)
        e.lines([f"add.u32 %t, {first}, {u};", "min.u32 %t, %t, %nm1;",
                 f"mul.wide.u32 %rdt, %t, {WARP * 4};", "add.s64 %rdq, %rdg, %rdt;",
                 f"{guard}ld.global.nc.u32 %g{s}_{u}, [%rdq];",
                 f"mul.wide.u32 %rdt, %t, {WARP * per * plan.element_bytes};", "add.s64 %rdq, %rdv, %rdt;",
                 f"{guard}ld.global.nc.v{len(words)}.b32 {{{', '.join(words)}}}, [%rdq];"])


def _sum_group(e: Emitter, plan: DeltaRunsPlan, s: int, first: str) -> None:
    """Register set s's slots into the sums, each predicated on lying within the lane's run."""
    n, npad, xb, bits = plan.N, plan.n_pad, plan.x_bytes, plan.format.gap_bits
    for u in range(plan.config.ahead):
        e.lines([f"add.u32 %t, {first}, {u};", "setp.lt.u32 %pl, %t, %n;"])
        for r, word in enumerate(_value_words(plan, s, u)):
            _widen_pair(e, plan.dtype, f"%w{2 * r}", f"%w{2 * r + 1}", word)
        for q in range(plan.format.per_slot):
            e.lines([f"bfe.u32 %d, %g{s}_{u}, {bits * q}, {bits};", f"@%pl mad.lo.u32 %xa, %d, {npad * xb}, %xa;"])
            if n == 1:
                acc = "%acc0" if q % 2 == 0 else "%acc1"
                if xb == 4:
                    e.line(f"@%pl ld.shared.f32 %x{q}, [%xa];")
                else:
                    e.line(f"@%pl ld.shared.b16 %hq{q}, [%xa];")
                    widen(e, plan.dtype, f"%x{q}", f"%hq{q}")
                e.line(f"@%pl fma.rn.f32 {acc}, %w{q}, %x{q}, {acc};")
                continue
            _load_column_values(e, plan)
            e.lines([f"@%pl fma.rn.f32 %acc{c}, %w{q}, %x{c}, %acc{c};" for c in range(n)])


def _write_group(e: Emitter, plan: DeltaRunsPlan, s: int, first: str) -> None:
    """Register set s's slots written into W dense (plan.writes_dense): each entry of the lane's run whose
    value is not +0 (fillers and padding are) stored at (row, column); %xa counts the column in bytes."""
    bits = plan.format.gap_bits
    for u in range(plan.config.ahead):
        e.lines([f"add.u32 %t, {first}, {u};", "setp.lt.u32 %pl, %t, %n;"])
        words = _value_words(plan, s, u)
        for q in range(plan.format.per_slot):
            half = f"%h{q % 2}"
            if q % 2 == 0:
                e.line(f"mov.b32 {{%h0, %h1}}, {words[q // 2]};")
            e.lines([f"bfe.u32 %d, %g{s}_{u}, {bits * q}, {bits};", "@%pl mad.lo.u32 %xa, %d, 2, %xa;",
                     f"setp.ne.b16 %pt, {half}, 0;", "and.pred %pt, %pt, %pl;",
                     "cvt.u64.u32 %rdt, %xa;", "add.s64 %rdt, %rdc, %rdt;", f"@%pt st.global.b16 [%rdt], {half};"])


def _load_column_values(e: Emitter, plan: DeltaRunsPlan) -> None:
    """The Np staged X values of the column at %xa into %x0.. (fp32), with one or two shared loads."""
    npad, xb = plan.n_pad, plan.x_bytes
    if xb == 4:
        for half in range(0, npad, 4):
            regs = [f"%x{c}" for c in range(half, min(npad, half + 4))]
            kind = {1: "f32", 2: "v2.f32", 4: "v4.f32"}[len(regs)]
            target = regs[0] if len(regs) == 1 else "{" + ", ".join(regs) + "}"
            e.line(f"@%pl ld.shared.{kind} {target}, [%xa+{half * 4}];" if half else
                   f"@%pl ld.shared.{kind} {target}, [%xa];")
        return
    words = [f"%xw{r}" for r in range(npad // 2)]
    kind = {1: "b32", 2: "v2.b32", 4: "v4.b32"}[len(words)]
    target = words[0] if len(words) == 1 else "{" + ", ".join(words) + "}"
    e.line(f"@%pl ld.shared.{kind} {target}, [%xa];")
    for r, word in enumerate(words):
        if 2 * r < plan.N:
            _widen_pair(e, plan.dtype, f"%x{2 * r}", f"%x{2 * r + 1}", word)


def _accumulators(plan: DeltaRunsPlan) -> list[str]:
    """The registers holding a row's sums after _butterfly, a column each."""
    return ["%acc"] if plan.N == 1 else [f"%acc{c}" for c in range(plan.N)]


def _butterfly(e: Emitter, plan: DeltaRunsPlan) -> None:
    """Every lane's sums added over the warp, a column at a time: a fixed order of additions (the same result
    every run), every lane holding the totals."""
    e.comment("butterfly over the warp a column: a fixed order of additions, the same result every run")
    if plan.N == 1:
        e.line("add.f32 %acc, %acc0, %acc1;")
    for acc in _accumulators(plan):
        offset = WARP // 2
        while offset:
            e.lines([f"shfl.sync.bfly.b32 %f, {acc}, {offset}, 31, -1;", f"add.f32 {acc}, {acc}, %f;"])
            offset //= 2


def _epilogue(e: Emitter, plan: DeltaRunsPlan) -> None:
    es, n, m = plan.element_bytes, plan.N, plan.M
    _butterfly(e, plan)
    accs = _accumulators(plan)
    e.lines(["setp.ne.u32 %pt, %lane, 0;", f"@%pt bra {'NEXT' if plan.config.ctas else 'DONE'};"])
    if plan.gate is not None:  # the gated MLP's up projection: silu(G x) * (U x)
        for c, acc in enumerate(accs):
            silu_times(e, f"%gs{c}", acc)
    if plan.bias is not None:
        e.lines(["ld.param.u64 %rdt, [p_bias];", "cvta.to.global.u64 %rdt, %rdt;",
                 "mad.wide.u32 %rdt, %row, 4, %rdt;", "ld.global.nc.b32 %bias, [%rdt];"])
        e.lines([f"add.f32 {acc}, {acc}, %bias;" for acc in accs])
    # C[row, column] of this batch entry (kn: M x N; nk: N x M); the residual's alike
    row_stride, col_stride = (n * es, es) if plan.layout == "kn" else (es, m * es)
    e.lines([f"mul.lo.u64 %rdt, %rdz, {m * n * es};", f"mad.wide.u32 %rdt, %row, {row_stride}, %rdt;",
             "ld.param.u64 %rdc, [p_c];", "cvta.to.global.u64 %rdc, %rdc;", "add.s64 %rdc, %rdc, %rdt;"])
    if plan.residual:
        e.lines(["ld.param.u64 %rdr, [p_residual];", "cvta.to.global.u64 %rdr, %rdr;", "add.s64 %rdr, %rdr, %rdt;"])
    cvt = "cvt.rn.bf16.f32" if plan.dtype == "bfloat16" else "cvt.rn.f16.f32"
    for c, acc in enumerate(accs):
        if plan.residual:
            e.line(f"ld.global.b16 %hx, [%rdr+{c * col_stride}];")  # not .nc: C may be the residual itself
            widen(e, plan.dtype, "%f", "%hx")
            e.line(f"add.f32 {acc}, {acc}, %f;")
        if plan.relu:
            e.line(f"max.NaN.f32 {acc}, {acc}, 0f00000000;")
        e.lines([f"{cvt} %hx, {acc};", f"st.global.b16 [%rdc+{c * col_stride}], %hx;"])


def _load_record(e: Emitter, row: str, guard: str, first: str, slots: str, base: str, arrays: str = "p_") -> None:
    """Row `row`'s (first slot, slots) and this lane's run base column (16 bits), each load under `guard`, from
    the format whose parameters start with `arrays` (p_: W's; p_g: the gate's of a gated kernel)."""
    e.lines([f"ld.param.u64 %rdq, [{arrays}rows];", "cvta.to.global.u64 %rdq, %rdq;",
             f"mad.wide.u32 %rdq, {row}, 8, %rdq;", f"{guard}ld.global.nc.v2.u32 {{{first}, {slots}}}, [%rdq];",
             f"ld.param.u64 %rdq, [{arrays}bases];", "cvta.to.global.u64 %rdq, %rdq;",
             f"mad.lo.u32 %t, {row}, {WARP}, %lane;", "mad.wide.u32 %rdq, %t, 2, %rdq;",
             f"{guard}ld.global.nc.u16 {base}, [%rdq];"])


def _row_and_first_group(e: Emitter, plan: DeltaRunsPlan, guarded: bool, arrays: str = "p_", tag: str = "") -> None:
    """This warp's first row (its first slot and slots) and _start_run. guarded: every load predicated on the
    row being one of W's (%pv) and the run having a slot (%pf), which the caller tests after the block's
    barrier; else a row past M branches away here."""
    c = plan.config
    e.comment("this warp's row: its first slot and slots; this lane's run: its slots, base column, first slot")
    e.lines(["mov.u32 %t, %ctaid.y;", f"mad.lo.u32 %row, %t, {c.warps_per_block}, %warp;"])
    if guarded:
        e.line(f"setp.lt.u32 %pv, %row, {plan.M};")
    else:
        e.lines([f"setp.ge.u32 %pt, %row, {plan.M};", "@%pt bra DONE;"])
    _load_record(e, "%row", "@%pv " if guarded else "", "%qb", "%nq", "%hb", arrays)
    _start_run(e, plan, guarded, arrays, tag)


def _start_run(e: Emitter, plan: DeltaRunsPlan, guarded: bool, arrays: str = "p_", tag: str = "") -> None:
    """From the row's record (%qb, %nq, %hb): this lane's run (its slots, base column, first slot), the sums
    zeroed, the warp's next row's record requested (persistent blocks), and the run's first group of slots in
    register set 0. Unguarded, an empty run branches to SUMMED (after the next row's request: every lane needs
    it at NEXT)."""
    es = plan.element_bytes
    e.lines(["cvt.u32.u16 %t, %hb;",
             f"mad.lo.u32 %xa, %t, {2 if plan.writes_dense else plan.n_pad * plan.x_bytes}, %rsx;",
             "shr.u32 %n, %nq, 5;", f"and.b32 %t, %nq, {WARP - 1};", "setp.lt.u32 %pt, %lane, %t;",
             "selp.u32 %t, 1, 0, %pt;", "add.u32 %n, %n, %t;"]
            + (["@!%pv mov.u32 %n, 0;"] if guarded else [])
            + ["sub.u32 %nm1, %n, 1;", "add.u32 %t, %qb, %lane;",
               f"ld.param.u64 %rdg, [{arrays}gaps];", "cvta.to.global.u64 %rdg, %rdg;",
               "mad.wide.u32 %rdg, %t, 4, %rdg;", f"ld.param.u64 %rdv, [{arrays}values];",
               "cvta.to.global.u64 %rdv, %rdv;",
               f"mad.wide.u32 %rdv, %t, {plan.format.per_slot * es}, %rdv;",
               *[f"mov.f32 %acc{col}, 0f00000000;" for col in range(max(2, plan.N))], "mov.u32 %i, 0;"])
    if plan.config.ctas:  # the next row's record flies while this row is summed: no round trip between rows
        e.lines([f"add.u32 %rown, %row, {plan.grid[1] * plan.config.warps_per_block};",
                 f"setp.lt.u32 %pn, %rown, {plan.M};"])
        _load_record(e, "%rown", "@%pn ", "%qbn", "%nqn", "%hbn")
    if guarded:
        e.line("setp.ne.u32 %pf, %n, 0;")
        _load_group(e, plan, 0, "%i", "@%pf ")
    else:
        e.lines(["setp.eq.u32 %pt, %n, 0;", f"@%pt bra SUMMED{tag};"])
        _load_group(e, plan, 0, "%i", "")


def _walk(e: Emitter, plan: DeltaRunsPlan, tag: str) -> None:
    """The lane's run from its first group (register set 0, loaded) to its end, then the label SUMMED{tag}."""
    a = plan.config.ahead
    e.comment("the loop, unrolled twice: one register set's loads in flight while the other's slots are summed")
    e.label(f"LOOP{tag}")
    e.lines([f"add.u32 %in, %i, {a};", "setp.lt.u32 %p1, %in, %n;"])
    consume = _write_group if plan.writes_dense else _sum_group
    _load_group(e, plan, 1, "%in", "@%p1 ")
    consume(e, plan, 0, "%i")
    e.lines([f"@!%p1 bra SUMMED{tag};", f"add.u32 %i, %in, {a};", "setp.lt.u32 %p0, %i, %n;"])
    _load_group(e, plan, 0, "%i", "@%p0 ")
    consume(e, plan, 1, "%in")
    e.line(f"@%p0 bra LOOP{tag};")
    e.label(f"SUMMED{tag}")


def render_delta_runs(plan: DeltaRunsPlan) -> KernelSource:
    c, es = plan.config, plan.element_bytes
    a = c.ahead
    e = Emitter()
    first, tag = ("p_g", "g") if plan.gate is not None else ("p_", "")  # a gated kernel walks the gate's row first
    e.comment(f"a warp a row, lane l its run l; {c.warps_per_block} warps a block, {a} slots a group in flight")
    e.lines(["mov.u32 %rtid, %tid.x;", "and.b32 %lane, %rtid, 31;", "shr.u32 %warp, %rtid, 5;",
             "mov.u32 %t, %ctaid.z;", "cvt.u64.u32 %rdz, %t;",
             "ld.param.u64 %rdb, [p_b];", "cvta.to.global.u64 %rdb, %rdb;",
             f"mul.lo.u64 %rdt, %rdz, {plan.K * plan.N * es};", "add.s64 %rdb, %rdb, %rdt;"]
            + ([] if plan.writes_dense else ["mov.u32 %rsx, xs;"]))
    if plan.writes_dense:  # no X: the row of C is W's row r; %rsx 0, so %xa is the column in bytes
        e.lines(["mov.u32 %rsx, 0;", "ld.param.u64 %rdc, [p_c];", "cvta.to.global.u64 %rdc, %rdc;",
                 "mov.u32 %t, %ctaid.y;", f"mad.lo.u32 %t, %t, {c.warps_per_block}, %warp;",
                 f"mul.wide.u32 %rdt, %t, {plan.K * 2};", "add.s64 %rdc, %rdc, %rdt;"])
        _row_and_first_group(e, plan, guarded=False)
    elif c.overlap:  # the first row's first loads go out before X is staged: their round trip overlaps the copy
        _row_and_first_group(e, plan, guarded=True, arrays=first, tag=tag)
        _stage_x(e, plan)
        e.lines(["@!%pv bra DONE;", f"@!%pf bra SUMMED{tag};"])
    else:
        _stage_x(e, plan)
        _row_and_first_group(e, plan, guarded=False, arrays=first, tag=tag)
    if c.ctas:  # a persistent block's warp: its later rows start here, X already staged
        e.line("bra LOOP;")
        e.label("ROW")
        _start_run(e, plan, guarded=False)
    if plan.gate is not None:  # silu(G x) first: the gate's rows walked, summed and kept in %gs (every lane)
        _walk(e, plan, "g")
        _butterfly(e, plan)
        e.lines([f"mov.f32 %gs{col}, {acc};" for col, acc in enumerate(_accumulators(plan))])
        e.comment("then U x: the same row of the up projection's format")
        _load_record(e, "%row", "", "%qb", "%nq", "%hb")
        _start_run(e, plan, guarded=False)
    _walk(e, plan, "")
    if not plan.writes_dense:
        _epilogue(e, plan)
    if c.ctas:  # the warp's next row, its record already here
        e.label("NEXT")
        e.lines(["@!%pn bra DONE;", "mov.u32 %row, %rown;", "mov.u32 %qb, %qbn;", "mov.u32 %nq, %nqn;",
                 "mov.b16 %hb, %hbn;", "bra ROW;"])
    e.label("DONE")
    e.line("ret;")
    sets = [", ".join([f"%g{s}_{u}"] + _value_words(plan, s, u)) for s in range(2) for u in range(a)]
    decl = [".reg .pred %pt, %pl, %p0, %p1, %pv, %pf, %pn" + "".join(f", %ps{i}" for i in range(STAGE_BATCH))
            + "".join(f", %pe{i}" for i in range(ELEMENT_BATCH)) + ";",
            ".reg .b32 %rtid, %lane, %warp, %t, %row, %qb, %nq, %rown, %qbn, %nqn, %n, %nm1, %i, %in, %xa, %d, %f, %bias, %acc, "
            "%rsx, %rsq, " + ", ".join(sets + [f"%w{q}" for q in range(plan.format.per_slot)] + [f"%x{r}" for r in range(8)]
                                       + [f"%acc{c}" for c in range(max(2, plan.N))] + [f"%xw{r}" for r in range(4)]
                                       + [f"%gs{c}" for c in range(plan.N if plan.gate is not None else 0)]
                                       + [f"%sp{r}" for r in range(ELEMENT_BATCH)]
                                       + [f"%st{r}" for r in range(4 * STAGE_BATCH)]) + ";",
            ".reg .b16 %hx, %hb, %hbn, %h0, %h1" + "".join(f", %hs{i}" for i in range(ELEMENT_BATCH))
            + "".join(f", %hq{q}" for q in range(8)) + ";",
            ".reg .b64 %rdz, %rdt, %rdq, %rdb, %rdc, %rdr, %rdg, %rdv;"]
    # dynamic: the launch gives plan.dynamic_shared_bytes (X staged, over the 48 KB a static declaration may have)
    shared = "" if plan.writes_dense else ".extern .shared .align 16 .b8 xs[];"
    what = "W written dense from" if plan.writes_dense else \
        "gated MLP, silu(G x) * (U x), over" if plan.gate is not None else "decode GEMV over"
    return data_kernel(plan, f"{what} runs of {plan.format.gap_bits}-bit column gaps + values (W as data)",
                       ("p_b", "p_c", "p_values", "p_gaps", "p_rows", "p_bases")
                       + (("p_gvalues", "p_ggaps", "p_grows", "p_gbases") if plan.gate is not None else ())
                       + ("p_bias",)
                       + (("p_residual",) if plan.residual else ()), decl, e.text(), 0, shared)
