"""Lowering target: a 2:4 GEMV/skinny GEMM on CUDA cores over sparseforge's packed format (semi/packed.py),
Y (n x M) = X (n x K) @ W^T [+ bias], for decode widths n <= 16. Memory-bound at small n: it streams 0.5625x
the bytes of the dense weight once, for all n columns (n = 9-16: 76-96 registers at their default set width,
no spills; the one-set kernel before took 130-142 and measured 0.20-0.75x of cuBLAS at n = 16, so the 2:4
runtime does not time those widths: semi/gemv.py DECISION_MAX_N).

One warp per output row. A lane takes 16-column chunks (lane, lane + 32, ...) in two register sets of `unroll`
chunks, one set's loads in flight while the other's chunks are used (the loads in flight are what a memory-bound
kernel's speed is made of): a chunk's 8 kept values (one 16-byte load), their positions (one 16-bit load) and,
for each of the n inputs, the chunk's 16 x values (two 16-byte loads, coalesced across the warp, L1-resident: X
is small). A kept value's x is picked from the two words of its group with one `prmt` whose selector comes from
the 2-bit position. fp32 accumulation, a butterfly reduction, lane 0 stores. render_gemv24 is pure: the same arguments always give the same text.

render_unpack24 is the format's dense writer: W (M x K) back from the packed arrays, one thread a chunk, for
the dense calls (prefill) of a layer that keeps no dense W of its own.
"""
from __future__ import annotations

from .emitter import Emitter
from .ptx import PTX_VERSION, KernelSource

WARPS = 8
MAX_N = 16


MAX_UNROLL = 4


def default_unroll(n: int) -> int:
    """Chunks in a register set (two sets: one's loads in flight while the other's chunks are used). Measured on
    an H100 against cuBLAS, weights from HBM, the four Llama-3-8B shapes (benchmarks/gemv24_sets.py): sets of 2
    give 1.71-1.81x at n = 1 (1 chunk: 1.49-1.63x; 4: 1.67-1.84x) and are best or within 10% of best at n = 2
    and 4; from n = 8 on the kernel is bound by its x loads and FMAs (0.6x at 8), where a set of 1 was fastest."""
    return 2 if n <= 4 else 1


def kernel_name(dtype: str, n: int, bias: bool, unroll: int = 1) -> str:
    return f"gemv24_{dtype}_n{n}{f'_u{unroll}' if unroll > 1 else ''}{'_bias' if bias else ''}"


def _to_f32(e: Emitter, dtype: str, dst: str, word: str, high: bool) -> None:
    """fp32 value of the low (or high) 16-bit half of `word`."""
    if dtype == "bfloat16":  # bf16 is the top half of an fp32
        e.line(f"and.b32 {dst}, {word}, -65536;" if high else f"shl.b32 {dst}, {word}, 16;")
    else:
        e.lines([f"mov.b32 {{%h0, %h1}}, {word};", f"cvt.f32.f16 {dst}, {'%h1' if high else '%h0'};"])


def _chunk(e: Emitter, slot: int) -> None:
    """%pc: whether chunk %rc + 32 * slot is the lane's; %t: that chunk, clamped to the row's last, so that every
    load reads a valid address and none is predicated (a predicated load keeps its register's old value, which
    ties it to that register's last use: ptxas then issues x's loads one after another)."""
    e.lines([f"add.u32 %t, %rc, {32 * slot};", "setp.lt.u32 %pc, %t, %rchunks;", "min.u32 %t, %t, %rlast;"])


def _load_set(e: Emitter, s: int, unroll: int, first: int) -> None:
    """Register set s: the kept values (16 bytes) and positions (2 bytes) of chunk slots first .. first +
    unroll - 1 from the loop's chunk %rc."""
    for u in range(unroll):
        _chunk(e, first + u)
        v = ", ".join(f"%v{s}_{u}_{j}" for j in range(4))
        e.lines(["mul.wide.u32 %rdt, %t, 16;", "add.s64 %rda, %rdv, %rdt;",
                 f"ld.global.nc.v4.b32 {{{v}}}, [%rda];",
                 "mul.wide.u32 %rdt, %t, 2;", "add.s64 %rda, %rdm, %rdt;", f"ld.global.nc.u16 %mm{s}_{u}, [%rda];"])


