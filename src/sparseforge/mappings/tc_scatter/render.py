"""Lowering target: the tc-scatter kernel (plan.py). Pure: render_tc_scatter(plan) -> PTX.

Parameters: B (kn: [batch,] K x N; nk: [batch,] N x K), C ([batch,] M x N or N x M), values (the kernel's
dtype), pos (uint8), records (uint32 pairs), chunks (uint32 pairs), bias (fp32, or null), then the residual
where the plan adds one.

A block is one strip of 16 rows (grid.y) and one group of 8 x n_tiles output columns (grid.x); warp w takes
the strip's chunks [w * per_warp, (w + 1) * per_warp), whose rounds are consecutive. Per warp:
- its 4 tile buffers (4 x 512 bytes of shared memory) start zeroed;
- the walk keeps entries `ahead` rounds ahead and records twice as far in registers (a round's entries start
  where the previous round's end: 4 x its active lanes further), in a loop unrolled 2 x ahead times so every
  ring slot is a named register;
- a round: the lane's tile from the record (popc over the lanes that begin tiles, then the record's tile
  list), its 4 entries stored as 16-bit values at their positions (4 shared stores);
- a chunk's last round: warp barrier, per tile ldmatrix.x4 (A) and one mma.m16n8k16 per n-tile with the
  chunk's B (fp32 accumulators), barrier, the 4 tiles zeroed (one 16-byte store each), barrier, and the next
  chunk's B requested (its index from the next round's record; one 16-byte load a lane per 32 columns:
  plan.py's column permutation);
- at the end the warps' accumulators meet in shared memory (the tile buffers' space), and each thread adds
  its outputs' partial sums in warp order, then bias, residual, ReLU (max.NaN), rounding and the store.
"""
from __future__ import annotations

from ...plan.config import WARP
from .plan import (CHUNK_COLUMNS, QUAD, TILE, TILE_BYTES, TILES_PER_CHUNK, WINDOW, TcScatterPlan)
from ...codegen.emitter import Emitter
from ...codegen.mma_epilogue import strip_epilogue
from ...codegen.ptx import KernelSource, data_kernel

BUFFER_BYTES = TILES_PER_CHUNK * TILE_BYTES


def _mma(plan: TcScatterPlan) -> str:
    t = "bf16" if plan.dtype == "bfloat16" else "f16"
    return f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32"


def _load_record(e: Emitter, slot: int, index: str) -> None:
    """Round `index`'s record (every lane the same 8 bytes) into ring slot `slot`."""
    e.lines([f"mad.wide.u32 %rdt, {index}, 8, %rdrec;", f"ld.global.nc.v2.u32 {{%rl{slot}, %rh{slot}}}, [%rdt];"])


def _load_entries(e: Emitter, slot: int, record: int) -> None:
    """The lane's quad of the round starting at entry %re into entry slot `slot`; then %re moves past that
    round (4 x the active lanes of record slot `record`)."""
    e.lines(["mad.wide.u32 %rdt, %re, 1, %rdpos;", f"ld.global.nc.b32 %ep{slot}, [%rdt];",
             "mad.wide.u32 %rdt, %re, 2, %rdval;", f"ld.global.nc.v2.b32 {{%ev{slot}_0, %ev{slot}_1}}, [%rdt];",
             f"and.b32 %t, %rh{record}, 63;", f"mad.lo.u32 %re, %t, {QUAD}, %re;"])


