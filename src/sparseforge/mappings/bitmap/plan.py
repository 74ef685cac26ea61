"""The bitmap mapping for decode (N = 1): W as one bit per position plus its nonzero values packed.

Why a third data layout: at N = 1 (LLM token generation) the product is bound by the weight's bytes, not by
math. Dense fp16 moves 2 bytes a position; padded CSR with 16-bit indices (mappings/csr/plan.py) 4 bytes a nonzero;
a bitmap 1/8 byte a position plus 2 a nonzero: 6.2x fewer bytes than dense fp16 at 90%, 2.8x at 70%, 1.8x
at 50% (the bounds), and a nonzero's index costs no load: it is the bit's position.

Why this layout (the second design; the first, a lane walking a 64-bit word of 64 consecutive columns and
reading its values and x from global memory, measured 1.3-1.5x slower than CSR on the H200): there every
load of a warp touched 32 different cache lines, one per lane, so the L1 spent 32 cycles per load. Here
- lane l of a warp owns the columns 32 j + l: its x values, staged once per block in shared memory, sit in
  bank l whatever j is, so a warp's x reads never conflict;
- the warp copies the values with coalesced 16-byte loads into a per-warp shared buffer before the lanes
  walk their bits, so no lane reads global memory alone.

Layout (BitmapPlan), per row r of W (M x K), T = ceil(K / 1024) words per lane:
- masks[r, t, l]: uint32, bit b set where W[r, 1024 t + 32 b + l] != 0 (columns past K: never set);
- values: per (r, t) a block of the warp's values for word t, lane after lane, each lane's from its highest
  bit down (the order its walk finds them), the block padded with zeros to a multiple of 8 values; a row's
  blocks follow each other in t, rows in r;
- row_starts[r]: the index in `values` of the row's first block (a multiple of 8: 16-byte aligned).
A block's size and each lane's place in it are not stored: the kernel scans the words' bit counts.

The kernel (render.py): a block stages x (K values) in shared memory, then each warp takes
rows_per_warp consecutive rows. Per row and word t: the warp scans its lanes' bit counts by shuffle, copies
the block into its buffer, and each lane walks its word's set bits from the highest (bfind), reading
x[1024 t + 32 b + l] and its next value from shared memory into fp32 sums; a fixed-order butterfly adds the
lanes (deterministic, no atomics), lane 0 adds bias and the residual, applies ReLU and stores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ...formats import SparseMatrix
from ...plan.config import WARP, require_ints
from ...plan.plan import DEFAULT_LAYOUT, WeightAsData, check_launch, check_problem, fp32_bias

WORD_BITS = 32                    # bits of a lane's mask word
WORD_COLUMNS = WORD_BITS * WARP   # columns one word of every lane covers (1024)
VALUE_ALIGN = 8                   # each block of values is padded to a multiple of 8 (16 bytes in fp16)
MAX_WORDS = 16                    # words a lane keeps in registers: K <= 16384
SHARED_LIMIT = 48 * 1024          # static shared memory of a block: x staged + one value buffer a warp


@dataclass(frozen=True)
class BitmapConfig:
    warps_per_block: int = 4  # warps of a block (each with its own value buffer; x staged once per block)
    rows_per_warp: int = 2    # consecutive rows a warp takes: x is staged once per block for all of them
    unroll: int = 2           # set bits a lane takes per iteration of its walk, their loads in flight together

    def __post_init__(self):
        require_ints(self)
        if self.warps_per_block not in (1, 2, 4, 8):
            raise ValueError(f"warps_per_block must be 1, 2, 4 or 8, got {self.warps_per_block}")
        if self.rows_per_warp not in (1, 2, 4, 8):
            raise ValueError(f"rows_per_warp must be 1, 2, 4 or 8, got {self.rows_per_warp}")
        if self.unroll not in (1, 2, 4):
            raise ValueError(f"unroll must be 1, 2 or 4, got {self.unroll}")

    @property
    def threads(self) -> int:
        return self.warps_per_block * WARP

    def short(self) -> str:
        return f"bmp_w{self.warps_per_block}r{self.rows_per_warp}u{self.unroll}"


@dataclass(frozen=True, eq=False)
class BitmapPlan(WeightAsData):
    """What the bitmap decode kernel needs: the problem, the config and W as bitmap + packed values."""
    M: int
    K: int
    N: int
    layout: str
    dtype: str
    config: BitmapConfig
    masks: np.ndarray = field(repr=False)       # uint32 [M, words, 32]
    values: np.ndarray = field(repr=False)      # float32 [slots] (converted to the kernel's dtype on upload)
    row_starts: np.ndarray = field(repr=False)  # int32 [M]
    nnz: int = 0
    bias: tuple[float, ...] | None = None
    relu: bool = False
    arch: int = 90
    digest: str = ""

    family = "bitmap"  # W is data the runtime uploads (weight_arrays), not code
    mapping = "bitmap"
    partial_rows: tuple[int, ...] = ()
    residual: bool = False  # the epilogue adds R (laid out as the output, parameter p_residual) before ReLU

    @property
    def words(self) -> int:
        return self.masks.shape[1]

    @property
    def rows_per_block(self) -> int:
        return self.config.warps_per_block * self.config.rows_per_warp

    @property
    def grid(self) -> tuple[int, int]:
        """(1, row blocks) of one batch entry."""
        return 1, math.ceil(self.M / self.rows_per_block)

    @property
    def x_bytes(self) -> int:
        """Shared bytes of the staged x (K values, rounded up to 16)."""
        return -(-self.K * self.element_bytes // 16) * 16

    @property
    def buffer_bytes(self) -> int:
        """Shared bytes of one warp's value buffer: the largest block (every bit of a word set)."""
        return WORD_COLUMNS * self.element_bytes

    @property
    def shared_bytes(self) -> int:
        return self.x_bytes + self.config.warps_per_block * self.buffer_bytes

    def weight_arrays(self) -> tuple[tuple[np.ndarray, str], ...]:
        """The arrays the kernel reads, in its parameter order after B and C, with the dtype each is
        uploaded as ("values": the kernel's dtype)."""
        return (self.values, "values"), (self.masks.view(np.int32), "int32"), (self.row_starts, "int32")

    def bytes_read(self) -> int:
        """W's bytes the kernel streams once: masks, values (with block padding), row starts."""
        return self.masks.nbytes + self.values.size * self.element_bytes + self.row_starts.nbytes

    def describe(self) -> str:
        dense = self.M * self.K * self.element_bytes
        c = self.config
        return (f"Plan {self.name}\n  W {self.M}x{self.K}, nnz {self.nnz}; N {self.N}; layout {self.layout}; "
                f"dtype {self.dtype}\n  bitmap + packed values: {self.bytes_read()} bytes of W "
                f"({dense / max(self.bytes_read(), 1):.2f}x fewer than dense); lane l owns columns 32 j + l, "
                f"x and a warp's values in shared memory ({self.shared_bytes} bytes a block); {c.rows_per_warp} "
                f"rows a warp, {c.unroll} set bits a lane per iteration; grid {self.grid} x batch, {self.threads} threads")