def _use_set(e: Emitter, dtype: str, n: int, s: int, unroll: int, first: int) -> None:
    """Register set s's chunks (slots first ..): weights and selectors, then each input's x words and FMAs, the
    FMAs of a chunk past the lane's last predicated off."""
    for u in range(unroll):
        _chunk(e, first + u)
        e.lines(["mul.wide.u32 %rdo, %t, 32;", f"cvt.u32.u16 %rm, %mm{s}_{u};"])
        for j in range(4):
            for h in range(2):  # the group's first and second kept value
                i = 2 * j + h
                _to_f32(e, dtype, f"%w{i}", f"%v{s}_{u}_{j}", high=bool(h))
                e.lines([f"bfe.u32 %rp, %rm, {4 * j + 2 * h}, 2;", f"mad.lo.u32 %sel{i}, %rp, 34, 16;"])
        for col in range(n):
            e.lines([f"add.s64 %rda, %rdx{col}, %rdo;", "ld.global.nc.v4.b32 {%x0, %x1, %x2, %x3}, [%rda];",
                     "ld.global.nc.v4.b32 {%x4, %x5, %x6, %x7}, [%rda+16];"])
            for i in range(8):
                j = i // 2
                e.line(f"prmt.b32 %t, %x{2 * j}, %x{2 * j + 1}, %sel{i};")
                _to_f32(e, dtype, "%f", "%t", high=False)
                e.line(f"@%pc fma.rn.f32 %acc{col}, %w{i}, %f, %acc{col};")


def _walk(e: Emitter, dtype: str, n: int, unroll: int) -> None:
    """The lane's chunks %rc = lane, lane + 32, ..., two register sets of `unroll` chunks: one set's loads in
    flight while the other's chunks are used (the loop unrolled twice, as delta-runs walks its slots). Without
    the second set ptxas issues a chunk's loads only after the previous chunk's FMAs, whatever the unrolling:
    one 16-byte load of W in flight a lane."""
    u2 = 2 * unroll
    e.lines(["setp.eq.u32 %pl, %rchunks, 0;", "@%pl bra REDUCE;", "sub.u32 %rlast, %rchunks, 1;"])
    _load_set(e, 0, unroll, 0)
    e.label("LOOP")
    e.lines([f"add.u32 %t, %rc, {32 * unroll};", "setp.lt.u32 %pmore, %t, %rchunks;"])
    _load_set(e, 1, unroll, unroll)
    _use_set(e, dtype, n, 0, unroll, 0)
    e.line("@!%pmore bra REDUCE;")
    _load_set(e, 0, unroll, u2)
    _use_set(e, dtype, n, 1, unroll, unroll)
    e.lines([f"add.u32 %rc, %rc, {32 * u2};", "setp.lt.u32 %pmore, %rc, %rchunks;", "@%pmore bra LOOP;"])


def _reduce_and_store(e: Emitter, dtype: str, n: int, bias: bool) -> None:
    for col in range(n):
        for offset in (16, 8, 4, 2, 1):
            e.lines([f"shfl.sync.bfly.b32 %f, %acc{col}, {offset}, 31, -1;", f"add.f32 %acc{col}, %acc{col}, %f;"])
    e.lines(["setp.ne.u32 %pl, %rlane, 0;", "@%pl bra DONE;"])
    if bias:
        e.lines(["ld.param.u64 %rdt, [p_bias];", "cvta.to.global.u64 %rdt, %rdt;",
                 "mad.wide.u32 %rdt, %rrow, 2, %rdt;", "ld.global.u16 %rb16, [%rdt];", "cvt.u32.u16 %t, %rb16;"])
        _to_f32(e, dtype, "%f", "%t", high=False)
    cvt = "cvt.rn.bf16.f32" if dtype == "bfloat16" else "cvt.rn.f16.f32"
    e.lines(["ld.param.u64 %rdy, [p_y];", "cvta.to.global.u64 %rdy, %rdy;", "mad.wide.u32 %rdy, %rrow, 2, %rdy;"])
    for col in range(n):
        if bias:
            e.line(f"add.f32 %acc{col}, %acc{col}, %f;")
        e.lines([f"{cvt} %ho, %acc{col};", "st.global.b16 [%rdy], %ho;"])
        if col + 1 < n:
            e.line("add.s64 %rdy, %rdy, %rdstride;")


