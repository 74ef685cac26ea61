"""The epilogue the tensor-core kernels share (tc-scatter, bitmap-tc): a block of warps on one strip of 16 rows,
each holding mma.m16n8k16 accumulators over its own range of K."""
from __future__ import annotations

from .emitter import Emitter, silu_times, widen

TILE = 16  # rows of a strip (an mma's M)


def strip_epilogue(e: Emitter, plan, accumulators: str = "%c", tag: str = "", gate: str | None = None) -> None:
    """After the walk: the warps' m16n8 accumulators ({accumulators}{n-tile}_{0..3}) meet in shared memory
    (`smem`, free by now), and each thread adds its outputs' partial sums in warp order (deterministic), then
    bias, residual, ReLU (max.NaN), rounding and the store. The kernel has %rtid, %warp, %g, %tq, %rs (strip),
    %rgx (column group) and %rdz (batch entry) set; plan: block_columns, n_tiles, config.warps_per_block. A
    kernel whose warps hold several strips emits one a strip, each with its own `tag` (its labels'). `gate`: a
    gated MLP's gate accumulators (the same strip of G): they meet beside the others (shared memory for both,
    plan.dynamic_shared_bytes), and the output is silu(G x) * (W x) (register %gacc). With config.k_split (one
    strip a block, %rks the block's part of K): each block stores its sums in the workspace (p_partials, fp32,
    k_split x M x N) and counts itself in (p_arrivals, a counter a strip, atom.inc: the last arrival wraps it to
    0); the last to arrive adds the parts in block order and finishes the strip. A plan whose warps each hold
    their own strip (plan.warp_strips: strip %rs + warp, %rby the block row; X as N x K) stores each warp's sums
    as its strip's, nothing added across warps."""
    c, es = plan.config, plan.element_bytes
    bc = plan.block_columns
    region = c.warps_per_block * TILE * bc * 4  # one set of the warps' partial sums
    e.comment("the warps' accumulators meet in shared memory (the tile buffers are free now), then each thread "
              "adds its outputs' partial sums in warp order")
    e.lines(["bar.sync 0;", "mov.u32 %t, smem;", f"mad.lo.u32 %o, %warp, {TILE}, %g;",
             f"mul.lo.u32 %o, %o, {bc};", "mad.lo.u32 %o, %tq, 2, %o;", "mad.lo.u32 %ad, %o, 4, %t;"])
    for base, prefix in ((0, accumulators),) + (((region, gate),) if gate else ()):
        for nt in range(plan.n_tiles):
            c0, c1, c2, c3 = (f"{prefix}{nt}_{q}" for q in range(4))
            e.lines([f"st.shared.v2.f32 [%ad+{base + nt * 32}], {{{c0}, {c1}}};",
                     f"st.shared.v2.f32 [%ad+{base + nt * 32 + 8 * bc * 4}], {{{c2}, {c3}}};"])
    e.line("bar.sync 0;")
    e.lines(["ld.param.u64 %rdc, [p_c];", "cvta.to.global.u64 %rdc, %rdc;",
             f"mul.lo.u64 %rdt, %rdz, {plan.M * plan.N * es};", "add.s64 %rdc, %rdc, %rdt;"])
    if plan.residual:
        e.lines(["ld.param.u64 %rdr, [p_residual];", "cvta.to.global.u64 %rdr, %rdr;", "add.s64 %rdr, %rdr, %rdt;"])
    if plan.bias is not None:
        e.lines(["ld.param.u64 %rdbias, [p_bias];", "cvta.to.global.u64 %rdbias, %rdbias;"])
    split = getattr(c, "k_split", 1)
    warp_sum = _warp_sum(plan, gate, region)
    if split == 1:
        _each_output(e, plan, f"STORED{tag}", [warp_sum, _finish(plan)])
        return
    # config.k_split: this block's sums go to the workspace; the last of the strip's blocks adds them all
    e.lines(["ld.param.u64 %rdw, [p_partials];", "cvta.to.global.u64 %rdw, %rdw;",
             "ld.param.u64 %rda, [p_arrivals];", "cvta.to.global.u64 %rda, %rda;"])

    def partial(e: Emitter) -> None:
        e.lines([f"mad.lo.u32 %o, %rks, {plan.M}, %m;", f"mad.lo.u32 %o, %o, {plan.N}, %n;",
                 "mad.wide.u32 %rdt, %o, 4, %rdw;", "st.global.f32 [%rdt], %acc;"])

    def total(e: Emitter) -> None:  # the blocks' sums in block order (deterministic), read from L2
        e.lines([f"mad.lo.u32 %o, %m, {plan.N}, %n;", "mad.wide.u32 %rdt, %o, 4, %rdw;",
                 "ld.global.cg.f32 %acc, [%rdt];"])
        for k in range(1, split):
            e.lines([f"ld.global.cg.f32 %f, [%rdt+{k * plan.M * plan.N * 4}];", "add.f32 %acc, %acc, %f;"])

    _each_output(e, plan, f"PARTIAL{tag}", [warp_sum, partial])
    e.comment("the strip's blocks meet: the last to arrive (its count wraps the counter to 0) finishes the strip")
    e.lines(["membar.gl;", "bar.sync 0;", "setp.ne.u32 %pt, %rtid, 0;", f"@%pt bra ARRIVED{tag};",
             f"mul.wide.u32 %rdt, {'%rby' if _warp_strips(plan) else '%rs'}, 4;", "add.s64 %rdt, %rdt, %rda;",
             f"atom.global.inc.u32 %o, [%rdt], {split - 1};",  # the last arrival wraps it to 0: re-armed atomically
             f"setp.eq.u32 %pt, %o, {split - 1};", "selp.u32 %o, 1, 0, %pt;", "st.shared.u32 [%t], %o;"])
    e.label(f"ARRIVED{tag}")
    e.lines(["bar.sync 0;", "ld.shared.u32 %o, [%t];", "setp.eq.u32 %pt, %o, 0;", f"@%pt bra FINISHED{tag};",
             "membar.gl;"])
    _each_output(e, plan, f"STORED{tag}", [total, _finish(plan)])
    e.label(f"FINISHED{tag}")


