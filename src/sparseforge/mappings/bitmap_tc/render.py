"""Lowering target: the bitmap-tc kernel (plan.py). Pure: render_bitmap_tc(plan) -> PTX.

Parameters: B (kn: [batch,] K x N; nk: [batch,] N x K), C ([batch,] M x N or N x M), data (the chunks as
words), offsets (a chunk's first 16-byte unit), bias (fp32, or null), then the residual where the plan adds
one. Dynamic shared memory: per warp `stages` buffers of plan.stage_bytes, a chunk's plan.buffer_units units.

Per warp (plan.py has the why):
- lane j loads chunk j's offset of the warp's range (and the end after the last);
- a chunk's copy: its offsets by shuffle, then 16-byte cp.async a lane into its buffer, one commit group a
  chunk (empty past the range, so `wait_group stages - 1` always means "the chunk to decode has landed");
- the chunk loop is unrolled `stages` times (twice that where config.b_ahead alternates two register sets of B
  over an odd ring), so a buffer's address is an immediate;
- a tile: the lane's bitmap word (tile word g = lane / 4) and that word's stored start, plus the bits below
  its byte in its word: where its values start (those of config.scan_group tiles first, then their values);
  then per slot of its byte a 16-bit shared load (from the chunk's first start, a zero, where the bit is
  clear: no zeroing move) and a predicated step of the pointer; the 8 halves packed into the A fragment; per
  n-tile B's two registers (plan.b_loads: "wide", two 16-byte loads a lane for a group of 4 tiles, issued
  before the group's scans; else loads at the tile; zero past K or N) and one mma.
"""
from __future__ import annotations

from ...codegen.emitter import Emitter
from ...codegen.mma_epilogue import strip_epilogue
from ...codegen.ptx import KernelSource, data_kernel
from ...formats.bitmap_tiles import (BITMAP_BYTES, BITMAP_WORDS, CHUNK_COLUMNS, CHUNK_TILES, HEADER_BYTES, TILE, UNIT,
                                     chunk_column)
from .plan import N_TILE, BitmapTcPlan


def _mma(plan: BitmapTcPlan) -> str:
    t = "bf16" if plan.dtype == "bfloat16" else "f16"
    return f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32"


def _buffer(plan: BitmapTcPlan, stage: int, strip: int) -> int:
    """Byte offset, from the warp's buffers, of buffer `stage`'s chunk of the warp's strip `strip`."""
    return (stage * plan.sources + strip) * plan.stage_bytes


def _data(plan: BitmapTcPlan, strip: int) -> str:
    """The register holding the chunks' base address of the warp's strip `strip`: W's, or a gated kernel's G's
    for its strip 0."""
    return "%rdg" if plan.gate is not None and strip == 0 else "%rdd"


def _offsets(plan: BitmapTcPlan, strip: int) -> str:
    """The register whose lane j holds chunk j's first unit (of the warp's range) in the warp's strip `strip`."""
    return "%offr" if strip == 0 else f"%offr{strip}"


def _issue(e: Emitter, plan: BitmapTcPlan, stage: int, tag: str) -> None:
    """Chunk %j of the warp's range (nothing past it) of each of its strips copied into buffer `stage`, 16 bytes
    a lane and copy; one commit group either way."""
    e.lines(["setp.ge.u32 %pi, %j, %cnt;", f"@%pi bra ISSUED{tag};"])
    for q in range(plan.sources):
        tq = f"{tag}_{q}" if q else tag
        offr = _offsets(plan, q)
        if plan.config.l2_ahead:
            _prefetch(e, plan, tq, offr, _data(plan, q))
        e.lines([f"shfl.sync.idx.b32 %st, {offr}, %j, 31, -1;", "add.u32 %t, %j, 1;",
                 f"shfl.sync.idx.b32 %en, {offr}, %t, 31, -1;"])
        _copy_chunk(e, _buffer(plan, stage, q), _data(plan, q), tq)
    e.label(f"ISSUED{tag}")
    e.line("cp.async.commit_group;")


def _copy_chunk(e: Emitter, buffer: int, data: str, tag: str) -> None:
    """The chunk of units [%st, %en) of the chunks at `data` into the warp's buffer at byte `buffer`, 16 bytes a
    lane and cp.async (no commit)."""
    e.lines(["sub.u32 %sz, %en, %st;", f"add.u32 %sb, %wb, {buffer};", "mov.u32 %u, %lane;"])
    e.label(f"COPY{tag}")
    e.lines(["setp.ge.u32 %pi, %u, %sz;", f"@%pi bra COPIED{tag};", "add.u32 %t, %st, %u;",
             f"mad.wide.u32 %rdt, %t, {UNIT}, {data};", f"mad.lo.u32 %ad, %u, {UNIT}, %sb;",
             f"cp.async.cg.shared.global [%ad], [%rdt], {UNIT};", "add.u32 %u, %u, 32;", f"bra.uni COPY{tag};"])
    e.label(f"COPIED{tag}")


