"""The tc-scatter mapping: W's nonzeros scattered into dense 16 x 16 tiles in shared memory, then
multiplied on the tensor cores (mma.sync m16n8k16, fp32 accumulation), for half precision at N = 1..64
(decode and small batches), where the weight's bytes bound the layer.

Why this design (measured on the H200, docs/history.md): CUDA-core kernels that walk
W's nonzeros pay ~10 instructions a nonzero (bitmap) or gather B per nonzero (csr at N = 16: 0.24x of
cuBLAS); a tensor-core kernel that decodes each fragment element in registers pays per *position*. Here a
lane takes four (position byte, value) entries with two loads and stores each value at its position in the
warp's zeroed tile buffer (one 16-bit shared store an entry); ldmatrix then hands the tensor cores the dense
tile. The decode costs a few instructions an entry whatever N is, and the tensor cores cover N = 1..8 with one
mma a tile (two for N <= 16). A first CUDA C prototype of this idea (benchmarks/proto/) spent ~120
instructions a tile on addressing and per-tile loads and ran at 0.4-2.4 TB/s; this layout removes what it
measured as the cost: entries are walked in rounds of 32 quads that may span the 4 tiles of a chunk (so a
round is full at 90% sparsity too), B for a chunk comes with one 16-byte load a lane per 32 columns, and no
per-tile header is read.

Layout (TcScatterPlan), W (M x K) in strips of 16 rows and chunks of 64 columns, each chunk 4 tiles:
- Columns: within each 32-column window of a chunk, column 8 tq + j (tq, j < 8) belongs to tile
  2 window + j // 4 at logical column 2 tq + (j % 4 < 2 ? j % 4 : j % 4 + 6). That permutation of k, applied
  to A's columns here and B's rows by the kernel, puts the 8 B values lane (g, tq) needs for the window's two
  tiles side by side in X's row g: one 16-byte load.
- Positions: an entry's byte is its place in the tile buffer in halves, row r, logical column L, swizzled:
  16 r + 8 ((L >> 3) ^ ((r >> 2) & 1)) + (L & 7), so that ldmatrix reads the buffer without bank conflicts.
- Entries: per tile, its nonzeros in position order, padded to a multiple of 4 by repeating the last one (a
  second store of the same value is harmless), dealt column-major into quads (quad q holds entries q, q + Q,
  q + 2Q, q + 3Q of a tile with Q quads: the four stores of a round write runs of neighbouring positions,
  in different banks); a chunk's tiles follow each other; chunks in (strip, chunk) order. `pos` (uint8) and
  `values` are indexed alike.
- Rounds: a chunk's quads in groups of 32, one a lane (an empty chunk: one round with no active lane, so a
  warp's chunks come in order and their B can be requested chunks ahead). records[round] = (lo, hi) uint32: lo has bit l set where
  lane l's quad begins a tile (bit 0 always); hi = active lanes | the round's tiles in order, 2 bits each,
  << 6 | last round of its chunk << 14 | chunk index in the strip << 16. Lane l's tile is entry
  popc(lo & lanemask_le) - 1 of that list (a chunk's empty tiles have no quads, so its tiles need not be
  consecutive).
- chunks[strip * C + c] = (first round, first entry), and one more row after the last chunk.
Both arrays end with padding the kernel's read-ahead may touch (never used).

The kernel (render.py): a block per strip (and per group of 32 output columns), its warps taking
consecutive ranges of the strip's chunks; each warp walks its rounds, records 4 ahead and entries 2 ahead,
scatters, and at a chunk's last round multiplies the chunk's 4 tiles into its accumulators, then zeroes the
tiles. The warps' partial sums meet in shared memory and are added in warp order (deterministic, no atomics);
bias, residual and ReLU are applied there. Non-finite inputs: the tensor cores multiply every 16 x 64 block
densely, so a NaN in B[k, j] reaches C[i, j] for every row i, as in dense W @ B (the masked dense model), not
only rows with a nonzero in column k.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...formats import SparseMatrix
from ...plan.config import WARP, require_ints
from ...plan.plan import DEFAULT_LAYOUT, WeightAsData, check_launch, check_problem, fp32_bias
from ...plan.reference import execute_decoded

TILE = 16                          # rows and (logical) columns of one mma A tile
TILES_PER_CHUNK = 4                # tiles a warp's buffer holds at once: one chunk of 64 columns
CHUNK_COLUMNS = TILE * TILES_PER_CHUNK
WINDOW = 32                        # columns whose B values one 16-byte load a lane brings (two tiles)
assert CHUNK_COLUMNS == 1 << 6 and WINDOW == 1 << 5  # column_layout's shifts
QUAD = 4                           # entries a lane takes with one 32-bit (positions) and one 64-bit load
ROUND = QUAD * WARP                # entries of one round
TILE_BYTES = TILE * TILE * 2       # one tile buffer in shared memory
N_TILE = 8                         # output columns of one mma
MAX_N_TILES = 4                    # n-tiles a block computes (32 columns); wider N: more column groups
SHARED_LIMIT = 48 * 1024           # static shared memory of a block
RECORD_PAD = 8                     # records past the end the read-ahead may load
ENTRY_PAD = 4 * ROUND              # entries past the end the read-ahead may load


@dataclass(frozen=True)
class TcScatterConfig:
    # warps of a block, all on one strip of 16 rows, each over a consecutive range of its chunks; their
    # partial sums are added in shared memory. More warps: more parallelism for few strips (M = 4096 has
    # 256), fewer chunks a warp
    warps_per_block: int = 8
    # rounds whose entries a warp has in flight (its records twice as far ahead): the bytes in flight per SM
    # are what an HBM-bound kernel's rate is, and M = 4096 gives only ~16 warps an SM
    ahead: int = 2

    def __post_init__(self):
        require_ints(self)
        if self.warps_per_block not in (2, 4, 8, 16):
            raise ValueError(f"warps_per_block must be 2, 4, 8 or 16, got {self.warps_per_block}")
        if self.ahead not in (1, 2, 4):
            raise ValueError(f"ahead must be 1, 2 or 4, got {self.ahead}")

    @property
    def threads(self) -> int:
        return self.warps_per_block * WARP

    def short(self) -> str:
        return f"tcs_w{self.warps_per_block}a{self.ahead}"


@dataclass(frozen=True)
class ScatterFormat:
    """W as the tc-scatter kernel reads it (see the module docstring); shared by every config. records, pos
    and values are numpy (scatter_format) or torch tensors on W's device as the kernel reads them
    (scatter_format_on_device: records as int32 bits, values in the kernel's dtype); chunks stay on the host."""
    M: int
    K: int
    nnz: int
    records: np.ndarray = field(repr=False)  # uint32 [rounds + RECORD_PAD, 2]
    pos: np.ndarray = field(repr=False)      # uint8 [entries + ENTRY_PAD]
    values: np.ndarray = field(repr=False)   # float32 [entries + ENTRY_PAD]
    chunks: np.ndarray = field(repr=False)   # uint32 [strips * chunks_per_strip + 1, 2]

    def on_host(self) -> "ScatterFormat":
        """The same format with every array in host memory (records uint32, values float32)."""
        if isinstance(self.records, np.ndarray):
            return self
        return ScatterFormat(self.M, self.K, self.nnz, self.records.cpu().numpy().view(np.uint32),
                             self.pos.cpu().numpy(), self.values.float().cpu().numpy(), self.chunks)

    @property
    def strips(self) -> int:
        return -(-self.M // TILE)

    @property
    def chunks_per_strip(self) -> int:
        return max(1, -(-self.K // CHUNK_COLUMNS))

    @property
    def rounds(self) -> int:
        return int(self.chunks[-1, 0])

    @property
    def entries(self) -> int:
        return int(self.chunks[-1, 1])


def column_layout(cols: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chunk, tile within the chunk, logical column within the tile) of W's columns."""
    # the widths are powers of two: shifts and masks (divmod on int64 costs seconds at 18M nonzeros); numpy
    # arrays or torch tensors alike
    cols = cols.long() if hasattr(cols, "long") else np.asarray(cols, dtype=np.int64)
    chunk, within = cols >> 6, cols & (CHUNK_COLUMNS - 1)
    window, cw = within >> 5, within & (WINDOW - 1)
    tq, j = cw >> 3, cw & 7
    half, jj = j >> 2, j & 3
    return chunk, 2 * window + half, 2 * tq + jj + 6 * (jj >= 2)


def position(rows: np.ndarray, logical: np.ndarray) -> np.ndarray:
    """The entry byte: row r, logical column L of a tile at its swizzled place in the buffer (in halves)."""
    r, L = (a.long() if hasattr(a, "long") else np.asarray(a, dtype=np.int64) for a in (rows, logical))
    return r * TILE + (((L >> 3) ^ ((r >> 2) & 1)) << 3) + (L & 7)


# By W's digest: every config the chooser tries for a layer shares one format. Two are kept: the chooser
# plans one layer at a time, and a 14336 x 4096 layer's format at 50% is ~150 MB of host memory.
_FORMATS: dict[str, ScatterFormat] = {}
FORMATS_KEPT = 2


def scatter_format(w: SparseMatrix) -> ScatterFormat:
    """W's tc-scatter layout in host memory, built once per weight: by torch ops on a GPU where there is one
    (numpy takes ~3 s for a 4096 x 4096 layer at 50% on one core, seconds more at Llama's 14336 x 4096), else
    by numpy; the same format either way (tests/cpu/mappings/tc_scatter)."""
    key = w.digest()
    if key not in _FORMATS:
        while len(_FORMATS) >= FORMATS_KEPT:
            _FORMATS.pop(next(iter(_FORMATS)))
        _FORMATS[key] = _built_on_gpu(w) or _build(w)
    return _FORMATS[key]


def _built_on_gpu(w: SparseMatrix) -> ScatterFormat | None:
    """scatter_format_on_device's format brought to the host, or None where no GPU can build it."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        from ...formats.device import DeviceCsr

        dtype = w.dtype if w.dtype in ("float16", "bfloat16") else "float32"
        values = torch.from_numpy(np.asarray(w.values, dtype=np.float32).copy()).cuda().to(getattr(torch, dtype))
        device_w = DeviceCsr(torch.from_numpy(w.indptr.copy()).cuda(), torch.from_numpy(w.indices.copy()).cuda(),
                             values, w.shape, dtype)
        return scatter_format_on_device(device_w, dtype).on_host()
    except (ImportError, RuntimeError):  # no usable CUDA build, or out of GPU memory: numpy builds it
        return None


def _build(w: SparseMatrix) -> ScatterFormat:
    m, k = w.shape
    strips, per_strip = -(-m // TILE), max(1, -(-k // CHUNK_COLUMNS))
    rows = np.repeat(np.arange(m, dtype=np.int64), np.diff(w.indptr))
    chunk, tile, logical = column_layout(w.indices)
    gtile = ((rows // TILE) * per_strip + chunk) * TILES_PER_CHUNK + tile
    key = gtile * 256 + position(rows % TILE, logical)
    order = np.argsort(key, kind="stable")
    key = key[order]
    tiles = strips * per_strip * TILES_PER_CHUNK
    counts = np.bincount(key >> 8, minlength=tiles).astype(np.int64)
    padded = -(-counts // QUAD) * QUAD
    quads = padded // QUAD
    starts = np.concatenate([[0], np.cumsum(padded)[:-1]])
    total = int(padded.sum())
    if total >= 2 ** 32 - ENTRY_PAD:
        raise ValueError(f"W has {total} padded nonzeros; the tc-scatter kernel indexes them with 32 bits")
    # every padded slot: its tile, rank in the tile, and the sorted nonzero it repeats
    tile_of = np.repeat(np.arange(tiles, dtype=np.int64), padded)
    rank = np.arange(total, dtype=np.int64) - starts[tile_of]
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    source = first[tile_of] + np.minimum(rank, counts[tile_of] - 1)
    q = quads[tile_of]
    slot = starts[tile_of] + QUAD * (rank % q) + rank // q
    pos = np.zeros(total + ENTRY_PAD, np.uint8)
    values = np.zeros(total + ENTRY_PAD, np.float32)
    pos[slot] = (key[source] & 255).astype(np.uint8)
    values[slot] = w.values.astype(np.float32)[order][source]
    # rounds: a chunk's quads, 32 at a time; an empty chunk gets one empty round, so that a warp's chunks
    # come one after another and the kernel knows each chunk's B columns before its records arrive
    chunk_count = strips * per_strip
    chunk_quads = quads.reshape(chunk_count, TILES_PER_CHUNK).sum(axis=1)
    chunk_rounds = np.maximum(1, -(-chunk_quads // WARP))
    round_start = np.concatenate([[0], np.cumsum(chunk_rounds)])
    n_rounds = int(round_start[-1])
    chunk_of_round = np.repeat(np.arange(chunk_count, dtype=np.int64), chunk_rounds)
    in_chunk = np.arange(n_rounds, dtype=np.int64) - round_start[chunk_of_round]
    active = np.clip(chunk_quads[chunk_of_round] - WARP * in_chunk, 0, WARP)
    last = in_chunk == chunk_rounds[chunk_of_round] - 1
    low, tile_list = np.zeros(n_rounds, np.uint64), np.zeros(n_rounds, np.int64)
    quad_tile = np.repeat(np.arange(tiles, dtype=np.int64), quads)
    if quad_tile.size:
        quad_chunk = quad_tile // TILES_PER_CHUNK
        first_quad = np.concatenate([[0], np.cumsum(chunk_quads)[:-1]])
        within = np.arange(quad_tile.size, dtype=np.int64) - first_quad[quad_chunk]
        lane = within % WARP
        round_of = round_start[quad_chunk] + within // WARP
        begins = (lane == 0) | (np.concatenate([[-1], quad_tile[:-1]]) != quad_tile)
        heads = np.flatnonzero(lane == 0)  # the first quad of each round that has quads (in round order)
        low[round_of[heads]] = np.bitwise_or.reduceat(begins.astype(np.uint64) << lane.astype(np.uint64), heads)
        # the round's tiles in order: the k-th tile that begins in it at bits 2k..2k+1 of the list
        begun = np.cumsum(begins)
        nth = begun - begun[heads][np.searchsorted(heads, np.arange(quad_tile.size), "right") - 1]
        listed = np.where(begins, (quad_tile % TILES_PER_CHUNK) << (2 * nth), 0).astype(np.uint64)
        tile_list[round_of[heads]] = np.bitwise_or.reduceat(listed, heads).astype(np.int64)
    records = np.zeros((n_rounds + RECORD_PAD, 2), np.uint32)
    records[:n_rounds, 0] = low.astype(np.uint32)
    records[:n_rounds, 1] = (active | tile_list << 6 | last.astype(np.int64) << 14
                             | (chunk_of_round % per_strip) << 16).astype(np.uint32)
    if per_strip >= 2 ** 16:
        raise ValueError(f"K = {k}: the tc-scatter kernel numbers a strip's chunks with 16 bits (K <= {CHUNK_COLUMNS << 16})")
    chunk_entry = np.concatenate([starts[::TILES_PER_CHUNK], [total]])
    chunks = np.stack([round_start, chunk_entry], axis=1).astype(np.uint32)
    return ScatterFormat(m, k, w.nnz, records, pos, values, chunks)


def scatter_format_on_device(w, dtype: str) -> ScatterFormat:
    """_build's format from a formats.DeviceCsr by torch ops on W's device (the same entries and records, bit
    for bit: tests/cpu/mappings), values in the kernel's dtype; one per matrix and dtype (DeviceCsr.packed),
    shared by every config and width. Bit fields are assembled by sums: within a round they are disjoint."""
    import torch

    m, k = w.shape
    dev = w.device
    strips, per_strip = -(-m // TILE), max(1, -(-k // CHUNK_COLUMNS))
    if per_strip >= 2 ** 16:
        raise ValueError(f"K = {k}: the tc-scatter kernel numbers a strip's chunks with 16 bits (K <= {CHUNK_COLUMNS << 16})")

    def arange(count):
        return torch.arange(count, device=dev)

    def exclusive(counts):
        return torch.cumsum(counts, 0) - counts

    rows = torch.repeat_interleave(arange(m), w.row_nnz(), output_size=w.nnz)
    chunk, tile, logical = column_layout(w.indices)
    gtile = ((rows // TILE) * per_strip + chunk) * TILES_PER_CHUNK + tile
    key, order = torch.sort(gtile * 256 + position(rows % TILE, logical), stable=True)
    tiles = strips * per_strip * TILES_PER_CHUNK
    counts = torch.bincount(key >> 8, minlength=tiles)
    padded = (counts + QUAD - 1) // QUAD * QUAD
    quads = padded // QUAD
    starts = exclusive(padded)
    total = int(padded.sum())
    if total >= 2 ** 31 - ENTRY_PAD:  # the records and chunks travel as int32
        raise ValueError(f"W has {total} padded nonzeros; the tc-scatter kernel indexes them with 31 bits here")
    tile_of = torch.repeat_interleave(arange(tiles), padded, output_size=total)
    rank = arange(total) - starts[tile_of]
    source = exclusive(counts)[tile_of] + torch.minimum(rank, counts[tile_of] - 1)
    q = quads[tile_of]
    slot = starts[tile_of] + QUAD * (rank % q) + rank // q
    pos = torch.zeros(total + ENTRY_PAD, dtype=torch.uint8, device=dev)
    values = torch.zeros(total + ENTRY_PAD, dtype=getattr(torch, dtype), device=dev)
    pos[slot] = (key[source] & 255).to(torch.uint8)
    values[slot] = w.values[order][source].to(values.dtype)
    chunk_count = strips * per_strip
    chunk_quads = quads.view(chunk_count, TILES_PER_CHUNK).sum(dim=1)
    chunk_rounds = torch.clamp((chunk_quads + WARP - 1) // WARP, min=1)
    round_start = torch.cat([chunk_rounds.new_zeros(1), torch.cumsum(chunk_rounds, 0)])
    n_rounds = int(round_start[-1])
    chunk_of_round = torch.repeat_interleave(arange(chunk_count), chunk_rounds, output_size=n_rounds)
    in_chunk = arange(n_rounds) - round_start[chunk_of_round]
    active = torch.clamp(chunk_quads[chunk_of_round] - WARP * in_chunk, 0, WARP)
    last = in_chunk == chunk_rounds[chunk_of_round] - 1
    low, tile_list = torch.zeros(n_rounds, dtype=torch.int64, device=dev), torch.zeros_like(in_chunk)
    n_quads = total // QUAD
    if n_quads:
        quad_tile = torch.repeat_interleave(arange(tiles), quads, output_size=n_quads)
        quad_chunk = quad_tile // TILES_PER_CHUNK
        within = arange(n_quads) - exclusive(chunk_quads)[quad_chunk]
        lane = within % WARP
        round_of = round_start[quad_chunk] + within // WARP
        begins = (lane == 0) | (torch.cat([quad_tile.new_full((1,), -1), quad_tile[:-1]]) != quad_tile)
        low.index_add_(0, round_of, begins.long() << lane)
        begun = torch.cumsum(begins.long(), 0)
        nth = begun - begun[arange(n_quads) - lane]  # the round's first quad is its lane 0
        tile_list.index_add_(0, round_of, torch.where(begins, (quad_tile % TILES_PER_CHUNK) << (2 * nth), 0))
    high = active | tile_list << 6 | last.long() << 14 | (chunk_of_round % per_strip) << 16
    records = torch.zeros((n_rounds + RECORD_PAD, 2), dtype=torch.int64, device=dev)
    records[:n_rounds, 0], records[:n_rounds, 1] = low, high
    records = torch.where(records >= 2 ** 31, records - 2 ** 32, records).to(torch.int32)  # uint32 bits
    chunk_entry = torch.cat([starts[::TILES_PER_CHUNK], starts.new_full((1,), total)])
    chunks = torch.stack([round_start, chunk_entry], dim=1).cpu().numpy().astype(np.uint32)
    return ScatterFormat(m, k, w.nnz, records, pos, values, chunks)


@dataclass(frozen=True, eq=False)
class TcScatterPlan(WeightAsData):
    """What the tc-scatter kernel needs: the problem, the config and W's scatter format."""
    M: int
    K: int
    N: int
    layout: str
    dtype: str
    config: TcScatterConfig
    format: ScatterFormat = field(repr=False)
    nnz: int = 0
    bias: tuple[float, ...] | None = None
    relu: bool = False
    arch: int = 90
    digest: str = ""
    residual: bool = False  # the epilogue adds R (laid out as the output, parameter p_residual) before ReLU

    family = "tc-scatter"
    mapping = "tc-scatter"
    partial_rows: tuple[int, ...] = ()

    @property
    def n_tiles(self) -> int:
        """mma n-tiles (8 columns) a block computes: the power of two covering N, at most 4."""
        need = -(-self.N // N_TILE)
        return min(MAX_N_TILES, 1 << (need - 1).bit_length())

    @property
    def block_columns(self) -> int:
        return N_TILE * self.n_tiles

    @property
    def chunks_per_warp(self) -> int:
        return -(-self.format.chunks_per_strip // self.config.warps_per_block)

    @property
    def grid(self) -> tuple[int, int]:
        """(column groups of block_columns, strips) of one batch entry."""
        return -(-self.N // self.block_columns), self.format.strips

    @property
    def vector_b(self) -> bool:
        """B's eight values of a window for one lane come with one 16-byte load: X's rows are the lanes'
        (layout nk, or N = 1) and K is a multiple of 8 (every row 16-byte aligned, no window straddles K)."""
        return (self.layout == "nk" or self.N == 1) and self.K % 8 == 0

    @property
    def registers(self) -> int:
        """Registers a thread takes, a little over what ptxas 13.0 gives for sm_90 (57 at one n-tile and ahead 2,
        76 at ahead 4, 74 at two n-tiles, 127 at four n-tiles and ahead 4): B and the accumulators per n-tile,
        the rings of records and entries per round ahead."""
        return 20 + 18 * self.n_tiles + 10 * self.config.ahead

    @property
    def shared_bytes(self) -> int:
        """The warps' tile buffers; after the walk the same memory holds their partial sums."""
        return max(self.config.warps_per_block * TILES_PER_CHUNK * TILE_BYTES,
                   self.config.warps_per_block * TILE * self.block_columns * 4)

    def weight_arrays(self) -> tuple[tuple[np.ndarray, str], ...]:
        """The arrays the kernel reads, in its parameter order after B and C, with the dtype each is
        uploaded as ("values": the kernel's dtype)."""
        f = self.format
        records = f.records.view(np.int32) if isinstance(f.records, np.ndarray) else f.records  # int32 bits
        return ((f.values, "values"), (f.pos, "uint8"), (records, "int32"), (f.chunks.view(np.int32), "int32"))

    def bytes_read(self) -> int:
        """W's bytes the kernel streams once per column group and batch entry: entries, records, chunk rows."""
        f = self.format
        return f.entries * (1 + self.element_bytes) + f.rounds * 8 + f.chunks.size * 4

    def describe(self) -> str:
        f = self.format
        dense = self.M * self.K * self.element_bytes
        return (f"Plan {self.name}\n  W {self.M}x{self.K}, nnz {self.nnz} ({f.entries} entries padded to quads, "
                f"{f.rounds} rounds); N {self.N}; layout {self.layout}; dtype {self.dtype}\n  scattered into "
                f"16x16 tiles, mma.m16n8k16 on the tensor cores: {self.bytes_read()} bytes of W "
                f"({dense / max(self.bytes_read(), 1):.2f}x fewer than dense); {self.config.warps_per_block} warps "
                f"a strip, {self.chunks_per_warp} chunks of 64 columns a warp, {self.n_tiles} n-tile(s); grid "
                f"{self.grid} x batch, {self.threads} threads")


def make_tc_scatter_plan(w: SparseMatrix, n: int, dtype: str = "float16", layout: str = DEFAULT_LAYOUT,
                         config: TcScatterConfig | None = None, bias=None, relu: bool = False, arch: int = 90,
                         residual: bool = False) -> TcScatterPlan:
    config = _checked_options(n, dtype, layout, config, arch)
    m, k = w.shape
    return _checked_plan(TcScatterPlan(m, k, n, layout, dtype, config, scatter_format(w), w.nnz, fp32_bias(bias, m),
                                       relu, arch, w.digest(), residual=bool(residual)))


def make_tc_scatter_plan_on_device(w, n: int, dtype: str = "float16", layout: str = DEFAULT_LAYOUT,
                                   config: TcScatterConfig | None = None, bias=None, relu: bool = False,
                                   arch: int = 90, residual: bool = False) -> TcScatterPlan:
    """make_tc_scatter_plan's plan from a formats.DeviceCsr, its format built on W's device
    (scatter_format_on_device) and shared by the matrix's plans; the digest is empty (W is data)."""
    config = _checked_options(n, dtype, layout, config, arch)
    m, k = w.shape
    fmt = w.packed(("tc-scatter", dtype), lambda: scatter_format_on_device(w, dtype))
    return _checked_plan(TcScatterPlan(m, k, n, layout, dtype, config, fmt, w.nnz, fp32_bias(bias, m), relu, arch,
                                       "", residual=bool(residual)))


def _checked_options(n: int, dtype: str, layout: str, config, arch: int) -> TcScatterConfig:
    check_problem(n, dtype, layout)
    config = config or TcScatterConfig()
    if dtype == "float32":
        raise ValueError("the tc-scatter mapping multiplies on the tensor cores in float16 or bfloat16: for float32 "
                         "use another mapping (compile_spmm without a config chooses one)")
    if arch < 80:
        raise ValueError(f"the tc-scatter mapping needs mma.sync m16n8k16 (sm_80 or newer), got sm_{arch}")
    return config


def _checked_plan(plan: TcScatterPlan) -> TcScatterPlan:
    config, n = plan.config, plan.N
    if plan.shared_bytes > SHARED_LIMIT:
        raise ValueError(f"{config.warps_per_block} warps need {plan.shared_bytes} bytes of shared memory, over "
                         f"{SHARED_LIMIT}: use fewer warps_per_block")
    if config.warps_per_block * WARP * plan.registers > 65536:
        # 512 threads may hold 128 registers each
        raise ValueError(f"{config.warps_per_block} warps with {plan.n_tiles} n-tiles (N = {n}) need about "
                         f"{plan.registers} registers a thread, over a block's 65536: use fewer warps_per_block")
    check_launch(plan.grid)
    return plan


def decode_dense(plan_or_format) -> np.ndarray:
    """W (M x K, float64) read back from the scatter format the way the kernel walks it (records, quads,
    positions): a layout bug shows here as a wrong product."""
    f = (plan_or_format.format if isinstance(plan_or_format, TcScatterPlan) else plan_or_format).on_host()
    per_strip = f.chunks_per_strip
    dense = np.zeros((f.strips * TILE, per_strip * CHUNK_COLUMNS))
    # the physical column of each (tile, logical column) of a chunk: the inverse of column_layout
    cols = np.arange(CHUNK_COLUMNS)
    _, tile_of_col, logical_of_col = column_layout(cols)
    physical = np.zeros((TILES_PER_CHUNK, TILE), np.int64)
    physical[tile_of_col, logical_of_col] = cols
    unswizzle = np.zeros(256, np.int64)  # byte -> (row, logical column) as row * 16 + L
    r, L = np.divmod(np.arange(256), TILE)
    unswizzle[position(r, L)] = r * TILE + L
    for s in range(f.strips):
        for c in range(per_strip):
            r0, e0 = (int(v) for v in f.chunks[s * per_strip + c])
            r1 = int(f.chunks[s * per_strip + c + 1, 0])
            e = e0
            for rnd in range(r0, r1):
                lo, hi = (int(v) for v in f.records[rnd])
                active = hi & 63
                assert (hi >> 16) == c and bool(hi >> 14 & 1) == (rnd == r1 - 1), "record out of step with its chunk"
                for lane in range(active):
                    t = (hi >> (6 + 2 * (bin(lo & ((2 << lane) - 1)).count("1") - 1))) & 3
                    for j in range(QUAD):
                        idx = e + QUAD * lane + j
                        row, col = divmod(int(unswizzle[f.pos[idx]]), TILE)
                        dense[s * TILE + row, c * CHUNK_COLUMNS + physical[t, col]] = f.values[idx]
                e += QUAD * active
    return dense[: f.M, : f.K]


def densify_tc_scatter(plan: TcScatterPlan, arrays, out):
    """W dense in `out` (torch, M x K, on the arrays' device) from the kernel's device arrays (values, pos,
    records, chunks: runtime.kernel.weight_data), by torch ops on that device and without a host sync: the
    walk of decode_dense, vectorised over quads. The counts come from the plan's host copy of `chunks`. A
    tile's padding repeats its last entry, so duplicate writes carry the same value."""
    import torch

    values, pos, records = arrays[:3]
    f, device = plan.format, out.device
    out.zero_()
    quads, rounds = f.entries // QUAD, f.rounds
    if not quads:
        return out
    per_strip = f.chunks_per_strip
    first = torch.from_numpy(f.chunks[:, 0].astype(np.int64)).to(device, non_blocking=True)  # a chunk's first round
    chunk_of_round = torch.repeat_interleave(torch.arange(per_strip * f.strips, device=device), torch.diff(first),
                                             output_size=rounds)
    bits = records[:rounds].long() & 0xFFFFFFFF  # int32 bits as uint32
    lo, hi = bits[:, 0], bits[:, 1]
    active = hi & 63
    quad_start = torch.cumsum(active, 0) - active  # the round's first quad
    round_of_quad = torch.repeat_interleave(torch.arange(rounds, device=device), active, output_size=quads)
    lane = torch.arange(quads, device=device) - quad_start[round_of_quad]
    # the lane's tile: entry popc(lo & lanemask_le) - 1 of the round's tile list (2 bits each from bit 6)
    below = lo[round_of_quad] & ((2 << lane) - 1)
    below = below - ((below >> 1) & 0x55555555)
    below = (below & 0x33333333) + ((below >> 2) & 0x33333333)
    count = (((below + (below >> 4)) & 0x0F0F0F0F) * 0x01010101 & 0xFFFFFFFF) >> 24
    tile = (hi[round_of_quad] >> (6 + 2 * (count - 1))) & 3
    chunk = chunk_of_round[round_of_quad]
    strip, within = chunk // per_strip, chunk % per_strip
    base = strip * TILE * plan.K + within * CHUNK_COLUMNS  # the chunk's first cell, flat
    # per entry: the byte's (row, logical column) in the tile, then the logical column's physical column
    _, tile_of_col, logical_of_col = column_layout(np.arange(CHUNK_COLUMNS))
    physical = np.zeros((TILES_PER_CHUNK, TILE), np.int64)
    physical[tile_of_col, logical_of_col] = np.arange(CHUNK_COLUMNS)
    r, L = np.divmod(np.arange(256), TILE)
    unswizzle = np.zeros(256, np.int64)
    unswizzle[position(r, L)] = r * TILE + L
    physical = torch.from_numpy(physical.reshape(-1)).to(device)
    unswizzle = torch.from_numpy(unswizzle).to(device)
    cell = unswizzle[pos[: quads * QUAD].long().view(quads, QUAD)]
    flat = base[:, None] + (cell >> 4) * plan.K + physical[(tile * TILE)[:, None] + (cell & (TILE - 1))]
    out.view(-1)[flat.view(-1)] = values[: quads * QUAD].to(out.dtype)
    return out


def execute_tc_scatter(plan: TcScatterPlan, b: np.ndarray) -> np.ndarray:
    """float64 reference of what the kernel computes, from W decoded out of the plan's own layout."""
    return execute_decoded(plan, decode_dense(plan), b)


def scatter_bytes(plan: TcScatterPlan) -> dict[str, int]:
    """Per batch entry: W's format once per column group, B's columns once per strip (from L2)."""
    groups = plan.grid[0]
    b_reads = plan.format.strips * plan.K * min(plan.N, plan.block_columns) * plan.element_bytes * groups
    return {"fetched": plan.bytes_read() * groups + b_reads, "minimum": plan.bytes_read() + plan.K * plan.N * plan.element_bytes}


def tc_scatter_traffic(plan: TcScatterPlan) -> dict[str, int]:
    """W's entries streamed once per column group, B's columns per strip, C written once; and the floor."""
    output = plan.M * plan.N * plan.element_bytes
    traffic = scatter_bytes(plan)
    return {"fetched_bytes": traffic["fetched"] + output, "floor_bytes": traffic["minimum"] + output}
