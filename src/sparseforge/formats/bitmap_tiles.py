"""BitmapTiles: W as 16 x 16 tiles, each a 256-bit bitmap plus its nonzero values packed in the order a
tensor core's A fragment wants them.

Why this format: a decode step multiplies each weight once, so its time is W's bytes. One bit a position and
two bytes a nonzero is 2 (1 - s) + 1/8 bytes a weight against dense fp16's 2: 1.78x / 2.76x / 6.2x fewer at
50 / 70 / 90% sparsity; a 16-bit index and value (CSR) is as many bytes as dense at 50%. And the bitmap
is read straight into registers: no dense tile is rebuilt in shared memory.

Tile order (bit f of a tile's bitmap, f = 8 lane + 2 r + h): lane l = 4 g + t of a warp holds the A
fragment of mma.m16n8k16 in 4 registers r of 2 halves h: row g + 8 (r & 1), column 2 t + h + 8 (r >> 1) of
the tile (PTX ISA, "Matrix Fragments for mma.m16n8k16"). So a lane's 8 positions are one byte of the bitmap,
byte l; a tile's values are packed in bit order, so a lane's nonzeros are consecutive, starting at the
number of set bits below its byte.

Columns inside a chunk are in one of two orders (tile_column). Natural: tile t holds columns 16 t .. 16 t + 15.
Grouped (for X as N x K, a Linear's): tile t's mma column kk holds W's column 64 (t >> 2)
+ 32 (kk >> 3) + 8 tq + 2 (t & 3) + (kk & 1), tq = (kk >> 1) & 3. Then the B fragments a lane needs for a group
of 4 tiles are X's 8 consecutive columns 8 tq .. 8 tq + 7 and the 8 from 32 + 8 tq, two 16-byte loads where X's
rows are K long: no staging of X in shared memory, whole cache lines used. Where X is K x N a lane's columns
are N apart anyway, and the natural order keeps a load's rows together (on the H200 the grouped order ran
30-40% slower there). (The product is the same whatever the order: A's and B's columns are permuted alike.)

Each chunk also stores, for every 32-bit word of its bitmaps, where that word's values start among the chunk's
(16 bits, in values): a lane adds the set bits below its byte in its own word and knows where its values
start, with no scan across the warp and no dependence on the tile before. On the H200 the shuffle scan this
replaces (4 shuffles and their latency chain a tile) bounded the kernel at N = 8, not the bytes.

Layout (uint32 words, 16-byte units): strips of 16 rows; each strip's columns in chunks of 8 tiles (128
columns); chunks in (strip, chunk) order, each
    [8 bitmaps of 8 words: word j holds lanes 4 j .. 4 j + 3][64 uint16 starts: tile t's word j at 8 t + j]
    [its tiles' values in tile order][zeros to 16 B]
(a chunk past K has empty tiles: zero bitmaps, no values). offsets[strip * chunks + c] is chunk c's first
unit, and one more entry ends the last chunk. Bytes a weight: 2 (1 - s) for the values, 1/8 for the bitmaps,
1/16 for the starts, 0.006 for the offsets and the padding (8 bytes a chunk on average).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TILE = 16                       # rows and columns of a tile (one mma A operand)
CHUNK_TILES = 8                 # tiles of a chunk (a strip's 128 consecutive columns)
CHUNK_COLUMNS = TILE * CHUNK_TILES
BITMAP_WORDS = TILE * TILE // 32  # uint32 words of a tile's bitmap
BITMAP_BYTES = CHUNK_TILES * BITMAP_WORDS * 4  # a chunk's bitmaps (256 bytes: 16 units)
STARTS_BYTES = CHUNK_TILES * BITMAP_WORDS * 2  # a chunk's starts, one uint16 a bitmap word (128 bytes)
HEADER_BYTES = BITMAP_BYTES + STARTS_BYTES     # where a chunk's values begin (24 units)
UNIT = 16                       # bytes of an offset unit (one cp.async)
assert CHUNK_COLUMNS == 1 << 7 and TILE == 1 << 4  # the builders' shifts


def tile_column(cols, grouped: bool):
    """(tile, mma column kk) of a chunk's column (0..127) in the natural or grouped order (numpy or torch)."""
    if not grouped:
        return cols >> 4, cols & 15
    group, tq, t, hi, h = cols >> 6, (cols >> 3) & 3, (cols >> 1) & 3, (cols >> 5) & 1, cols & 1
    return 4 * group + t, 8 * hi + 2 * tq + h


