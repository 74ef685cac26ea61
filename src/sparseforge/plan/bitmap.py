"""The bitmap mapping for decode widths (N = 1..16): W as one bit per position plus its nonzero values packed.

Why a third data layout: at the token counts of LLM decoding the product is bound by the weight's bytes,
not by math. Dense fp16 moves 2 bytes a position; padded CSR (plan/csr.py) 6 bytes a nonzero (4 of them
the index); a bitmap 1/8 byte a position plus 2 a nonzero: 6.2x fewer bytes than dense fp16 at 90%, 2.8x at
70%, 1.8x at 50% (issue 11's bounds), and the index of a nonzero costs no load at all: it is the bit's
position.

Layout (BitmapPlan), per row r of W (M x K):
- masks[r, w]: uint64, bit b set where W[r, 64 w + b] != 0 (words past K are absent: W = ceil(K / 64));
- values: the row's nonzeros in column order, each row starting at a multiple of 8 (16 bytes);
- offsets[r, s]: the index in `values` of the first nonzero of step s (words 32 s .. 32 s + 31: one word
  a lane, 2048 columns a step); S = ceil(W / 32) <= 32 steps, so K <= 65536.

The kernel (codegen/bitmap.py): a warp per row. Lane s holds offsets[r, s]; per step each lane loads its
mask word, the warp scans the words' bit counts (prefix sums by shuffle), and each lane walks its set bits
from the highest, reading value number offset + prefix + rank and B's row (kn: the N values of B[k, :]),
accumulating N sums in fp32; a fixed-order butterfly adds the lanes (deterministic, no atomics).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..formats import SparseMatrix
from .config import WARP, require_ints
from .plan import WeightAsData, check_launch, check_problem, fp32_bias

WORD = 64                  # columns a mask word covers
STEP_COLUMNS = WORD * WARP  # columns one step of a warp covers (one word a lane)
MAX_STEPS = WARP            # lane s holds step s's offset
MAX_N = 16                  # decode widths: the sums of N columns live in registers
VALUE_ALIGN = 8             # each row's values start at a multiple of 8 values (16 bytes in fp16)


@dataclass(frozen=True)
class BitmapConfig:
    warps_per_block: int = 4  # rows a block holds (a warp per row)
    # set bits a lane takes per iteration of its loop (each predicated on the mask not yet empty): 2 and 4
    # put that many value and B loads in flight before their FMAs
    unroll: int = 2

    def __post_init__(self):
        require_ints(self)
        if self.warps_per_block not in (1, 2, 4, 8):  # 16 (512 threads, 128 registers each) spills on sm_80
            raise ValueError(f"warps_per_block must be 1, 2, 4 or 8, got {self.warps_per_block}")
        if self.unroll not in (1, 2, 4):
            raise ValueError(f"unroll must be 1, 2 or 4, got {self.unroll}")

    @property
    def threads(self) -> int:
        return self.warps_per_block * WARP

    def short(self) -> str:
        return f"bmp_w{self.warps_per_block}u{self.unroll}"


@dataclass(frozen=True, eq=False)
class BitmapPlan(WeightAsData):
    """What the bitmap decode kernel needs: the problem, the config and W as bitmap + packed values."""
    M: int
    K: int
    N: int
    layout: str
    dtype: str
    config: BitmapConfig
    masks: np.ndarray = field(repr=False)    # uint64 [M, words]
    values: np.ndarray = field(repr=False)   # float32 [slots] (converted to the kernel's dtype on upload)
    offsets: np.ndarray = field(repr=False)  # int32 [M, steps]
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
    def steps(self) -> int:
        return self.offsets.shape[1]

    @property
    def grid(self) -> tuple[int, int]:
        """(1, row blocks) of one batch entry: every column of N is in a lane's registers."""
        return 1, math.ceil(self.M / self.config.warps_per_block)

    @property
    def load_width(self) -> int:
        """Elements of B[k, :] one load brings: the widest of 8/4/2/1 dividing N within 16 bytes."""
        for width in (8, 4, 2, 1):
            if width * self.element_bytes <= 16 and self.N % width == 0:
                return width
        return 1

    def weight_arrays(self) -> tuple[tuple[np.ndarray, str], ...]:
        """The arrays the kernel reads, in its parameter order after B and C, with the dtype each is
        uploaded as ("values": the kernel's dtype)."""
        return (self.values, "values"), (self.masks, "uint64"), (self.offsets, "int32")

    def bytes_read(self) -> int:
        """W's bytes the kernel streams once: masks, values (with row padding), offsets."""
        return self.masks.nbytes + self.values.size * self.element_bytes + self.offsets.nbytes

    def describe(self) -> str:
        dense = self.M * self.K * self.element_bytes
        return (f"Plan {self.name}\n  W {self.M}x{self.K}, nnz {self.nnz}; N {self.N}; layout {self.layout}; "
                f"dtype {self.dtype}\n  bitmap + packed values: {self.bytes_read()} bytes of W "
                f"({dense / max(self.bytes_read(), 1):.2f}x fewer than dense); a warp per row, "
                f"{self.config.unroll} set bits a lane per iteration; grid {self.grid} x batch, {self.threads} threads")