def _each_output(e: Emitter, plan, label: str, parts) -> None:
    """Each of the block's outputs a thread at a time (%m, %n; %rw, %cl its place in the strip's tile, past M or
    N skipped), `parts` emitted in turn for it."""
    bc, threads, own = plan.block_columns, plan.config.threads, _warp_strips(plan)
    elements, shift = TILE * bc * (plan.config.warps_per_block if own else 1), bc.bit_length() - 1
    assert not own or plan.layout == "nk", "warps on their own strips store Y as N x M"
    for i in range(-(-elements // threads)):
        done = f"{label}{i}"
        e.lines([f"add.u32 %o, %rtid, {i * threads};", f"setp.ge.u32 %pt, %o, {elements};", f"@%pt bra {done};"])
        if own:  # Y[n, m]: consecutive threads along the block's rows, %ws the warp whose strip holds m
            rows = TILE * plan.config.warps_per_block  # a power of two
            e.lines([f"shr.u32 %cl, %o, {rows.bit_length() - 1};", f"and.b32 %rw, %o, {rows - 1};",
                     "shr.u32 %ws, %rw, 4;", "and.b32 %rw, %rw, 15;"])
        elif plan.layout == "kn":  # C[m, n]: consecutive threads along n
            e.lines([f"shr.u32 %rw, %o, {shift};", f"and.b32 %cl, %o, {bc - 1};"])
        else:  # Y[n, m]: consecutive threads along m
            e.lines(["shr.u32 %cl, %o, 4;", "and.b32 %rw, %o, 15;"])
        e.lines([f"mad.lo.u32 %n, %rgx, {bc}, %cl;", f"mad.lo.u32 %m, %rs, {TILE}, %rw;"]
                + ([f"mad.lo.u32 %m, %ws, {TILE}, %m;"] if own else [])
                + [f"setp.ge.u32 %pt, %n, {plan.N};", f"@%pt bra {done};", f"setp.ge.u32 %pt, %m, {plan.M};",
                   f"@%pt bra {done};"])
        for part in parts:
            part(e)
        e.label(done)


def _warp_sum(plan, gate: str | None, region: int):
    """%acc: the warps' partial sums of the thread's output in warp order (and silu(G x) times it, gated)."""
    c, bc = plan.config, plan.block_columns

    def emit(e: Emitter) -> None:
        if _warp_strips(plan):  # the output's own warp's sum, nothing to add
            e.lines([f"mad.lo.u32 %ad, %ws, {TILE}, %rw;", f"mad.lo.u32 %ad, %ad, {bc}, %cl;",
                     "mad.lo.u32 %ad, %ad, 4, %t;", "ld.shared.f32 %acc, [%ad];"])
            return
        e.lines([f"mad.lo.u32 %ad, %rw, {bc}, %cl;", "mad.lo.u32 %ad, %ad, 4, %t;", "ld.shared.f32 %acc, [%ad];"])
        for w in range(1, c.warps_per_block):
            e.lines([f"ld.shared.f32 %f, [%ad+{w * TILE * bc * 4}];", "add.f32 %acc, %acc, %f;"])
        if gate:
            e.line(f"ld.shared.f32 %gacc, [%ad+{region}];")
            for w in range(1, c.warps_per_block):
                e.lines([f"ld.shared.f32 %f, [%ad+{region + w * TILE * bc * 4}];", "add.f32 %gacc, %gacc, %f;"])
            silu_times(e, "%gacc", "%acc")
    return emit


def _warp_strips(plan) -> bool:
    return bool(getattr(plan, "warp_strips", False))


def _finish(plan):
    """The output from %acc: bias, residual, ReLU (max.NaN), rounding and the store."""
    cvt = "cvt.rn.bf16.f32" if plan.dtype == "bfloat16" else "cvt.rn.f16.f32"

    def emit(e: Emitter) -> None:
        if plan.bias is not None:
            e.lines(["mad.wide.u32 %rdt, %m, 4, %rdbias;", "ld.global.nc.f32 %f, [%rdt];", "add.f32 %acc, %acc, %f;"])
        if plan.layout == "kn":
            e.line(f"mad.lo.u32 %o, %m, {plan.N}, %n;")
        else:
            e.line(f"mad.lo.u32 %o, %n, {plan.M}, %m;")
        if plan.residual:
            e.lines(["mad.wide.u32 %rdt, %o, 2, %rdr;", "ld.global.nc.b16 %hv16, [%rdt];"])
            widen(e, plan.dtype, "%f", "%hv16")
            e.line("add.f32 %acc, %acc, %f;")
        if plan.relu:
            e.line("max.NaN.f32 %acc, %acc, 0f00000000;")
        e.lines([f"{cvt} %hv16, %acc;", "mad.wide.u32 %rdt, %o, 2, %rdc;", "st.global.b16 [%rdt], %hv16;"])
    return emit