def render_gemv24(dtype: str, n: int, bias: bool, arch: int = 90, unroll: int | None = None) -> KernelSource:
    """PTX of Y = X W^T (+ bias) for packed 2:4 W, n inputs, `unroll` chunks a register set (default_unroll(n)
    unless given). Parameters: values, meta, x, y, bias pointers, M, K (K a multiple of 16). Launch: WARPS*32
    threads, ceil(M / WARPS) blocks."""
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"the 2:4 GEMV takes float16 or bfloat16, got {dtype!r}")
    if not 1 <= n <= MAX_N:
        raise ValueError(f"the 2:4 GEMV serves 1..{MAX_N} inputs (decode widths), got n = {n}")
    unroll = default_unroll(n) if unroll is None else unroll
    if not (isinstance(unroll, int) and 1 <= unroll <= MAX_UNROLL):
        raise ValueError(f"the 2:4 GEMV holds 1..{MAX_UNROLL} chunks a register set, got unroll = {unroll!r}")
    name = kernel_name(dtype, n, bias, unroll)
    e = Emitter()
    e.comment("one warp per row; lanes take 16-column chunks lane, lane+32, ...")
    e.lines(["ld.param.u32 %rM, [p_m];", "ld.param.u32 %rK, [p_k];",
             "mov.u32 %rt, %tid.x;", "shr.u32 %rwarp, %rt, 5;", "and.b32 %rlane, %rt, 31;",
             "mov.u32 %rrow, %ctaid.x;", f"mad.lo.u32 %rrow, %rrow, {WARPS}, %rwarp;",
             "setp.ge.u32 %pl, %rrow, %rM;", "@%pl bra DONE;", "shr.u32 %rchunks, %rK, 4;"])
    e.comment("the row's values (16 bytes a chunk) and meta (2 bytes a chunk), x's rows (32 bytes a chunk)")
    e.lines(["ld.param.u64 %rdv, [p_values];", "cvta.to.global.u64 %rdv, %rdv;",
             "mul.wide.u32 %rdt, %rrow, %rK;", "add.s64 %rdv, %rdv, %rdt;",  # row * (K/2) values * 2 bytes
             "ld.param.u64 %rdm, [p_meta];", "cvta.to.global.u64 %rdm, %rdm;",
             "mul.wide.u32 %rdt, %rrow, %rchunks;", "shl.b64 %rdt, %rdt, 1;", "add.s64 %rdm, %rdm, %rdt;",
             "ld.param.u64 %rdx0, [p_x];", "cvta.to.global.u64 %rdx0, %rdx0;",
             "mul.wide.u32 %rdxs, %rK, 2;", "ld.param.u32 %rt, [p_m];", "mul.wide.u32 %rdstride, %rt, 2;"])
    for col in range(1, n):
        e.line(f"add.s64 %rdx{col}, %rdx{col - 1}, %rdxs;")
    e.lines([f"mov.f32 %acc{col}, 0f00000000;" for col in range(n)])
    e.line("mov.u32 %rc, %rlane;")
    _walk(e, dtype, n, unroll)
    e.label("REDUCE")
    _reduce_and_store(e, dtype, n, bias)
    e.label("DONE")
    e.line("ret;")
    decl = [".reg .pred %pl, %pc, %pmore;",
            ".reg .b32 %rM, %rK, %rt, %rwarp, %rlane, %rrow, %rchunks, %rlast, %rc, %rm, %rp, %t;",
            ".reg .b16 %rb16, %ho, %h0, %h1, " + ", ".join(f"%mm{s}_{u}" for s in (0, 1) for u in range(unroll)) + ";",
            ".reg .b32 %x<8>, %sel<8>, " + ", ".join(f"%v{s}_{u}_{j}" for s in (0, 1) for u in range(unroll)
                                                  for j in range(4)) + ";", ".reg .f32 %f, %w<8>, " + ", ".join(f"%acc{c}" for c in range(n)) + ";",
            ".reg .b64 %rdv, %rdm, %rdt, %rda, %rdo, %rdy, %rdxs, %rdstride, " + ", ".join(f"%rdx{c}" for c in range(n)) + ";"]
    text = "\n".join([
        f"// sparseforge generated kernel: {name}",
        f"// 2:4 packed GEMV, {n} input(s), {dtype}, {unroll} chunk(s) a register set, fp32 accumulate",
        f".version {PTX_VERSION}", f".target sm_{arch}", ".address_size 64", "",
        f".visible .entry {name}(", "    .param .u64 p_values,", "    .param .u64 p_meta,", "    .param .u64 p_x,",
        "    .param .u64 p_y,", "    .param .u64 p_bias,", "    .param .u32 p_m,", "    .param .u32 p_k", ")",
        f".maxntid {WARPS * 32}, 1, 1", "{"] + ["    " + d for d in decl] + [e.text(), "}", ""])
    return KernelSource(name, (text,), 0)