def make_bitmap_plan(w: SparseMatrix, n: int, dtype: str = "float16", layout: str = "kn",
                     config: BitmapConfig | None = None, bias=None, relu: bool = False, arch: int = 90,
                     residual: bool = False) -> BitmapPlan:
    check_problem(n, dtype, layout)
    config = config or BitmapConfig()
    m, k = w.shape
    if n > MAX_N:
        raise ValueError(f"the bitmap decode kernel keeps N sums per lane in registers: N <= {MAX_N}, got {n}")
    if layout == "nk" and n > 1:
        raise ValueError("the bitmap decode kernel reads B's rows (layout 'kn'); with layout 'nk' it takes "
                         "N = 1 only (where both layouts are one vector): use another mapping")
    words = max(1, math.ceil(k / WORD))
    steps = math.ceil(words / WARP)
    if steps > MAX_STEPS:
        raise ValueError(f"K = {k}: the bitmap decode kernel covers K <= {MAX_STEPS * STEP_COLUMNS} "
                         f"({MAX_STEPS} steps of {STEP_COLUMNS} columns)")
    rows = np.repeat(np.arange(m), w.row_nnz)
    cols = w.indices.astype(np.int64)
    masks = np.zeros((m, words), np.uint64)
    np.bitwise_or.at(masks, (rows, cols // WORD), np.left_shift(np.uint64(1), (cols % WORD).astype(np.uint64)))
    counts = w.row_nnz.astype(np.int64)
    padded = -(-counts // VALUE_ALIGN) * VALUE_ALIGN
    starts = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64)
    slots = int(padded.sum())
    if slots >= 2 ** 31:
        raise ValueError(f"W has {slots} padded nonzeros; the bitmap kernel indexes them with 32 bits")
    values = np.zeros(max(slots, VALUE_ALIGN), np.float32)
    values[np.repeat(starts - w.indptr[:-1], counts) + np.arange(w.nnz)] = w.values.astype(np.float32)
    # offsets[r, s]: the row's start plus its nonzeros in the columns before step s
    step_of = cols // STEP_COLUMNS
    before = np.zeros((m, steps + 1), np.int64)
    np.add.at(before, (rows, step_of + 1), 1)
    offsets = (starts[:, None] + np.cumsum(before, axis=1)[:, :steps]).astype(np.int32)
    plan = BitmapPlan(m, k, n, layout, dtype, config, masks, values, offsets, w.nnz, fp32_bias(bias, m), relu,
                      arch, w.digest(), residual=bool(residual))
    check_launch(plan.grid)
    return plan


def execute_bitmap(plan: BitmapPlan, b: np.ndarray) -> np.ndarray:
    """float64 reference of what the kernel computes, read back from the bitmap layout itself (so a layout
    bug shows here too)."""
    b = np.asarray(b, dtype=np.float64)
    if b.ndim == 3:
        return np.stack([execute_bitmap(plan, one) for one in b])
    operand = b if plan.layout == "kn" else b.T
    out = np.zeros((plan.M, plan.N))
    for r in range(plan.M):
        bits = np.unpackbits(plan.masks[r].view(np.uint8), bitorder="little")[:plan.K].astype(bool)
        cols = np.flatnonzero(bits)
        first = int(plan.offsets[r, 0]) if plan.steps else 0
        out[r] = plan.values[first:first + cols.size].astype(np.float64) @ operand[cols]
    if plan.bias is not None:
        out += np.asarray(plan.bias)[:, None]
    if plan.relu:
        out = np.maximum(out, 0)
    return out if plan.layout == "kn" else out.T
