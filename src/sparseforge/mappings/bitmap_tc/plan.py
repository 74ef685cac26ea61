"""The bitmap-tc mapping: W as bitmap tiles (formats/bitmap_tiles.py) decoded straight into the A fragments
of mma.sync m16n8k16 on the tensor cores, for float16 / bfloat16 at N = 1..16 (decode and small batches).

Why: at N >= 8 a CUDA-core kernel pays N FMAs and a read of X per nonzero (csr-staged: 0.6x of cuBLAS at
50% and N = 8 on the H200), and tc-scatter rebuilds each dense tile in shared memory, an entry a store, with
3 bytes an entry. Here W is 2 (1 - s) + 3/16 bytes a weight and each lane decodes its own 8 positions of a
tile in registers: its byte of the bitmap, where its values start (its word's stored start plus a popc of
the bits below its byte), then one 16-bit shared load a set bit. One mma a tile and n-tile; the decode is shared by
every n-tile, so wider N costs little more.

The kernel (render.py): a block is one strip of 16 rows (grid.y) and all N columns; its warps split the
strip's chunks into consecutive ranges (split K inside the block). A warp streams its chunks into a ring of
`stages` buffers in shared memory with cp.async (16 bytes a lane, coalesced), `stages - 1` chunks ahead of
the one it decodes; a chunk's offsets come from one load a lane at the start (lane j holds chunk j's) and a
shuffle. B (X) comes from global memory (L1 / L2) straight into the fragments: with X as N x K, thanks to the
format's column order, two 16-byte loads a lane cover 4 tiles (b_loads). On the H200 copying X's rows into
shared memory beside the weights cost 20% over B loaded at the tile (X as K x N) at N = 8. At the end the
warps' accumulators meet in shared memory and are added in warp order (deterministic), with bias, residual
and ReLU (codegen/mma_epilogue). With config.k_split a strip's chunks are split over that many blocks (grid.x),
which meet through a workspace the kernel owns (their partial sums, added in block order by the last to arrive).

Non-finite inputs: the tensor cores multiply every 16 x 16 tile densely, empty ones too, so a NaN or inf in
X[n, k] reaches every output of token n, as in the dense product W @ X (the masked dense model).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...formats import SparseMatrix
from ...formats.bitmap_tiles import (BitmapTiles, CHUNK_COLUMNS, UNIT, bitmap_tiles, bitmap_tiles_on_device,
                                     decode_dense)
from ...plan.config import WARP, epilogue_tag, require_ints, shared_bytes_limit
from ...plan.plan import DEFAULT_LAYOUT, WeightAsData, check_gated_pair, check_launch, check_problem, fp32_bias
from ...plan.reference import execute_decoded

N_TILE = 8             # output columns of one mma
MAX_N = 16             # N a block covers with B from L2 a warp and tile: wider N re-reads more of it than W's
# bytes (at N = 64 on the H200: 0.21x of cuBLAS)
MAX_N_SHARED_B = 64    # N a block covers with config.b_shared (B's chunk staged once a block): 8 n-tiles, 32
# accumulators a lane
BUFFER_STEP = 32       # a chunk buffer's size is rounded up to this many units (512 bytes): a density bucket
MAX_CHUNKS_A_WARP = 31  # a warp's chunk offsets sit one a lane (31 chunks and the end)


@dataclass(frozen=True)
class BitmapTcConfig:
    # warps of a block, all on one strip, each over a consecutive range of its chunks (their partial sums are
    # added in shared memory): more warps, more bytes in flight for layers of few strips
    warps_per_block: int = 8
    # chunk buffers a warp cycles through: stages - 1 chunks in flight while one is decoded
    stages: int = 2
    # tiles whose bitmap words and starts are read (two shared loads and a popc each) before any of their values:
    # a warp's in-order issue then overlaps those loads' latencies (1: tile by tile). (8, 2, 4) came within 9% of
    # the best config in every case timed on the H200 at N = 8 and 16 (space.py)
    scan_group: int = 4
    # chunks further ahead than the ring holds whose lines are prefetched into L2 as a chunk's copy is issued (0:
    # none): more of W's bytes in flight from HBM than the buffers in shared memory hold, so the copy into a
    # buffer later waits on L2, not on HBM
    l2_ahead: int = 0
    # strips (of 16 rows) a warp decodes over the same chunk columns: each B fragment it loads feeds that many
    # mmas, so X's traffic from L2 and its load latency a tile fall by that factor (at N = 8, 4096 x 4096, 70%,
    # B's loads were 27% of the kernel's time on the H200); the ring then holds `strips` chunks a stage
    strips: int = 1
    # blocks an SM should hold at once (the entry's .minnctapersm, 1: none): ptxas then keeps a thread to 65536 /
    # (threads x blocks) registers. Left to itself it takes 80-86 at N = 8, which holds an SM to 2 blocks of 8
    # warps, and the kernel is bound by latency (more warps, more of it hidden); it fits 64 without spilling at
    # N = 16 and 40 at N <= 8
    blocks_per_sm: int = 1
    # 1: B's fragments of the warp's next chunk loaded while this one is decoded (two register sets, about 22 more
    # registers an n-tile), so an mma never waits on B's L1 / L2 latency; 0: a chunk's first tile group loaded
    # as its copy lands, the second at its tiles. With B's loads replaced by constants the kernel ran 27% faster
    # (N = 8, 4096 x 4096, 70%, H200): their latency on the mma's path, or their bytes. X as N x K only (b_loads
    # "wide")
    b_ahead: int = 0
    # blocks a strip's chunks are split over (grid.x), for layers of few strips (Llama's k / v projections, 1024
    # rows: 64 strips of 8 warps leave an H200's SMs 4 warps each). Each block stores its partial sums (fp32) in
    # a workspace the kernel owns; the last of a strip's blocks to arrive adds them in block order
    # (deterministic), then bias, residual, ReLU and the store, and re-arms its counter. So one kernel's launches
    # must not overlap (one stream at a time, as CUDA graphs and the nn modules run them)
    k_split: int = 1
    # 1: the block's warps each decode their own strip over the same chunks, and B's rows for a chunk (N x 128
    # columns) are copied into shared memory once a block beside the warps' weights (cp.async, in the ring) and
    # read from there; 0: each warp loads B from L1 / L2 for its own strip's tiles. B then leaves L2 once for
    # warps_per_block strips, not once a strip: at N = 64 a chunk's B is 16 KB against W's 0.6-4.5 KB, and with
    # B from L2 a tile the kernel ran 0.21x of cuBLAS (H200). Takes N up to MAX_N_SHARED_B, X as N x K with K a
    # multiple of 8 (16-byte copies); a warp walks all its block's chunks (k_split shares them over blocks)
    b_shared: int = 0

    def __post_init__(self):
        require_ints(self)
        if self.warps_per_block not in (2, 4, 8, 16):
            raise ValueError(f"warps_per_block must be 2, 4, 8 or 16, got {self.warps_per_block}")
        if not 2 <= self.stages <= 6:
            raise ValueError(f"stages must be 2 to 6, got {self.stages}")
        if self.scan_group not in (1, 2, 4, 8):
            raise ValueError(f"scan_group must be 1, 2, 4 or 8, got {self.scan_group}")
        if not 0 <= self.l2_ahead <= 8:
            raise ValueError(f"l2_ahead must be 0 to 8 chunks, got {self.l2_ahead}")
        if self.strips not in (1, 2, 4):
            raise ValueError(f"strips must be 1, 2 or 4, got {self.strips}")
        if not 1 <= self.blocks_per_sm <= 16:
            raise ValueError(f"blocks_per_sm must be 1 to 16, got {self.blocks_per_sm}")
        if self.b_ahead not in (0, 1):
            raise ValueError(f"b_ahead must be 0 or 1, got {self.b_ahead}")
        if self.k_split not in (1, 2, 4, 8):
            raise ValueError(f"k_split must be 1, 2, 4 or 8, got {self.k_split}")
        if self.k_split > 1 and self.strips > 1:
            raise ValueError(f"k_split={self.k_split} takes one strip a warp, got strips={self.strips}: use one of "
                             "them")
        if self.b_shared not in (0, 1):
            raise ValueError(f"b_shared must be 0 or 1, got {self.b_shared}")
        if self.b_shared:
            clashes = [f"{name}={value}" for name, value, plain in (("strips", self.strips, 1),
                       ("b_ahead", self.b_ahead, 0), ("l2_ahead", self.l2_ahead, 0)) if value != plain]
            if clashes:
                raise ValueError(f"b_shared=1 gives each warp one strip and reads B from the block's shared copy, "
                                 f"which {', '.join(clashes)} does not fit: leave them at strips=1, b_ahead=0, "
                                 "l2_ahead=0")
            if self.scan_group > 4:
                raise ValueError(f"b_shared=1 decodes a group of 4 tiles before its B: scan_group must be 1, 2 or 4, "
                                 f"got {self.scan_group}")
        if self.scan_group * self.strips > 8:
            raise ValueError(f"scan_group x strips must be at most 8 (tiles scanned ahead, three registers each), got "
                             f"{self.scan_group} x {self.strips}")

    @property
    def threads(self) -> int:
        return self.warps_per_block * WARP

    def short(self) -> str:
        return (f"btc_w{self.warps_per_block}s{self.stages}" + (f"g{self.scan_group}" if self.scan_group > 1 else "")
                + (f"p{self.l2_ahead}" if self.l2_ahead else "") + (f"r{self.strips}" if self.strips > 1 else "")
                + (f"o{self.blocks_per_sm}" if self.blocks_per_sm > 1 else "") + ("a1" if self.b_ahead else "")
                + (f"k{self.k_split}" if self.k_split > 1 else "") + ("x" if self.b_shared else ""))


@dataclass(frozen=True, eq=False)
class BitmapTcPlan(WeightAsData):
    """What the bitmap-tc kernel needs: the problem, the config and W's bitmap tiles."""
    M: int
    K: int
    N: int
    layout: str
    dtype: str
    config: BitmapTcConfig
    format: BitmapTiles = field(repr=False)
    nnz: int = 0
    bias: tuple[float, ...] | None = None
    relu: bool = False
    arch: int = 90
    digest: str = ""
    residual: bool = False
    # gated MLP: C = silu(G X) * (W X), G's tiles here (its strip decoded beside W's by the same warp, each B
    # fragment feeding both mmas)
    gate: BitmapTiles | None = field(default=None, repr=False)
    # the chunk offsets as the kernel reads them, (W's, G's), where the plan shares another kernel's device
    # arrays (a gated kernel over its gate's and up's); empty: uploaded from the formats' host copies
    device_offsets: tuple = field(default=(), repr=False)

    family = "bitmap-tc"
    mapping = "bitmap-tc"
    partial_rows: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        # the buffer size is part of the binary: a density bucket of W, not its pattern
        epi = epilogue_tag(self.bias, self.relu, self.residual)
        return (f"spmm_{self.layout}_{self.dtype}_m{self.M}k{self.K}n{self.N}_{self.config.short()}"
                f"b{self.buffer_units}{epi}" + ("_gated" if self.gate is not None else ""))

    @property
    def formats(self) -> tuple[BitmapTiles, ...]:
        """The weights the kernel walks: W's tiles, then a gated kernel's G's."""
        return (self.format,) if self.gate is None else (self.format, self.gate)

    @property
    def sources(self) -> int:
        """Strips a warp decodes over the same chunk columns: config.strips of W, or a gated kernel's strip of G
        and the same strip of W."""
        return 2 if self.gate is not None else self.config.strips

    @property
    def warp_strips(self) -> bool:
        """Each warp of a block on its own strip (config.b_shared), not all on one strip's chunks."""
        return bool(self.config.b_shared)

    @property
    def n_tiles(self) -> int:
        return -(-self.N // N_TILE)

    @property
    def block_columns(self) -> int:
        return N_TILE * self.n_tiles

    @property
    def chunks_per_block(self) -> int:
        """A block's chunks of each of its strips: the strip's, or its share of config.k_split blocks."""
        return -(-self.format.chunks_per_strip // self.config.k_split)

    @property
    def chunks_per_warp(self) -> int:
        """A warp's chunks of each of its strips: all the block's with config.b_shared, else its share of them."""
        if self.warp_strips:
            return self.chunks_per_block
        return -(-self.chunks_per_block // self.config.warps_per_block)

    @property
    def strips_per_block(self) -> int:
        """Strips a block covers: one a warp (config.b_shared), or config.strips for all its warps."""
        return self.config.warps_per_block if self.warp_strips else self.config.strips

    @property
    def grid(self) -> tuple[int, int]:
        """(the blocks a strip's chunks are split over, groups of strips_per_block strips) of one batch entry."""
        return self.config.k_split, -(-self.format.strips // self.strips_per_block)

    @property
    def max_batch(self) -> int:
        """Batch entries one launch takes: 1 with config.k_split (its workspace holds one entry's partial sums)."""
        return 1 if self.config.k_split > 1 else 65535

    @property
    def buffer_units(self) -> int:
        """A chunk buffer, in 16-byte units: the largest chunk rounded up to BUFFER_STEP."""
        largest = max(f.max_chunk_units for f in self.formats)
        return max(BUFFER_STEP, -(-largest // BUFFER_STEP) * BUFFER_STEP)

    @property
    def b_loads(self) -> str:
        """How a lane loads B (formats/bitmap_tiles.py's column order): "wide", two 16-byte loads a group of 4
        tiles and n-tile, where X's rows are the lanes' (layout nk, or N = 1) and K is a multiple of 8 (each row
        16-byte aligned); "pair", a 32-bit load a register, where K is even; else "scalar", 16 bits at a time
        (X as K x N with N > 1, a lane's values N apart; or K odd)."""
        if self.format.grouped:
            return "wide" if self.K % 8 == 0 else "pair" if self.K % 2 == 0 else "scalar"
        return "scalar"

    @property
    def stage_bytes(self) -> int:
        """One buffer: a chunk's header and values."""
        return self.buffer_units * UNIT

    @property
    def b_stage_bytes(self) -> int:
        """config.b_shared: one chunk's B in shared memory, 8 rows an n-tile of CHUNK_COLUMNS values (0 without)."""
        return self.block_columns * CHUNK_COLUMNS * self.element_bytes if self.warp_strips else 0

    @property
    def table_bytes(self) -> int:
        """config.b_shared: a warp's chunk offsets in shared memory (its strip's chunks of the block and the end,
        16-byte rounded); 0 without (lane j holds chunk j's)."""
        return -(-(self.chunks_per_block + 1) * 4 // 16) * 16 if self.warp_strips else 0

    @property
    def ring_bytes(self) -> int:
        """The staged chunks: B's (config.b_shared) then each warp's buffers (a stage: a chunk of each of the
        warp's strips)."""
        c = self.config
        return c.stages * self.b_stage_bytes + c.warps_per_block * c.stages * self.sources * self.stage_bytes

    @property
    def dynamic_shared_bytes(self) -> int:
        """The ring and (config.b_shared) the warps' offset tables; after the walk the same memory holds the
        warps' partial sums, a strip at a time (a gated kernel's G and W sums together)."""
        c = self.config
        return max(self.ring_bytes + c.warps_per_block * self.table_bytes,
                   c.warps_per_block * 16 * self.block_columns * 4 * len(self.formats))

    @property
    def registers(self) -> int:
        """Registers a thread takes, a little over what `ptxas -c` 13.0 gives for sm_90 (the runtime's build):
        B by wide loads 84-86 at N <= 8, 106 at 9-16; else (and at N = 1), where ptxas hoists B's loads for the
        chunk's tiles, 112-117 and 152. The entry's .maxntid caps them at 65536 / threads (128 for 16 warps),
        where ptxas hoists fewer of B's loads instead of spilling (16 warps at N = 16 from L2: 128, no
        spills)."""
        return min(self.unbounded_registers, self.register_cap)

    @property
    def unbounded_registers(self) -> int:
        """With several strips a warp (or a gated kernel's two), ptxas keeps both strips' loads in flight: 141
        (wide) to 222 at 2 strips, 218 to 247 at 4 (N = 8 and 16); min_blocks caps them."""
        if self.warp_strips:  # config.b_shared: 103-108 at N = 8, 111-117 at 16, 135-145 at 32, 187-196 at 64
            return min(255, 108 + 13 * (self.n_tiles - 1))
        base = 86 + 20 * (self.n_tiles - 1) if self.b_loads == "wide" and self.N > 1 else 118 + 36 * (self.n_tiles - 1)
        ahead = 22 * self.n_tiles if self.config.b_ahead else 0  # the next chunk's B beside this one's: 107 / 128
        return min(255, base + ahead + (60 if self.sources == 2 else 130 if self.sources == 4 else 0))

    @property
    def min_blocks(self) -> int:
        """Blocks an SM should hold at once (the entry's .minnctapersm; 1: no directive): config.blocks_per_sm;
        else, with several strips a warp, as many as the shared memory takes, down to fewest_registers a thread
        where ptxas fits those kernels without spilling at N >= 8 (unbounded, 141-247 registers would leave one
        block of 8 warps an SM)."""
        c = self.config
        if c.blocks_per_sm > 1 or self.sources == 1:
            return c.blocks_per_sm
        # an SM's shared memory is a block's limit and 1 KB more, and each block reserves 1 KB of it
        by_shared = (shared_bytes_limit(self.arch) + 1024) // (self.dynamic_shared_bytes + 1024)
        return max(1, min(by_shared, 65536 // (c.threads * self.fewest_registers)))

    @property
    def fewest_registers(self) -> int:
        """The registers under which ptxas 13.0 spills (sm_90): 40 at N <= 8, 64 at 9-16, 128 with several
        strips a warp; 16 more an n-tile with B a chunk ahead (at N = 16 it spills at 80); with config.b_shared
        64 at N <= 16, 128 to N = 32, 136 to 48 and 168 past (8 n-tiles: 32 accumulators and the B of a tile
        group's every n-tile in flight)."""
        if self.warp_strips:  # config.b_shared: spills at 96 from N = 17 on, at 128 with 7-8 n-tiles
            return 64 if self.n_tiles <= 2 else 128 if self.n_tiles <= 4 else 136 if self.n_tiles <= 6 else 168
        ahead = 16 * self.n_tiles if self.config.b_ahead else 0
        return (128 if self.sources > 1 else 40 if self.n_tiles == 1 else 64) + ahead

    @property
    def register_cap(self) -> int:
        return 65536 // (self.config.threads * self.min_blocks) // 8 * 8

    def weight_arrays(self) -> tuple[tuple[np.ndarray, str], ...]:
        """(data, offsets) of W, then of a gated kernel's G (the kernel's parameter order after B and C)."""
        arrays = []
        for i, f in enumerate(self.formats):
            data = f.data.view(np.int32) if isinstance(f.data, np.ndarray) else f.data
            offsets = self.device_offsets[i] if self.device_offsets else f.offsets.view(np.int32)
            arrays += [(data, "int32"), (offsets, "int32")]
        return tuple(arrays)

    def workspace_sizes(self) -> tuple[int, ...]:
        """The kernel's own zeroed arrays after W's (int32 elements), with config.k_split: the blocks' partial
        sums (fp32 bits, k_split x M x N of a batch entry) and a counter a block row."""
        if self.config.k_split == 1:
            return ()
        return self.config.k_split * self.M * self.N, self.grid[1]  # a counter a block row

    def bytes_read(self) -> int:
        return sum(f.nbytes for f in self.formats)

    def describe(self) -> str:
        c, stored = self.config, self.bytes_read()
        dense = self.M * self.K * self.element_bytes * len(self.formats)
        what = "bitmap tiles" if self.gate is None else "gated MLP, silu(G X) * (W X), G's and W's bitmap tiles"
        return (f"Plan {self.name}\n  W {self.M}x{self.K}, nnz {self.nnz}; N {self.N}; layout {self.layout}; dtype "
                f"{self.dtype}\n  {what} decoded into mma.m16n8k16 A fragments: {stored} bytes "
                f"({stored / (dense / self.element_bytes):.3f} a weight, {dense / max(stored, 1):.2f}x fewer than "
                f"dense); {c.warps_per_block} warps a block of {self.strips_per_block} strip(s), {self.chunks_per_warp} "
                f"chunks of {CHUNK_COLUMNS} columns a warp and strip, {c.stages} buffers of {self.sources} x "
                f"{self.stage_bytes} bytes a warp, "
                + (f"B's chunk staged a block ({self.b_stage_bytes} bytes a stage)" if self.warp_strips else
                   f"B by {self.b_loads} loads") + f", {self.n_tiles} n-tile(s); "
                f"grid {self.grid} x batch, {self.threads} threads")


def make_bitmap_tc_plan(w: SparseMatrix, n: int, dtype: str = "float16", layout: str = DEFAULT_LAYOUT,
                        config: BitmapTcConfig | None = None, bias=None, relu: bool = False, arch: int = 90,
                        residual: bool = False) -> BitmapTcPlan:
    config = _checked_options(n, dtype, layout, config, arch)
    m, k = w.shape
    grouped = grouped_columns(n, layout)
    fmt = w.packed(("bitmap-tc", dtype, grouped), lambda: bitmap_tiles(w, dtype, grouped))
    return _checked_plan(BitmapTcPlan(m, k, n, layout, dtype, config, fmt, w.nnz, fp32_bias(bias, m), relu, arch,
                                      w.digest(), residual=bool(residual)))


def make_bitmap_tc_plan_on_device(w, n: int, dtype: str = "float16", layout: str = DEFAULT_LAYOUT,
                                  config: BitmapTcConfig | None = None, bias=None, relu: bool = False,
                                  arch: int = 90, residual: bool = False) -> BitmapTcPlan:
    """make_bitmap_tc_plan's plan from a formats.DeviceCsr, its tiles packed on W's device and shared by the
    matrix's plans; the digest is empty (W is data)."""
    config = _checked_options(n, dtype, layout, config, arch)
    m, k = w.shape
    grouped = grouped_columns(n, layout)
    fmt = w.packed(("bitmap-tc", dtype, grouped), lambda: bitmap_tiles_on_device(w, dtype, grouped))
    return _checked_plan(BitmapTcPlan(m, k, n, layout, dtype, config, fmt, w.nnz, fp32_bias(bias, m), relu, arch,
                                      "", residual=bool(residual)))


def grouped_columns(n: int, layout: str) -> bool:
    """The format's column order for a plan: grouped where X's rows are the lanes' (nk, or N = 1), so B comes
    in 16-byte loads; natural where X is K x N (formats/bitmap_tiles.py). So the packing follows the problem,
    not the config (no format_fields): a layer's widths share one packing where they share a layout, as a
    decoder's Linears (X as N x K) always do."""
    return layout == "nk" or n == 1


def _checked_options(n: int, dtype: str, layout: str, config, arch: int) -> BitmapTcConfig:
    check_problem(n, dtype, layout)
    if dtype == "float32":
        raise ValueError("the bitmap-tc mapping multiplies on the tensor cores in float16 or bfloat16: for float32 "
                         "use another mapping (compile_spmm without a config chooses one)")
    if arch < 80:
        raise ValueError(f"the bitmap-tc mapping needs mma.sync m16n8k16 and cp.async (sm_80 or newer), got sm_{arch}")
    widest = MAX_N_SHARED_B if config is not None and config.b_shared else MAX_N
    if n > widest:
        fix = f"use b_shared=1 (N <= {MAX_N_SHARED_B}) or another mapping" if widest == MAX_N else "use another mapping"
        raise ValueError(f"the bitmap-tc mapping covers N <= {widest} in one block with b_shared="
                         f"{int(widest > MAX_N)}, got N = {n}: {fix}")
    if config is not None and config.strips > 1 and n < N_TILE:
        # below a full n-tile ptxas spills the several strips' loads under min_blocks' register cap
        raise ValueError(f"bitmap-tc with {config.strips} strips a warp takes N >= {N_TILE}, got N = {n}: use strips=1")
    return config or BitmapTcConfig()


def _checked_plan(plan: BitmapTcPlan) -> BitmapTcPlan:
    c = plan.config
    if c.b_shared and (plan.layout != "nk" or plan.b_loads != "wide"):
        raise ValueError(f"b_shared copies X's rows into shared memory in 16-byte pieces, which takes X as N x K "
                         f"with K a multiple of 8; here layout {plan.layout!r}, K = {plan.K}: use b_shared=0")
    if not c.b_shared and plan.chunks_per_warp > MAX_CHUNKS_A_WARP:
        most = MAX_CHUNKS_A_WARP * 16 * CHUNK_COLUMNS
        fix = "use more warps_per_block" if c.warps_per_block < 16 else \
            f"the bitmap-tc mapping takes K <= {most}: use another mapping"
        raise ValueError(f"K = {plan.K} gives {plan.format.chunks_per_strip} chunks of {CHUNK_COLUMNS} columns a "
                         f"strip, {plan.chunks_per_warp} for each of {c.warps_per_block} warps, over the "
                         f"{MAX_CHUNKS_A_WARP} a warp takes: {fix}")
    if c.b_ahead and plan.b_loads != "wide":
        raise ValueError(f"b_ahead loads B a chunk ahead by 16-byte loads, which take X as N x K with K a multiple "
                         f"of 8; here B comes by {plan.b_loads} loads (layout {plan.layout!r}, K = {plan.K}): use "
                         "b_ahead=0")
    limit = shared_bytes_limit(plan.arch)
    if plan.dynamic_shared_bytes > limit:
        staged = f" and {c.stages} of B's chunk ({plan.b_stage_bytes} bytes at N = {plan.N})" if c.b_shared else ""
        fewer = "warps_per_block or stages" if c.b_shared else "warps_per_block, stages or strips"
        raise ValueError(f"{c.warps_per_block} warps with {c.stages} buffers of {plan.sources} x {plan.stage_bytes} "
                         f"bytes{staged} need {plan.dynamic_shared_bytes} bytes of shared memory, over the {limit} a "
                         f"block has on sm_{plan.arch}: use fewer {fewer}")
    if plan.register_cap < plan.fewest_registers:
        raise ValueError(f"{plan.min_blocks} blocks of {c.threads} threads an SM leave {plan.register_cap} registers "
                         f"a thread, under the {plan.fewest_registers} this kernel needs at N = {plan.N} without "
                         "spilling: use fewer blocks_per_sm or warps_per_block")
    automatic = plan.sources > 1 and c.blocks_per_sm == 1  # min_blocks' own cap: 128 a thread, where sm_80 fits
    if plan.arch < 90 and not automatic and plan.unbounded_registers > plan.register_cap:
        # ptxas for sm_80 spills under the cap where sm_90's fits (16 warps, N > 8, B from L2; blocks_per_sm)
        raise ValueError(f"{c.warps_per_block} warps at N = {plan.N} need about {plan.unbounded_registers} registers "
                         f"a thread on sm_{plan.arch}, over the {plan.register_cap} that {c.threads} threads leave "
                         "without spilling: use fewer warps_per_block")
    check_launch(plan.grid)
    return plan


def gated_bitmap_tc_plan(gate: BitmapTcPlan, gate_arrays, up: BitmapTcPlan, up_arrays) -> BitmapTcPlan:
    """The Llama MLP's gate and up projections in one kernel: C = silu(G X) * (U X), from two plans of the same
    problem and config. A warp decodes the same strip of G and of U over the same chunk columns, each B
    fragment feeding both mmas (X read once), and the epilogue adds both partial sums and multiplies.
    gate_arrays / up_arrays: the (data, offsets) their kernels read (device tensors: the gated kernel shares
    them, nothing copied), or None for each plan's own tiles."""
    import dataclasses

    check_gated_pair(gate, up)
    if up.config.k_split > 1:
        raise ValueError(f"a gated bitmap-tc kernel finishes each strip in one block, got k_split={up.config.k_split}: "
                         "plan the gate and up with k_split=1")
    if up.config.b_shared:
        raise ValueError("a gated bitmap-tc kernel decodes G's and U's strips by one warp over its own chunks, got "
                         "b_shared=1: plan the gate and up with b_shared=0")
    if up.config.strips != 1:
        raise ValueError("a gated bitmap-tc kernel pairs each strip of G with the same strip of U (two strips a "
                         f"warp), got strips={up.config.strips}: plan the gate and up with strips=1")
    if up.N < N_TILE:
        raise ValueError(f"a gated bitmap-tc kernel (two strips a warp) takes N >= {N_TILE}, got N = {up.N}: at fewer "
                         "tokens gate and up run apart (or as a gated delta-runs kernel)")
    if up.config.scan_group * 2 > 8:
        raise ValueError("a gated bitmap-tc kernel scans G's and W's tiles together: scan_group x 2 must be at most "
                         f"8, got scan_group={up.config.scan_group}: plan the gate and up with scan_group <= 4")
    if gate.format.grouped != up.format.grouped:
        raise ValueError("the gate's and up's bitmap tiles differ in column order: plan both with one layout")

    def over(plan: BitmapTcPlan, arrays) -> tuple[BitmapTiles, object]:
        f = plan.format
        if arrays is None:
            return f, f.offsets.view(np.int32)
        return BitmapTiles(f.M, f.K, f.nnz, f.dtype, arrays[0], f.offsets, f.grouped), arrays[1]

    (fu, ou), (fg, og) = over(up, up_arrays), over(gate, gate_arrays)
    return _checked_plan(dataclasses.replace(up, format=fu, gate=fg, device_offsets=(ou, og), nnz=gate.nnz + up.nnz,
                                             digest=f"{gate.digest}+{up.digest}" if gate.digest or up.digest else ""))


def execute_bitmap_tc(plan: BitmapTcPlan, b: np.ndarray) -> np.ndarray:
    """float64 reference of what the kernel computes, from W (and a gated kernel's G) decoded out of the plan's
    own tiles."""
    out = execute_decoded(plan, decode_dense(plan.format), b)
    if plan.gate is None:
        return out
    g = execute_decoded(plan, decode_dense(plan.gate), b)  # a gated plan has no bias or ReLU
    return g / (1 + np.exp(-g)) * out


def bitmap_tc_traffic(plan: BitmapTcPlan) -> dict[str, int]:
    """W's tiles streamed once per batch entry, B's columns once per block (from L2), C written once; and the
    floor (W, B and C once)."""
    es = plan.element_bytes
    output = plan.M * plan.N * es
    b_reads = plan.grid[1] * plan.K * plan.N * es  # once a block: its strips (a gated kernel's G too) share it
    partials = 2 * plan.config.k_split * plan.M * plan.N * 4 if plan.config.k_split > 1 else 0  # written, read
    return {"fetched_bytes": plan.bytes_read() + b_reads + output + partials,
            "floor_bytes": plan.bytes_read() + plan.K * plan.N * es + output}


DENSIFY_POSITIONS = 1 << 23  # positions a slice of densify expands at once (~20 bytes each of temporaries)


def densify_bitmap_tc(plan: BitmapTcPlan, arrays, out):
    """W dense in `out` (torch, M x K, on the arrays' device) from the kernel's device arrays (data, offsets:
    runtime.kernel.weight_data) by torch ops there, with no host sync: strips a slice at a time, every
    position of their chunks expanded from its bit, a set bit's value at its rank in the chunk
    (formats/bitmap_tiles.py's layout), then the slice's rows copied out. The chunk starts come from the plan's
    host copy of the offsets. None for a gated kernel (two weights, not one W)."""
    import torch

    from ...formats.bitmap_tiles import BITMAP_WORDS, CHUNK_TILES, HEADER_BYTES, TILE, chunk_positions

    if plan.gate is not None:  # two weights, not one W: their own kernels densify them
        return None

    f, device = plan.format, out.device
    per_strip = f.chunks_per_strip
    halves = arrays[0].view(getattr(torch, plan.dtype))
    words_all = arrays[0]
    starts = torch.from_numpy(f.offsets[:-1].astype(np.int64)).to(device, non_blocking=True)
    slots = torch.arange(TILE * TILE, device=device)
    place = torch.from_numpy(chunk_positions(f.grouped)).to(device).long()  # a chunk's cells, row-major
    word_index = torch.arange(CHUNK_TILES * BITMAP_WORDS, device=device)
    step = max(1, DENSIFY_POSITIONS // (per_strip * CHUNK_TILES * 256))
    for first in range(0, f.strips, step):
        last = min(f.strips, first + step)
        begin = starts[first * per_strip:last * per_strip]
        words = words_all[begin[:, None] * (UNIT // 4) + word_index].long() & 0xFFFFFFFF
        words = words.view(-1, CHUNK_TILES, BITMAP_WORDS)
        bits = ((words[:, :, slots >> 5] >> (slots & 31)) & 1).view(words.shape[0], -1).bool()
        rank = torch.cumsum(bits, 1, dtype=torch.int32) - 1
        # a clear bit reads any value in range (a chunk with no values may end the data), then zero
        source = (begin[:, None] * (UNIT // 2) + HEADER_BYTES // 2 + rank.clamp(min=0)).clamp(max=halves.numel() - 1)
        values = torch.where(bits, halves[source], torch.zeros((), dtype=halves.dtype, device=device))
        block = values[:, place].view(last - first, per_strip, TILE, CHUNK_COLUMNS)
        block = block.permute(0, 2, 1, 3).reshape((last - first) * TILE, per_strip * CHUNK_COLUMNS)
        row0, row1 = first * TILE, min(plan.M, last * TILE)
        out[row0:row1] = block[: row1 - row0, : plan.K].to(out.dtype)
    return out