def chunk_column(tile, kk, grouped: bool):
    """The chunk's column that tile `tile`'s mma column kk holds: tile_column's inverse."""
    if not grouped:
        return 16 * tile + kk
    return 64 * (tile >> 2) + 32 * (kk >> 3) + 8 * ((kk >> 1) & 3) + 2 * (tile & 3) + (kk & 1)


def slot_of(rows, cols):
    """Bit f of a tile's bitmap for row r, column c within the tile (numpy arrays or torch tensors)."""
    g, rr, t, h, cc = rows & 7, rows >> 3, (cols & 7) >> 1, cols & 1, cols >> 3
    return 8 * (4 * g + t) + 2 * (rr + 2 * cc) + h


def cell_of(slot):
    """(row, column) within the tile of bit `slot`: slot_of's inverse."""
    lane, r, h = slot >> 3, (slot >> 1) & 3, slot & 1
    return (lane >> 2) + 8 * (r & 1), 2 * (lane & 3) + h + 8 * (r >> 1)


@dataclass(frozen=True)
class BitmapTiles:
    """W (M x K) as bitmap tiles (module docstring). `data` holds the chunks as 32-bit words (numpy uint32 on
    the host, or an int32 torch tensor on W's device, the same bits); `offsets` (uint32, host) the chunks'
    first units. `dtype` names the values' 16-bit type; `grouped` the column order (module docstring)."""
    M: int
    K: int
    nnz: int
    dtype: str
    data: object = field(repr=False)
    offsets: np.ndarray = field(repr=False)
    grouped: bool = True

    @property
    def strips(self) -> int:
        return -(-self.M // TILE)

    @property
    def chunks_per_strip(self) -> int:
        return max(1, -(-self.K // CHUNK_COLUMNS))

    @property
    def units(self) -> int:
        return int(self.offsets[-1])

    @property
    def max_chunk_units(self) -> int:
        """The largest chunk, in 16-byte units (what a kernel's buffer for one chunk must hold)."""
        return int(np.diff(self.offsets.astype(np.int64)).max(initial=0))

    @property
    def nbytes(self) -> int:
        """Bytes as stored: the chunks and the offsets."""
        return self.units * UNIT + self.offsets.size * 4

    def bytes_per_weight(self) -> float:
        return self.nbytes / (self.M * self.K)

    def on_host(self) -> "BitmapTiles":
        if isinstance(self.data, np.ndarray):
            return self
        return BitmapTiles(self.M, self.K, self.nnz, self.dtype, self.data.cpu().numpy().view(np.uint32),
                           self.offsets, self.grouped)


def _half_bits(values: np.ndarray, dtype: str) -> np.ndarray:
    """float values as the uint16 bits of `dtype` (bfloat16 rounded to nearest even)."""
    if dtype == "float16":
        return np.asarray(values, dtype=np.float16).view(np.uint16)
    if dtype != "bfloat16":
        raise ValueError(f"bitmap tiles hold float16 or bfloat16 values, got {dtype!r}")
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _layout(counts):
    """Per chunk its units (bitmaps and starts, then the values rounded up to 16 bytes) from its nonzero
    counts."""
    return HEADER_BYTES // UNIT + (2 * counts + UNIT - 1) // UNIT


WORDS_A_CHUNK = CHUNK_TILES * BITMAP_WORDS


def _starts(word_counts):
    """Per chunk (rows) and bitmap word (columns, tile-major) the values before the word in the chunk: the
    exclusive running sum of the words' nonzero counts (numpy or torch, int64)."""
    return word_counts.cumsum(1) - word_counts


def chunk_positions(grouped: bool) -> np.ndarray:
    """Per cell of a chunk (row r of 16, column c of 128: index 128 r + c) its position tile * 256 + bit: one
    gather instead of tile_column's and slot_of's arithmetic on every nonzero (int32)."""
    rows, cols = np.divmod(np.arange(TILE * CHUNK_COLUMNS), CHUNK_COLUMNS)
    tile, kk = tile_column(cols, grouped)
    return (tile * 256 + slot_of(rows, kk)).astype(np.int32)


def bitmap_tiles(w, dtype: str = "float16", grouped: bool = True) -> BitmapTiles:
    """W's bitmap tiles built by numpy from a SparseMatrix (values rounded to `dtype`), columns in the grouped
    or natural order."""
    m, k = w.shape
    strips, per_strip = -(-m // TILE), max(1, -(-k // CHUNK_COLUMNS))
    rows = np.repeat(np.arange(m, dtype=np.int64), np.diff(w.indptr))
    cols = np.asarray(w.indices, dtype=np.int64)
    key = ((rows >> 4) * per_strip + (cols >> 7)) << 11
    key += chunk_positions(grouped)[((rows & 15) << 7) | (cols & (CHUNK_COLUMNS - 1))]
    order = np.argsort(key)  # keys are distinct (one a position): any sort gives this order
    key = key[order]
    counts = np.bincount(key >> 11, minlength=strips * per_strip)
    offsets = np.concatenate([[0], np.cumsum(_layout(counts))]).astype(np.int64)
    if offsets[-1] >= 2 ** 32:
        raise ValueError(f"W's bitmap tiles take {offsets[-1] * UNIT} bytes; offsets count 16-byte units in 32 bits")
    words = np.zeros(int(offsets[-1]) * UNIT // 4, np.uint32)
    chunk_of = key >> 11
    slot = key & 2047  # tile within the chunk, then the bit
    word = offsets[chunk_of] * 4 + (slot >> 5)
    words += np.bincount(word, weights=np.ldexp(1.0, (slot & 31).astype(np.int32)),
                         minlength=words.size).astype(np.uint64).astype(np.uint32)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(key.size, dtype=np.int64) - first[chunk_of]
    halves = words.view(np.uint16)
    word_counts = np.bincount(chunk_of * WORDS_A_CHUNK + (slot >> 5), minlength=counts.size * WORDS_A_CHUNK)
    halves[(offsets[:-1] * (UNIT // 2) + BITMAP_BYTES // 2)[:, None] + np.arange(WORDS_A_CHUNK)] = \
        _starts(word_counts.reshape(-1, WORDS_A_CHUNK))
    halves[offsets[chunk_of] * (UNIT // 2) + HEADER_BYTES // 2 + rank] = \
        _half_bits(np.asarray(w.values, dtype=np.float64)[order], dtype)
    return BitmapTiles(m, k, w.nnz, dtype, words, offsets.astype(np.uint32), grouped)


def bitmap_tiles_on_device(w, dtype: str, grouped: bool = True) -> BitmapTiles:
    """bitmap_tiles' format from a formats.DeviceCsr by torch ops on W's device, the same bits (data as int32);
    offsets come to the host (one small copy)."""
    import torch

    m, k = w.shape
    dev = w.device
    strips, per_strip = -(-m // TILE), max(1, -(-k // CHUNK_COLUMNS))
    rows = torch.repeat_interleave(torch.arange(m, device=dev), torch.diff(w.indptr), output_size=w.nnz)
    cols = w.indices.long()
    place = torch.from_numpy(chunk_positions(grouped)).to(dev).long()
    key = (((rows >> 4) * per_strip + (cols >> 7)) << 11) + place[((rows & 15) << 7) | (cols & (CHUNK_COLUMNS - 1))]
    key, order = torch.sort(key)  # distinct keys
    chunk_of = key >> 11
    counts = torch.bincount(chunk_of, minlength=strips * per_strip)
    offsets = torch.zeros(strips * per_strip + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(_layout(counts), 0)
    total = int(offsets[-1])
    if total >= 2 ** 32:
        raise ValueError(f"W's bitmap tiles take {total * UNIT} bytes; offsets count 16-byte units in 32 bits")
    slot = key & 2047
    # bits of one word are distinct: their sum is their OR (int64, then the low 32 bits)
    words = torch.zeros(total * UNIT // 4, dtype=torch.int64, device=dev)
    words.index_add_(0, offsets[chunk_of] * 4 + (slot >> 5), torch.ones_like(slot) << (slot & 31))
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(key.numel(), device=dev) - first[chunk_of]
    values = w.values[order].to(getattr(torch, dtype))
    word_counts = torch.bincount(chunk_of * WORDS_A_CHUNK + (slot >> 5), minlength=counts.numel() * WORDS_A_CHUNK)
    starts = _starts(word_counts.view(-1, WORDS_A_CHUNK)).to(torch.int16)  # <= 2016: the same bits as uint16
    words.view(torch.int16)[(offsets[:-1] * (UNIT // 2) + BITMAP_BYTES // 2)[:, None]
                            + torch.arange(WORDS_A_CHUNK, device=dev)] = starts
    halves = words.view(getattr(torch, dtype))
    halves[offsets[chunk_of] * (UNIT // 2) + HEADER_BYTES // 2 + rank] = values
    return BitmapTiles(m, k, w.nnz, dtype, words, offsets.cpu().numpy().astype(np.uint32), grouped)


def decode_dense(f: BitmapTiles) -> np.ndarray:
    """W (M x K, float64) read back from the format the way a kernel walks it: per chunk its bitmaps, per
    tile the lanes' bytes in order, values consumed in bit order (a layout bug shows as a wrong product); each
    word's stored start checked against the values before it."""
    f = f.on_host()
    words = np.asarray(f.data).view(np.uint32)
    halves = words.view(np.uint16)
    with np.errstate(invalid="ignore"):  # every half widened, headers too (their bits may read as NaNs)
        values = halves.view(np.float16).astype(np.float64) if f.dtype == "float16" else \
            (halves.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    per_strip = f.chunks_per_strip
    dense = np.zeros((f.strips * TILE, per_strip * CHUNK_COLUMNS))
    slots = np.arange(256)
    rows, cols = cell_of(slots)
    for chunk in range(f.strips * per_strip):
        s, c = divmod(chunk, per_strip)
        start, end = int(f.offsets[chunk]), int(f.offsets[chunk + 1])
        base = start * UNIT // 2 + HEADER_BYTES // 2  # the chunk's first value, in halves
        stored = halves[start * UNIT // 2 + BITMAP_BYTES // 2:][:WORDS_A_CHUNK].astype(np.int64)
        at = 0
        for t in range(CHUNK_TILES):
            bitmap = words[start * 4 + t * BITMAP_WORDS: start * 4 + (t + 1) * BITMAP_WORDS]
            before = at + np.concatenate([[0], np.cumsum([bin(int(x)).count("1") for x in bitmap])[:-1]])
            assert (stored[t * BITMAP_WORDS:(t + 1) * BITMAP_WORDS] == before).all(), \
                f"chunk {chunk}, tile {t}: the stored starts disagree with the bitmap"
            bits = ((bitmap[slots >> 5] >> (slots & 31).astype(np.uint32)) & 1).astype(bool)
            n = int(bits.sum())
            dense[s * TILE + rows[bits], c * CHUNK_COLUMNS + chunk_column(t, cols[bits], f.grouped)] = \
                values[base + at: base + at + n]
            at += n
        assert (base + at) * 2 <= end * UNIT, f"chunk {chunk}: its values run past its end"
    return dense[: f.M, : f.K]