def make_bitmap_plan(w: SparseMatrix, n: int, dtype: str = "float16", layout: str = DEFAULT_LAYOUT,
                     config: BitmapConfig | None = None, bias=None, relu: bool = False, arch: int = 90,
                     residual: bool = False) -> BitmapPlan:
    check_problem(n, dtype, layout)
    config = config or BitmapConfig()
    m, k = w.shape
    if n != 1:
        raise ValueError(f"the bitmap decode kernel computes N = 1 (a matrix-vector product), got N = {n}: use "
                         "another mapping (compile_spmm without a config chooses one)")
    words = max(1, math.ceil(k / WORD_COLUMNS))
    if words > MAX_WORDS:
        raise ValueError(f"K = {k}: the bitmap decode kernel keeps a lane's mask words in registers and x in "
                         f"shared memory, so K <= {MAX_WORDS * WORD_COLUMNS}: use another mapping")
    rows = np.repeat(np.arange(m, dtype=np.int64), w.row_nnz)
    cols = w.indices.astype(np.int64)
    word, bit, lane = cols // WORD_COLUMNS, (cols % WORD_COLUMNS) // WARP, cols % WARP
    masks = np.zeros((m, words, WARP), np.uint32)
    np.bitwise_or.at(masks, (rows, word, lane), np.left_shift(np.uint32(1), bit.astype(np.uint32)))
    # the kernel's order: row, word, lane, bit from the highest down
    order = np.lexsort((-bit, lane, word, rows))
    block = rows * words + word
    counts = np.bincount(block, minlength=m * words).astype(np.int64)
    padded = -(-counts // VALUE_ALIGN) * VALUE_ALIGN
    starts = np.concatenate([[0], np.cumsum(padded)[:-1]])
    slots = int(padded.sum())
    if slots >= 2 ** 31:
        raise ValueError(f"W has {slots} padded nonzeros; the bitmap kernel indexes them with 32 bits")
    values = np.zeros(max(slots, VALUE_ALIGN), np.float32)
    sorted_block = block[order]
    rank = np.arange(w.nnz) - np.concatenate([[0], np.cumsum(counts)])[sorted_block]
    values[starts[sorted_block] + rank] = w.values.astype(np.float32)[order]
    row_starts = starts.reshape(m, words)[:, 0].astype(np.int32) if m else np.zeros(0, np.int32)
    plan = BitmapPlan(m, k, n, layout, dtype, config, masks, values, row_starts, w.nnz, fp32_bias(bias, m), relu,
                      arch, w.digest(), residual=bool(residual))
    if plan.shared_bytes > SHARED_LIMIT:
        raise ValueError(f"K = {k} in {dtype} with {config.warps_per_block} warps a block needs {plan.shared_bytes} "
                         f"bytes of shared memory (x staged + a value buffer a warp), over {SHARED_LIMIT}: use fewer "
                         "warps_per_block, a 16-bit dtype, or another mapping")
    check_launch(plan.grid)
    return plan


def row_columns(plan: BitmapPlan, r: int) -> np.ndarray:
    """Row r's columns in the order the kernel walks them (word, lane, bit from the highest)."""
    t, lane, b = np.nonzero(np.unpackbits(plan.masks[r].view(np.uint8), bitorder="little")
                            .reshape(plan.words, WARP, WORD_BITS))
    order = np.lexsort((-b, lane, t))
    return (t * WORD_COLUMNS + b * WARP + lane)[order], t[order]


def execute_bitmap(plan: BitmapPlan, b: np.ndarray) -> np.ndarray:
    """float64 reference of what the kernel computes, read back from the bitmap layout itself (so a layout
    bug shows here too)."""
    b = np.asarray(b, dtype=np.float64)
    if b.ndim == 3:
        return np.stack([execute_bitmap(plan, one) for one in b])
    x = b.reshape(-1)
    out = np.zeros((plan.M, 1))
    for r in range(plan.M):
        cols, word = row_columns(plan, r)
        counts = np.bincount(word, minlength=plan.words)
        starts = plan.row_starts[r] + np.concatenate([[0], np.cumsum(-(-counts // VALUE_ALIGN) * VALUE_ALIGN)[:-1]])
        rank = np.arange(cols.size) - np.concatenate([[0], np.cumsum(counts)])[word]
        out[r, 0] = plan.values[starts[word] + rank].astype(np.float64) @ x[cols]
    if plan.bias is not None:
        out += np.asarray(plan.bias)[:, None]
    if plan.relu:
        out = np.maximum(out, 0)
    return out if plan.layout == "kn" else out.T


def bitmap_traffic(plan: BitmapPlan) -> dict[str, int]:
    """W's bitmap and values streamed once, B's rows per nonzero, C written once; and the floor."""
    output = plan.M * plan.N * plan.element_bytes
    b_reads = plan.nnz * plan.N * plan.element_bytes
    return {"fetched_bytes": plan.bytes_read() + b_reads + output,
            "floor_bytes": plan.bytes_read() + plan.K * plan.N * plan.element_bytes + output}