UNPACK_THREADS = 256
UNPACK_NAME = "unpack24_b16"


def render_unpack24(arch: int = 90) -> KernelSource:
    """PTX of the dense writer: out (M x K, 16-bit, contiguous) = W from the packed values (M x K/2) and meta
    (M x K/16), every element written (pruned ones zero), so `out` needs no zeroing. One thread per 16-column
    chunk (chunk c: values bytes 16c.., meta bytes 2c.., out bytes 32c..: the three arrays are row-major in
    the same chunk order, so no row arithmetic). A group's two kept values land at 16-bit slots p0 and p1 of
    its 64 output bits by two shifts (pack_24 keeps p0 != p1). Bits are copied, never converted: one kernel
    serves float16 and bfloat16 (a kept -0.0 stays -0.0; a pruned one, never packed, comes back +0.0). Parameters: values, meta, out pointers, the chunk
    count (M * K / 16). Launch: UNPACK_THREADS threads, ceil(chunks / UNPACK_THREADS) blocks."""
    e = Emitter()
    e.lines(["ld.param.u32 %rn, [p_chunks];", "mov.u32 %rc, %ctaid.x;", "mov.u32 %rt, %tid.x;",
             f"mad.lo.u32 %rc, %rc, {UNPACK_THREADS}, %rt;", "setp.ge.u32 %pl, %rc, %rn;", "@%pl bra DONE;",
             "ld.param.u64 %rdv, [p_values];", "cvta.to.global.u64 %rdv, %rdv;",
             "mul.wide.u32 %rdt, %rc, 16;", "add.s64 %rdv, %rdv, %rdt;",
             "ld.param.u64 %rdm, [p_meta];", "cvta.to.global.u64 %rdm, %rdm;",
             "mul.wide.u32 %rdt, %rc, 2;", "add.s64 %rdm, %rdm, %rdt;",
             "ld.param.u64 %rdo, [p_out];", "cvta.to.global.u64 %rdo, %rdo;",
             "mul.wide.u32 %rdt, %rc, 32;", "add.s64 %rdo, %rdo, %rdt;",
             "ld.global.nc.v4.b32 {%v0, %v1, %v2, %v3}, [%rdv];", "ld.global.nc.u16 %rm16, [%rdm];",
             "cvt.u32.u16 %rm, %rm16;"])
    for j in range(4):
        e.comment(f"group {j}: its first kept value to 16-bit slot p0, its second to p1")
        e.lines([f"bfe.u32 %s0, %rm, {4 * j}, 2;", "shl.b32 %s0, %s0, 4;",
                 f"bfe.u32 %s1, %rm, {4 * j + 2}, 2;", "shl.b32 %s1, %s1, 4;",
                 f"and.b32 %t, %v{j}, 65535;", "cvt.u64.u32 %rda, %t;", "shl.b64 %rda, %rda, %s0;",
                 f"shr.b32 %t, %v{j}, 16;", "cvt.u64.u32 %rdb, %t;", "shl.b64 %rdb, %rdb, %s1;",
                 "or.b64 %rda, %rda, %rdb;", f"mov.b64 {{%o{2 * j}, %o{2 * j + 1}}}, %rda;"])
    e.lines(["st.global.v4.b32 [%rdo], {%o0, %o1, %o2, %o3};", "st.global.v4.b32 [%rdo+16], {%o4, %o5, %o6, %o7};"])
    e.label("DONE")
    e.line("ret;")
    decl = [".reg .pred %pl, %pc, %pmore;", ".reg .b32 %rn, %rc, %rt, %rm, %s0, %s1, %t, %v<4>, %o<8>;", ".reg .b16 %rm16;",
            ".reg .b64 %rdv, %rdm, %rdo, %rdt, %rda, %rdb;"]
    text = "\n".join([
        f"// sparseforge generated kernel: {UNPACK_NAME}", "// packed 2:4 W written dense (bits copied)",
        f".version {PTX_VERSION}", f".target sm_{arch}", ".address_size 64", "",
        f".visible .entry {UNPACK_NAME}(", "    .param .u64 p_values,", "    .param .u64 p_meta,",
        "    .param .u64 p_out,", "    .param .u32 p_chunks", ")", f".maxntid {UNPACK_THREADS}, 1, 1", "{"]
        + ["    " + d for d in decl] + [e.text(), "}", ""])
    return KernelSource(UNPACK_NAME, (text,), 0)