def _load_b(e: Emitter, plan: TcScatterPlan, record: int) -> None:
    """B for the chunk record slot `record` names: per 32-column window and n-tile, the lane's 8 values
    (columns k0 + 32 w + 8 tq ..+7 of its row n) as 4 words; zeros past K or N (a column past K meets A's
    zero columns: it must be finite). One register set: on the H200 a second set, to request B two chunks
    ahead (64 registers instead of 57 at N = 1, 92 instead of 71 at N = 16), measured no faster at 4096 rows
    and 10-20% slower at 14336 (docs/history.md)."""
    nt_count = plan.n_tiles
    e.lines([f"shr.u32 %kb, %rh{record}, 16;", f"mul.lo.u32 %kb, %kb, {CHUNK_COLUMNS};", "mad.lo.u32 %kb, %tq, 8, %kb;"])
    for w in range(TILES_PER_CHUNK // 2):
        e.lines([f"add.u32 %o, %kb, {w * WINDOW};", f"setp.lt.u32 %pk, %o, {plan.K};"])
        for nt in range(nt_count):
            regs = [_b(w, nt, i) for i in range(4)]
            if plan.vector_b:
                e.lines([f"and.pred %pq, %pk, %pn{nt};", "mad.wide.u32 %rdt, %o, 2, " + f"%rdx{nt};"])
                e.lines([f"@!%pq mov.b32 {r}, 0;" for r in regs])
                e.line(f"@%pq ld.global.nc.v4.b32 {{{', '.join(regs)}}}, [%rdt];")
                continue
            for i in range(8):  # one element at a time: kn with N > 1, or K not a multiple of 8
                e.lines([f"add.u32 %o2, %o, {i};", f"setp.lt.u32 %pq, %o2, {plan.K};", f"and.pred %pq, %pq, %pn{nt};",
                         f"mov.b16 %h{i % 2}, 0;"])
                if plan.layout == "nk":
                    e.line(f"mad.wide.u32 %rdt, %o2, 2, %rdx{nt};")
                else:
                    e.line(f"mad.wide.u32 %rdt, %o2, {plan.N * 2}, %rdx{nt};")
                e.line(f"@%pq ld.global.nc.b16 %h{i % 2}, [%rdt];")
                if i % 2:
                    e.line(f"mov.b32 {regs[i // 2]}, {{%h0, %h1}};")


def _b(window: int, nt: int, i: int) -> str:
    return f"%bx{window}_{nt}_{i}"


def _scatter(e: Emitter, slot: int, ring: int) -> None:
    """The round in record slot `slot` with its entries in entry slot `ring`: the lane's tile, then its 4
    values stored at their positions there (lanes past the round's active ones store nothing)."""
    e.lines([f"and.b32 %act, %rh{slot}, 63;", "setp.lt.u32 %pa, %lane, %act;",
             f"and.b32 %t, %rl{slot}, %lmask;", "popc.b32 %t, %t;",          # tiles begun up to this lane
             "mad.lo.u32 %t, %t, 2, 4;", f"shr.b32 %t, %rh{slot}, %t;", "and.b32 %t, %t, 3;",  # its tile
             f"mad.lo.u32 %tb, %t, {TILE_BYTES}, %rbuf;"])
    for j in range(QUAD):
        value = f"%ev{ring}_{j // 2}"
        e.lines([f"prmt.b32 %o, %ep{ring}, %zero, {0x4440 + j:#x};", "mad.lo.u32 %ad, %o, 2, %tb;"])
        if j % 2:
            e.lines([f"shr.u32 %hv, {value}, 16;", "@%pa st.shared.b16 [%ad], %hv;"])
        else:
            e.line(f"@%pa st.shared.b16 [%ad], {value};")


def _multiply(e: Emitter, plan: TcScatterPlan, slot: int, i: int) -> None:
    """At the last round of a chunk: its 4 tiles times B into the accumulators, the tiles zeroed, the next
    chunk's B requested (the round after this one, the next chunk's first, is in the next record slot)."""
    e.lines([f"and.b32 %t, %rh{slot}, 16384;", "setp.eq.u32 %pt, %t, 0;", f"@%pt bra KEPT{i};",
             "bar.warp.sync -1;"])
    for t in range(TILES_PER_CHUNK):
        e.line(f"ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{%a0, %a1, %a2, %a3}}, [%ra+{t * TILE_BYTES}];")
        for nt in range(plan.n_tiles):
            c = ", ".join(f"%c{nt}_{q}" for q in range(4))
            b = f"{_b(t // 2, nt, 2 * (t % 2))}, {_b(t // 2, nt, 2 * (t % 2) + 1)}"
            e.line(f"{_mma(plan)} {{{c}}}, {{%a0, %a1, %a2, %a3}}, {{{b}}}, {{{c}}};")
    e.line("bar.warp.sync -1;")  # every lane's ldmatrix has read the tiles before they are zeroed
    e.lines([f"st.shared.v4.b32 [%rzl+{t * TILE_BYTES}], {{%zero, %zero, %zero, %zero}};" for t in range(TILES_PER_CHUNK)])
    e.line("bar.warp.sync -1;")  # zeroed before the next chunk's values land
    _load_b(e, plan, (slot + 1) % (2 * plan.config.ahead))
    e.label(f"KEPT{i}")


def render_tc_scatter(plan: TcScatterPlan) -> KernelSource:
    c, f = plan.config, plan.format
    per_strip, per_warp = f.chunks_per_strip, plan.chunks_per_warp
    nt_count, es = plan.n_tiles, plan.element_bytes
    entries_ahead = c.ahead
    records_ahead = 2 * entries_ahead  # also the loop's unroll
    e = Emitter()
    e.comment(f"{c.warps_per_block} warps a strip, {per_warp} chunks of {CHUNK_COLUMNS} columns a warp, "
              f"{nt_count} n-tile(s) of 8 columns")
    e.lines(["mov.u32 %zero, 0;", "mov.u32 %rtid, %tid.x;", "and.b32 %lane, %rtid, 31;", "shr.u32 %warp, %rtid, 5;",
             "shr.u32 %g, %lane, 2;", "and.b32 %tq, %lane, 3;", "mov.u32 %rs, %ctaid.y;", "mov.u32 %rgx, %ctaid.x;",
             "mov.u32 %t, %ctaid.z;", "cvt.u64.u32 %rdz, %t;",
             "mov.u32 %rbuf, smem;", f"mad.lo.u32 %rbuf, %warp, {BUFFER_BYTES}, %rbuf;", "mad.lo.u32 %rzl, %lane, 16, %rbuf;"])
    e.comment("this warp's tiles start zeroed")
    e.lines([f"st.shared.v4.b32 [%rzl+{t * TILE_BYTES}], {{%zero, %zero, %zero, %zero}};" for t in range(TILES_PER_CHUNK)])
    e.line("bar.warp.sync -1;")
    e.comment("ldmatrix.x4 row address of this lane: matrix q = lane / 8 is (rows 8 (q & 1) .., logical columns "
              "8 (q >> 1) ..), stored with the chunk swizzle of plan/tc_scatter.position")
    e.lines(["shr.u32 %t, %lane, 3;", "and.b32 %o, %t, 1;", "and.b32 %ad, %lane, 7;", "mad.lo.u32 %ad, %o, 8, %ad;",
             "shr.u32 %t, %t, 1;", "shr.u32 %o, %ad, 2;", "and.b32 %o, %o, 1;", "xor.b32 %t, %t, %o;",
             "shl.b32 %t, %t, 4;", f"mad.lo.u32 %t, %ad, {TILE * 2}, %t;", "add.u32 %ra, %rbuf, %t;",
             "mov.u32 %lmask, 2;", "shl.b32 %lmask, %lmask, %lane;", "sub.u32 %lmask, %lmask, 1;"])
    e.comment("the lane's rows of B (n = group * block columns + 8 n-tile + g) and whether they are inside N")
    e.lines(["ld.param.u64 %rdb, [p_b];", "cvta.to.global.u64 %rdb, %rdb;",
             f"mul.lo.u64 %rdt, %rdz, {plan.K * plan.N * es};", "add.s64 %rdb, %rdb, %rdt;"])
    row_stride = plan.K * es if plan.layout == "nk" or plan.N == 1 else es  # kn: B[k, n] at k N + n
    for nt in range(nt_count):
        e.lines([f"mad.lo.u32 %t, %rgx, {plan.block_columns}, %g;", f"add.u32 %t, %t, {8 * nt};",
                 f"setp.lt.u32 %pn{nt}, %t, {plan.N};", f"mad.wide.u32 %rdx{nt}, %t, {row_stride}, %rdb;"])
    e.comment("this warp's chunks, their rounds [rr, rre) and first entry re")
    e.lines([f"mul.lo.u32 %t, %warp, {per_warp};", f"min.u32 %t, %t, {per_strip};",
             f"add.u32 %o, %t, {per_warp};", f"min.u32 %o, %o, {per_strip};", "ld.param.u64 %rdt, [p_chunks];", "cvta.to.global.u64 %rdt, %rdt;",
             f"mad.lo.u32 %t, %rs, {per_strip}, %t;", "mad.wide.u32 %rdc, %t, 8, %rdt;",
             "ld.global.nc.v2.u32 {%rr, %re}, [%rdc];", f"mad.lo.u32 %o, %rs, {per_strip}, %o;",
             "mad.wide.u32 %rdc, %o, 8, %rdt;", "ld.global.nc.u32 %rre, [%rdc];",
             "ld.param.u64 %rdrec, [p_records];", "cvta.to.global.u64 %rdrec, %rdrec;",
             "ld.param.u64 %rdpos, [p_pos];", "cvta.to.global.u64 %rdpos, %rdpos;",
             f"mad.wide.u32 %rdpos, %lane, {QUAD}, %rdpos;",
             "ld.param.u64 %rdval, [p_values];", "cvta.to.global.u64 %rdval, %rdval;",
             f"mad.wide.u32 %rdval, %lane, {QUAD * es}, %rdval;"])
    e.lines([f"mov.f32 %c{nt}_{q}, 0f00000000;" for nt in range(nt_count) for q in range(4)])
    e.comment(f"read-ahead: records of rounds rr .. rr + {records_ahead - 1}, entries of rr .. rr + "
              f"{entries_ahead - 1}, B of the first chunk")
    for slot in range(records_ahead):
        e.line(f"add.u32 %t, %rr, {slot};")
        _load_record(e, slot, "%t")
    for ring in range(entries_ahead):
        _load_entries(e, ring, ring)
    _load_b(e, plan, 0)
    e.label("ROUNDS")
    for i in range(records_ahead):
        ring = i % entries_ahead
        e.lines(["setp.ge.u32 %pt, %rr, %rre;", "@%pt bra WALKED;"])
        _scatter(e, i, ring)
        _multiply(e, plan, i, i)
        e.comment(f"refill: entries of round rr + {entries_ahead}, the record of rr + {records_ahead}")
        _load_entries(e, ring, (i + entries_ahead) % records_ahead)
        e.line(f"add.u32 %t, %rr, {records_ahead};")
        _load_record(e, i, "%t")
        e.line("add.u32 %rr, %rr, 1;")
    e.line("bra.uni ROUNDS;")
    e.label("WALKED")
    strip_epilogue(e, plan)
    e.line("ret;")
    b_regs = [_b(w, nt, i) for w in range(TILES_PER_CHUNK // 2) for nt in range(nt_count) for i in range(4)]
    decl = [".reg .pred %pt, %pa, %pk, %pq, " + ", ".join(f"%pn{nt}" for nt in range(nt_count)) + ";",
            ".reg .b32 %zero, %rtid, %lane, %warp, %g, %tq, %rs, %rgx, %rbuf, %rzl, %ra, %lmask, %rr, %rre, %re, "
            "%kb, %t, "
            "%o, %o2, %ad, %tb, %act, %hv, %rw, %cl, %n, %m, %a0, %a1, %a2, %a3, "
            + ", ".join([f"%rl{s}, %rh{s}" for s in range(records_ahead)]
                        + [f"%ep{r}, %ev{r}_0, %ev{r}_1" for r in range(entries_ahead)] + b_regs) + ";",
            ".reg .b32 %acc, %f, " + ", ".join(f"%c{nt}_{q}" for nt in range(nt_count) for q in range(4)) + ";",
            ".reg .b16 %h0, %h1, %hv16;",
            ".reg .b64 %rdz, %rdt, %rdb, %rdc, %rdr, %rdbias, %rdrec, %rdpos, %rdval, "
            + ", ".join(f"%rdx{nt}" for nt in range(nt_count)) + ";"]
    shared = f".shared .align 16 .b8 smem[{plan.shared_bytes}];"
    return data_kernel(plan, "tensor-core SpMM over entries scattered into 16x16 tiles (W as data)",
                       ("p_b", "p_c", "p_values", "p_pos", "p_records", "p_chunks", "p_bias")
                       + (("p_residual",) if plan.residual else ()), decl, e.text(), plan.shared_bytes, shared)