def _prefetch(e: Emitter, plan: BitmapTcPlan, tag: str, offr: str, data: str) -> None:
    """config.l2_ahead: chunk %j + l2_ahead of the warp's range (nothing past it) into L2, a 128-byte line a lane
    (two rounds where a chunk buffer passes 32 lines), its first units in `offr`, the chunks' base in `data`.
    Warp-uniform: every lane takes part in the shuffles."""
    lines = plan.stage_bytes // 128 + 1
    e.lines([f"add.u32 %t, %j, {plan.config.l2_ahead};", "setp.ge.u32 %pi, %t, %cnt;", f"@%pi bra FETCHED{tag};",
             f"shfl.sync.idx.b32 %st, {offr}, %t, 31, -1;", "add.u32 %t, %t, 1;",
             f"shfl.sync.idx.b32 %en, {offr}, %t, 31, -1;"])
    e.line("and.b32 %st, %st, -8;")  # from the line the chunk starts in: its last line is fetched too
    for r in range(-(-(lines + 1) // 32)):
        e.lines([f"mad.lo.u32 %t, %lane, 8, {256 * r};", "add.u32 %t, %t, %st;", "setp.lt.u32 %pk, %t, %en;",
                 f"mad.wide.u32 %rdt, %t, {UNIT}, {data};", "@%pk prefetch.global.L2 [%rdt];"])
    e.label(f"FETCHED{tag}")


def _b_pointers(e: Emitter, plan: BitmapTcPlan) -> None:
    """Per n-tile %rdy: B's element (this lane's row n, the chunk's first column the lane reads: %kc + 8 tq in
    the grouped order, where its columns of a tile group begin, %kc + 2 tq in the natural); %kr: columns left
    from there (signed)."""
    e.lines([f"mad.lo.u32 %t, %tq, {chunk_column(0, 2, plan.format.grouped)}, %kc;", f"mov.u32 %kr, {plan.K};",
             "sub.s32 %kr, %kr, %t;"])
    for nt in range(plan.n_tiles):
        e.line(f"mad.wide.u32 %rdy{nt}, %t, {_column_stride(plan)}, %rdx{nt};")


def _column_stride(plan: BitmapTcPlan) -> int:
    """Bytes between B's columns k and k + 1 of one row n."""
    return plan.element_bytes if plan.layout == "nk" or plan.N == 1 else plan.N * plan.element_bytes


def _b_column(plan: BitmapTcPlan, t: int, half: int) -> int:
    """The first of the two columns (from the lane's first, _b_pointers) that tile t's B register `half` holds:
    the format's own order, at tq = 0."""
    return chunk_column(t, 8 * half, plan.format.grouped)


def _b_register(nt: int, group: int, q: int, parity: int) -> str:
    """b_loads "wide": register q of tile group `group`'s B for n-tile nt, in the set of chunks of `parity`
    (config.b_ahead: the next chunk's B lands in the other set; else every chunk uses set 0)."""
    return f"%bw{nt}_{group}_{q}" if parity == 0 else f"%bx{nt}_{group}_{q}"


def _load_b_group(e: Emitter, plan: BitmapTcPlan, group: int, nt: int, parity: int = 0, ahead: bool = False) -> None:
    """b_loads "wide": the lane's 16 columns of tile group `group` for n-tile nt (of the warp's next chunk where
    `ahead`: 128 columns on), two 16-byte loads into set `parity`'s registers (tile t's: t % 4 and 4 + t % 4;
    each group its own, so a scan group of 8 tiles has both groups' B live), zero past K or N (K % 8 == 0: a
    piece is wholly inside K or past it)."""
    for piece in range(2):
        first = _b_column(plan, 4 * group, piece) + (CHUNK_COLUMNS if ahead else 0)
        regs = [_b_register(nt, group, 4 * piece + q, parity) for q in range(4)]
        e.lines([f"setp.gt.s32 %pk, %kr, {first};", f"and.pred %pq, %pk, %pn{nt};"]
                + [f"mov.b32 {r}, 0;" for r in regs]
                + [f"@%pq ld.global.nc.v4.b32 {{{', '.join(regs)}}}, [%rdy{nt}+{first * plan.element_bytes}];"])


def _load_b(e: Emitter, plan: BitmapTcPlan, t: int, nt: int) -> None:
    """b_loads "pair" or "scalar": B's two registers of tile t for n-tile nt, zero past K or N (with several strips
    a warp, every n-tile's: their tiles t come after)."""
    stride = _column_stride(plan)
    for half in range(2):
        reg, first = f"%bq{nt}_{half}", _b_column(plan, t, half)
        if plan.b_loads == "pair":
            e.lines([f"setp.gt.s32 %pk, %kr, {first};", f"and.pred %pq, %pk, %pn{nt};", f"mov.b32 {reg}, 0;",
                     f"@%pq ld.global.nc.b32 {reg}, [%rdy{nt}+{first * stride}];"])
            continue
        for i in range(2):  # one element at a time: X as K x N with N > 1, or K odd
            e.lines([f"setp.gt.s32 %pk, %kr, {first + i};", f"and.pred %pq, %pk, %pn{nt};", f"mov.b16 %hb{i}, 0;",
                     f"@%pq ld.global.nc.b16 %hb{i}, [%rdy{nt}+{(first + i) * stride}];"])
        e.line(f"mov.b32 {reg}, {{%hb0, %hb1}};")


def _scan(e: Emitter, plan: BitmapTcPlan, buffer: int, t: int, slot: int) -> None:
    """Tile t of the chunk at byte `buffer` of the warp's buffers, its lane state into slot `slot`: %mb{slot} the
    lane's byte (low 8 bits), %p{slot} the chunk's set bits before it (its word's stored start plus the bits
    below the byte in the word: where its values start)."""
    word = buffer + t * BITMAP_WORDS * 4
    start = buffer + BITMAP_BYTES + t * BITMAP_WORDS * 2
    e.comment(f"tile {t}: where the lane's values start (its word's start, then the set bits before its byte)")
    e.lines([f"ld.shared.b32 %w{slot}, [%wg+{word}];", f"ld.shared.u16 %p{slot}, [%sg+{start}];",
             f"and.b32 %x, %w{slot}, %lowm;", "popc.b32 %x, %x;", f"add.u32 %p{slot}, %p{slot}, %x;",
             f"shr.b32 %mb{slot}, %w{slot}, %sh;"])


def _accumulator(strip: int) -> str:
    """The prefix of the warp's strip `strip`'s accumulators (%c{n-tile}_{0..3} for the first)."""
    return "%c" if strip == 0 else f"%cs{strip}_"


def _tile(e: Emitter, plan: BitmapTcPlan, buffer: int, t: int, slot: int, strip: int, parity: int = 0) -> None:
    """Tile t of the warp's strip `strip` (its chunk at byte `buffer`), its scan in slot `slot`: the lane's A
    fragment from its 8 slots' values, one mma an n-tile with B already in registers (b_loads "wide": loaded
    for the tile group before its scans, or a chunk ahead into set `parity`; else by _load_b at the tile, before
    its strips' tiles)."""
    e.comment(f"tile {t}: the lane's 8 slots (a clear one reads the chunk's first start, always 0), then the mma")
    _fragment(e, buffer, slot, "%a")
    for nt in range(plan.n_tiles):
        if plan.b_loads == "wide":
            b = f"{_b_register(nt, t // 4, t % 4, parity)}, {_b_register(nt, t // 4, 4 + t % 4, parity)}"
        else:
            b = f"%bq{nt}_0, %bq{nt}_1"
        c = ", ".join(f"{_accumulator(strip)}{nt}_{q}" for q in range(4))
        e.line(f"{_mma(plan)} {{{c}}}, {{%a0, %a1, %a2, %a3}}, {{{b}}}, {{{c}}};")


def _fragment(e: Emitter, buffer: int, slot: int, a: str) -> None:
    """The A fragment ({a}0..{a}3) of the tile scanned into slot `slot`, from the chunk at byte `buffer` of the
    warp's buffers: per slot of the lane's byte a 16-bit shared load (a clear slot reads the chunk's first
    start, always 0: no zeroing move) and a predicated step of the pointer, then the 8 halves packed."""
    e.lines([f"mad.lo.u32 %ptr, %p{slot}, 2, %wb;", f"add.u32 %ptr, %ptr, {buffer + HEADER_BYTES};",
             f"add.u32 %zr, %wb, {buffer + BITMAP_BYTES};"])
    for i in range(8):
        e.lines([f"and.b32 %x, %mb{slot}, {1 << i};", "setp.ne.u32 %ps, %x, 0;", "selp.u32 %ad, %ptr, %zr, %ps;",
                 f"ld.shared.u16 %v{i}, [%ad];"] + (["@%ps add.u32 %ptr, %ptr, 2;"] if i < 7 else []))
    e.lines([f"prmt.b32 {a}{r}, %v{2 * r}, %v{2 * r + 1}, 0x5410;" for r in range(4)])


def render_bitmap_tc(plan: BitmapTcPlan) -> KernelSource:
    if plan.warp_strips:
        return _render_shared_b(plan)
    c, f = plan.config, plan.format
    per_strip, per_warp, stages, strips = f.chunks_per_strip, plan.chunks_per_warp, c.stages, plan.sources
    gated = plan.gate is not None
    buffer, es = plan.stage_bytes, plan.element_bytes
    e = Emitter()
    e.comment(f"{c.warps_per_block} warps a block of {strips} strip(s){' (of G, then of W)' if gated else ''}, "
              f"{per_warp} chunks of {CHUNK_COLUMNS} columns a warp and strip, {stages} buffers of {strips} x {buffer} "
              f"bytes a warp, {plan.n_tiles} n-tile(s) of 8 columns")
    e.lines(["mov.u32 %rtid, %tid.x;", "and.b32 %lane, %rtid, 31;", "shr.u32 %warp, %rtid, 5;",
             "shr.u32 %g, %lane, 2;", "and.b32 %tq, %lane, 3;", "mov.u32 %rs, %ctaid.y;", "mov.u32 %rgx, %ctaid.x;",
             "mov.u32 %t, %ctaid.z;", "cvt.u64.u32 %rdz, %t;",
             "shl.b32 %sh, %tq, 3;", "mov.u32 %lowm, 1;", "shl.b32 %lowm, %lowm, %sh;", "sub.u32 %lowm, %lowm, 1;",
             "mov.u32 %wb, smem;", f"mad.lo.u32 %wb, %warp, {stages * strips * buffer}, %wb;",
             "mad.lo.u32 %wg, %g, 4, %wb;", "mad.lo.u32 %sg, %g, 2, %wb;"])
    if c.strips > 1:
        e.line(f"mul.lo.u32 %rs, %rs, {c.strips};")  # the block's first strip
    if c.k_split > 1:  # grid.x: the block's part of the strip's chunks; one column group
        e.lines(["mov.u32 %rks, %ctaid.x;", "mov.u32 %rgx, 0;"])
    e.comment("the lane's rows of B (n = 8 n-tile + g) and whether they are inside N")
    e.lines(["ld.param.u64 %rdb, [p_b];", "cvta.to.global.u64 %rdb, %rdb;",
             f"mul.lo.u64 %rdt, %rdz, {plan.K * plan.N * es};", "add.s64 %rdb, %rdb, %rdt;"])
    row_stride = plan.K * es if plan.layout == "nk" or plan.N == 1 else es  # kn: B[k, n] at k N + n
    for nt in range(plan.n_tiles):
        e.lines([f"add.u32 %t, %g, {8 * nt};", f"setp.lt.u32 %pn{nt}, %t, {plan.N};",
                 f"mad.wide.u32 %rdx{nt}, %t, {row_stride}, %rdb;"])
    e.comment("this warp's chunks [cb, cb + cnt) of each strip; lane j holds chunk j's first unit (and the end at "
              "j = cnt); a strip past the matrix (the last block's) decodes the last strip again, its rows not stored")
    if c.k_split > 1:  # the block's chunks [kb, ke) of the strip, then the warp's share of them
        per_block = plan.chunks_per_block
        e.lines([f"mul.lo.u32 %kb, %rks, {per_block};", f"add.u32 %ke, %kb, {per_block};",
                 f"min.u32 %ke, %ke, {per_strip};", f"mad.lo.u32 %cb, %warp, {per_warp}, %kb;",
                 "min.u32 %cb, %cb, %ke;", f"add.u32 %t, %cb, {per_warp};", "min.u32 %t, %t, %ke;",
                 "sub.u32 %cnt, %t, %cb;"])
    else:
        e.lines([f"mul.lo.u32 %cb, %warp, {per_warp};", f"min.u32 %cb, %cb, {per_strip};",
                 f"add.u32 %t, %cb, {per_warp};", f"min.u32 %t, %t, {per_strip};", "sub.u32 %cnt, %t, %cb;"])
    for q in range(strips):
        strip = "%rs" if q == 0 or gated else "%o"  # a gated kernel: the same strip of G (q = 0) and of W
        if q and not gated:
            e.lines([f"add.u32 %o, %rs, {q};", f"min.u32 %o, %o, {f.strips - 1};"])
        if gated and q == 0:
            e.lines(["ld.param.u64 %rdt, [p_goffsets];", "cvta.to.global.u64 %rdo, %rdt;"])
        elif q == (1 if gated else 0):
            e.lines(["ld.param.u64 %rdt, [p_offsets];", "cvta.to.global.u64 %rdo, %rdt;"])
        e.lines(["min.u32 %t, %lane, %cnt;", f"mad.lo.u32 %t, {strip}, {per_strip}, %t;", "add.u32 %t, %t, %cb;",
                 "mad.wide.u32 %rdt, %t, 4, %rdo;", f"ld.global.nc.u32 {_offsets(plan, q)}, [%rdt];"])
    e.lines(["ld.param.u64 %rdd, [p_data];", "cvta.to.global.u64 %rdd, %rdd;"])
    if gated:
        e.lines(["ld.param.u64 %rdg, [p_gdata];", "cvta.to.global.u64 %rdg, %rdg;"])
    e.lines([f"mov.f32 {_accumulator(q)}{nt}_{k}, 0f00000000;" for q in range(strips) for nt in range(plan.n_tiles)
             for k in range(4)])
    e.comment(f"the first {stages - 1} chunks in flight")
    for s in range(stages - 1):
        e.line(f"mov.u32 %j, {s};")
        _issue(e, plan, s, f"P{s}")
    wide, ahead = plan.b_loads == "wide", bool(c.b_ahead)
    groups = CHUNK_TILES // 4
    if ahead:  # the first chunk's B (both tile groups) into set 0; each chunk then loads the next one's
        e.lines([f"mul.lo.u32 %kc, %cb, {CHUNK_COLUMNS};"])
        _b_pointers(e, plan)
        for g in range(groups):
            for nt in range(plan.n_tiles):
                _load_b_group(e, plan, g, nt)
    e.line("mov.u32 %i, 0;")
    e.label("CHUNKS")
    # unrolled so that a buffer's address (and with b_ahead a chunk's B register set) is fixed in each copy
    unrolled = stages if not ahead or stages % 2 == 0 else 2 * stages
    for u in range(unrolled):
        buffer_index, parity = u % stages, (u % 2 if ahead else 0)
        e.lines(["setp.ge.u32 %pt, %i, %cnt;", "@%pt bra WALKED;", f"add.u32 %j, %i, {stages - 1};"])
        _issue(e, plan, (u + stages - 1) % stages, f"L{u}")
        e.lines(["add.u32 %kc, %cb, %i;", f"mul.lo.u32 %kc, %kc, {CHUNK_COLUMNS};"])
        _b_pointers(e, plan)
        if ahead:  # the next chunk's B in flight through this chunk's decode (zero past K: the last one's)
            for g in range(groups):
                for nt in range(plan.n_tiles):
                    _load_b_group(e, plan, g, nt, 1 - parity, ahead=True)
        for nt in range(plan.n_tiles if wide and not ahead else 0):  # the first group's B while the chunk lands
            _load_b_group(e, plan, 0, nt)
        e.lines([f"cp.async.wait_group {stages - 1};", "bar.warp.sync -1;"])
        group = c.scan_group
        for first in range(0, CHUNK_TILES, group):  # a group's B and scans, then its tiles' values and mmas
            for t in [t for t in range(first, first + group) if t % 4 == 0 and t > 0 and wide and not ahead]:
                for nt in range(plan.n_tiles):
                    _load_b_group(e, plan, t // 4, nt)
            for t in range(first, first + group):
                for q in range(strips):
                    _scan(e, plan, _buffer(plan, buffer_index, q), t, (t - first) * strips + q)
            for t in range(first, first + group):
                for nt in range(0 if wide else plan.n_tiles):
                    _load_b(e, plan, t, nt)
                for q in range(strips):
                    _tile(e, plan, _buffer(plan, buffer_index, q), t, (t - first) * strips + q, q, parity)
        e.lines(["bar.warp.sync -1;", "add.u32 %i, %i, 1;"])
    e.line("bra.uni CHUNKS;")
    e.label("WALKED")
    e.line("cp.async.wait_all;")
    if gated:  # G's sums (strip 0) and W's (strip 1) meet together: silu(G x) * (W x)
        strip_epilogue(e, plan, _accumulator(1), "", gate=_accumulator(0))
    for q in range(0 if gated else strips):  # a strip at a time through the shared memory
        if q:
            e.line("add.u32 %rs, %rs, 1;")
        strip_epilogue(e, plan, _accumulator(q), f"S{q}" if q else "")
    e.line("ret;")
    nts = range(plan.n_tiles)
    decl = [".reg .pred %pt, %pi, %ps, %pk, %pq, " + ", ".join(f"%pn{nt}" for nt in nts) + ";",
            ".reg .b32 %rtid, %lane, %warp, %g, %tq, %rs, %rgx, %sh, %lowm, %wb, %wg, %cb, %cnt, %offr, %i, %j, "
            "%st, %en, %sz, %sb, %u, %kc, %kr, %x, %ptr, %sg, %zr, %rks, %kb, %ke, "
            + "".join(f"{_b_register(nt, g, q, p)}, " for p in range(2 if c.b_ahead else 1) for nt in nts
                      for g in range(2) for q in range(8))
            + "".join(f"%v{i}, " for i in range(8))
            + "".join(f"%w{g}, %p{g}, %mb{g}, " for g in range(c.scan_group * strips))
            + "".join(f"%offr{q}, " for q in range(1, strips)) + " %t, %o, %ad, %rw, %cl, "
            "%n, %m, %a0, %a1, %a2, %a3, " + ", ".join(f"%bq{nt}_{q}" for nt in nts for q in range(2)) + ";",
            ".reg .b32 %acc, %gacc, %f, " + ", ".join(f"{_accumulator(s)}{nt}_{q}" for s in range(strips) for nt in nts
                                               for q in range(4)) + ";",
            ".reg .b16 %hb0, %hb1, %hv16;",
            ".reg .b64 %rdz, %rdt, %rdb, %rdc, %rdr, %rdbias, %rdd, %rdg, %rdo, %rdw, %rda, "
            + ", ".join(f"%rdx{nt}, %rdy{nt}" for nt in nts) + ";"]
    assert TILE * TILE // 32 == BITMAP_WORDS
    # dynamic: the launch gives plan.dynamic_shared_bytes (over the 48 KB a static declaration may have)
    shared = ".extern .shared .align 16 .b8 smem[];"
    return data_kernel(plan, "tensor-core SpMM over bitmap tiles decoded into A fragments (W as data)",
                       ("p_b", "p_c", "p_data", "p_offsets") + (("p_gdata", "p_goffsets") if gated else ())
                       + (("p_partials", "p_arrivals") if c.k_split > 1 else ())
                       + ("p_bias",) + (("p_residual",) if plan.residual else ()),
                       decl, e.text(), 0, shared)


def _render_shared_b(plan: BitmapTcPlan) -> KernelSource:
    """config.b_shared: warp w of a block decodes strip (block row x warps_per_block + w) over the block's chunks;
    each chunk's B (X's N rows of its 128 columns) is copied once a block into the ring beside the warps' W
    chunks, one commit group a chunk for both, and a chunk's turn starts with `wait_group stages - 2` and a
    block barrier (every thread's copies of it landed, every warp done with the buffer the next copy
    overwrites). B's rows sit 256 bytes apart with the 16-byte pieces of odd rows swapped by halves (piece p
    at p ^ 4), so the lanes' 16-byte reads of a tile group (rows g, pieces tq and 4 + tq) meet no bank twice.
    A warp's chunk offsets come from a table in shared memory (its strip's chunks of the block and the end),
    so a warp walks any number of chunks. Per group of 4 tiles: their scans and A fragments, then every n-tile's
    B (two 16-byte shared loads each), then the mmas tile by tile across the n-tiles, so with 2 or more n-tiles no
    mma waits on the one issued just before it (ptxas keeps the PTX order: n-tile by n-tile, each n-tile's 4 mmas ran as one chain of
    dependent tensor-core latencies, with 8 warps an SM at N = 64 to hide them)."""
    c, f = plan.config, plan.format
    per_strip, per_block, stages, warps = f.chunks_per_strip, plan.chunks_per_block, c.stages, c.warps_per_block
    buffer, es, n_tiles = plan.stage_bytes, plan.element_bytes, plan.n_tiles
    b_stage, row_bytes = plan.b_stage_bytes, CHUNK_COLUMNS * es
    pieces = row_bytes // UNIT  # 16-byte pieces of a row of B's chunk (16)
    rows_step = c.threads // pieces  # B's rows a round of the block's copies covers
    rounds = -(-plan.N // rows_step)
    e = Emitter()
    e.comment(f"{warps} warps a block, a strip each, {per_block} chunks of {CHUNK_COLUMNS} columns a warp; B's chunk "
              f"({plan.N} rows) staged a block, {stages} stages of {b_stage} bytes of B and {buffer} a warp; "
              f"{n_tiles} n-tile(s) of 8 columns")
    e.lines(["mov.u32 %rtid, %tid.x;", "and.b32 %lane, %rtid, 31;", "shr.u32 %warp, %rtid, 5;",
             "shr.u32 %g, %lane, 2;", "and.b32 %tq, %lane, 3;", "mov.u32 %rby, %ctaid.y;",
             f"mul.lo.u32 %rs, %rby, {warps};", "mov.u32 %rgx, 0;", "mov.u32 %t, %ctaid.z;", "cvt.u64.u32 %rdz, %t;",
             "shl.b32 %sh, %tq, 3;", "mov.u32 %lowm, 1;", "shl.b32 %lowm, %lowm, %sh;", "sub.u32 %lowm, %lowm, 1;",
             "mov.u32 %bb, smem;", f"add.u32 %wb, %bb, {stages * b_stage};",
             f"mad.lo.u32 %wb, %warp, {stages * buffer}, %wb;", f"add.u32 %tb, %bb, {plan.ring_bytes};",
             f"mad.lo.u32 %tb, %warp, {plan.table_bytes}, %tb;", "mad.lo.u32 %wg, %g, 4, %wb;",
             "mad.lo.u32 %sg, %g, 2, %wb;"])
    e.comment("the block's chunks [kb, kb + cnt) of every strip (config.k_split: its part of them)")
    if c.k_split > 1:
        e.lines(["mov.u32 %rks, %ctaid.x;", f"mul.lo.u32 %kb, %rks, {per_block};", f"min.u32 %kb, %kb, {per_strip};",
                 f"add.u32 %ke, %kb, {per_block};", f"min.u32 %ke, %ke, {per_strip};", "sub.u32 %cnt, %ke, %kb;"])
    else:
        e.lines(["mov.u32 %kb, 0;", f"mov.u32 %cnt, {per_strip};"])
    e.comment("the warp's strip (past the matrix, the last block's spare warps decode the last strip again, its "
              "rows not stored) and its chunk offsets into the table: entry j is chunk kb + j's first unit")
    e.lines(["add.u32 %o, %rs, %warp;", f"min.u32 %o, %o, {f.strips - 1};",
             "ld.param.u64 %rdt, [p_offsets];", "cvta.to.global.u64 %rdo, %rdt;",
             f"mad.lo.u32 %o, %o, {per_strip}, %kb;", "mov.u32 %u, %lane;"])
    e.label("TABLE")
    e.lines(["setp.gt.u32 %pi, %u, %cnt;", "@%pi bra TABLED;", "add.u32 %t, %o, %u;", "mad.wide.u32 %rdt, %t, 4, %rdo;",
             "ld.global.nc.u32 %t, [%rdt];", "mad.lo.u32 %ad, %u, 4, %tb;", "st.shared.u32 [%ad], %t;",
             "add.u32 %u, %u, 32;", "bra TABLE;"])
    e.label("TABLED")
    e.lines(["bar.warp.sync -1;", "ld.param.u64 %rdd, [p_data];", "cvta.to.global.u64 %rdd, %rdd;"])
    e.comment(f"the thread's part of B's copies: piece rtid % {pieces} of rows rtid / {pieces} + {rows_step} r, "
              "its place in a stage (odd rows' pieces swapped by halves) and X's element, both the same offset "
              "from one round to the next")
    e.lines(["ld.param.u64 %rdb, [p_b];", "cvta.to.global.u64 %rdb, %rdb;",
             f"mul.lo.u64 %rdt, %rdz, {plan.K * plan.N * es};", "add.s64 %rdb, %rdb, %rdt;",
             f"and.b32 %bpc, %rtid, {pieces - 1};", f"shr.u32 %o, %rtid, {pieces.bit_length() - 1};",
             "and.b32 %t, %o, 1;", "shl.b32 %t, %t, 2;", "xor.b32 %t, %t, %bpc;", f"mul.lo.u32 %t, %t, {UNIT};",
             f"mad.lo.u32 %bdst, %o, {row_bytes}, %t;", "shl.b32 %bpc, %bpc, 3;",
             f"mad.lo.u32 %t, %o, {plan.K}, %bpc;", f"mad.wide.u32 %rdbs, %t, {es}, %rdb;",
             f"mad.wide.u32 %rdx, %o, {plan.K * es}, %rdb;"])
    for r in range(rounds):  # whether round r's row is inside N (the last round may pass it)
        e.lines([f"add.u32 %t, %o, {r * rows_step};", f"setp.lt.u32 %pb{r}, %t, {plan.N};"])
    e.comment("the lane's B reads: row g of an n-tile, pieces tq and 4 + tq of a tile group, as stored")
    e.lines(["and.b32 %t, %g, 1;", "shl.b32 %t, %t, 2;", "or.b32 %t, %t, %tq;", f"mul.lo.u32 %t, %t, {UNIT};",
             f"mad.lo.u32 %bl, %g, {row_bytes}, %t;", f"xor.b32 %bl2, %bl, {4 * UNIT};", "add.u32 %bl, %bl, %bb;",
             "add.u32 %bl2, %bl2, %bb;"])
    e.lines([f"mov.f32 %c{nt}_{k}, 0f00000000;" for nt in range(n_tiles) for k in range(4)])

    def issue(stage: int, tag: str) -> None:
        """Chunk %j of the block (nothing past it): the warp's strip's chunk into its buffer `stage` and the
        block's share of B's chunk into B's; one commit group either way (block-uniform)."""
        e.lines(["setp.ge.u32 %pi, %j, %cnt;", f"@%pi bra ISSUED{tag};", "mad.lo.u32 %ad, %j, 4, %tb;",
                 "ld.shared.u32 %st, [%ad];", "ld.shared.u32 %en, [%ad+4];"])
        _copy_chunk(e, stage * buffer, "%rdd", tag)
        e.comment("B's chunk: X's columns kc .. kc + 127 of each row, zeros past K (a piece is inside K or past it)")
        e.lines(["add.u32 %kc, %kb, %j;", f"mul.lo.u32 %kc, %kc, {CHUNK_COLUMNS};", "add.u32 %t, %kc, %bpc;",
                 f"setp.lt.u32 %pk, %t, {plan.K};", f"selp.u32 %sz, {UNIT}, 0, %pk;",
                 f"mad.wide.u32 %rdt, %kc, {es}, %rdbs;",
                 "selp.b64 %rdt, %rdt, %rdx, %pk;",  # past K nothing is read: the row's start, a valid address
                 f"add.u32 %sb, %bdst, {stage * b_stage};", "add.u32 %sb, %sb, %bb;"])
        for r in range(rounds):
            e.line(f"@%pb{r} cp.async.cg.shared.global [%sb+{r * rows_step * row_bytes}], "
                   f"[%rdt+{r * rows_step * plan.K * es}], {UNIT}, %sz;")
        e.label(f"ISSUED{tag}")
        e.line("cp.async.commit_group;")

    e.comment(f"the first {stages - 1} chunks in flight")
    for s in range(stages - 1):
        e.line(f"mov.u32 %j, {s};")
        issue(s, f"P{s}")
    e.line("mov.u32 %i, 0;")
    e.label("CHUNKS")
    for u in range(stages):  # unrolled: a stage's buffers at immediates
        stage = u % stages
        e.lines(["setp.ge.u32 %pt, %i, %cnt;", "@%pt bra WALKED;", f"cp.async.wait_group {stages - 2};", "bar.sync 0;",
                 f"add.u32 %j, %i, {stages - 1};"])
        issue((u + stages - 1) % stages, f"L{u}")
        for group in range(CHUNK_TILES // 4):
            tiles = range(4 * group, 4 * group + 4)
            for first in tiles[::c.scan_group]:  # scans of a scan group, then its tiles' fragments
                for t in range(first, first + c.scan_group):
                    _scan(e, plan, stage * buffer, t, t - first)
                for t in range(first, first + c.scan_group):
                    e.comment(f"tile {t}: the lane's 8 slots into its A fragment")
                    _fragment(e, stage * buffer, t - first, f"%a{t % 4}_")
            for nt in range(n_tiles):
                at = stage * b_stage + nt * N_TILE * row_bytes + group * 8 * UNIT
                regs = [f"%bv{nt}_{q}" for q in range(8)]
                e.lines([f"ld.shared.v4.b32 {{{', '.join(regs[:4])}}}, [%bl+{at}];",
                         f"ld.shared.v4.b32 {{{', '.join(regs[4:])}}}, [%bl2+{at}];"])
            for q in range(4):  # tile-major across the n-tiles: with 2+ n-tiles no mma waits on the one before
                for nt in range(n_tiles):
                    acc = ", ".join(f"%c{nt}_{k}" for k in range(4))
                    e.line(f"{_mma(plan)} {{{acc}}}, {{%a{q}_0, %a{q}_1, %a{q}_2, %a{q}_3}}, "
                           f"{{%bv{nt}_{q}, %bv{nt}_{4 + q}}}, {{{acc}}};")
        e.line("add.u32 %i, %i, 1;")
    e.line("bra.uni CHUNKS;")
    e.label("WALKED")
    e.line("cp.async.wait_all;")
    strip_epilogue(e, plan)
    e.line("ret;")
    nts = range(n_tiles)
    decl = [".reg .pred %pt, %pi, %ps, %pk, " + ", ".join(f"%pb{r}" for r in range(rounds)) + ";",
            ".reg .b32 %rtid, %lane, %warp, %g, %tq, %rs, %rby, %rgx, %sh, %lowm, %bb, %wb, %tb, %wg, %sg, %kb, %ke, "
            "%rks, %cnt, %i, %j, %st, %en, %sz, %sb, %u, %kc, %x, %ptr, %zr, %t, %o, %ad, %rw, %cl, %ws, %n, %m, "
            "%bpc, %bdst, %bl, %bl2, "
            + "".join(f"%v{i}, " for i in range(8)) + "".join(f"%bv{nt}_{q}, " for nt in nts for q in range(8))
            + "".join(f"%w{s}, %p{s}, %mb{s}, " for s in range(c.scan_group))
            + ", ".join(f"%a{t}_{r}" for t in range(4) for r in range(4)) + ";",
            ".reg .b32 %acc, %f, " + ", ".join(f"%c{nt}_{q}" for nt in nts for q in range(4)) + ";",
            ".reg .b16 %hv16;",
            ".reg .b64 %rdz, %rdt, %rdx, %rdb, %rdbs, %rdc, %rdr, %rdbias, %rdd, %rdo, %rdw, %rda;"]
    shared = ".extern .shared .align 16 .b8 smem[];"
    return data_kernel(plan, "tensor-core SpMM over bitmap tiles decoded into A fragments, B staged a block (W as "
                       "data)", ("p_b", "p_c", "p_data", "p_offsets")
                       + (("p_partials", "p_arrivals") if c.k_split > 1 else ())
                       + ("p_bias",) + (("p_residual",) if plan.residual else ()),
                       decl, e.text(), 0, shared)
