"""W's values and column indices as data (padded CSR): two mappings over one layout.

- "csr" (CsrConfig, the small-N kernel): lanes over a row's nonzeros, each lane a few output columns.
- "csr-columns" (CsrColumnsConfig, Sputnik's one-dimensional tiling): a warp per row (or several warps
  splitting its nonzeros), lanes across N. The warp reads 32 of the row's (index, value) pairs with one
  coalesced load and broadcasts each by shuffle; every nonzero's B row segment is then one coalesced
  load across the lanes. Where the first kernel's lanes each gather their own 32-byte piece of a
  different B row (one L1 wavefront per lane and load), this one touches one or two lines per load, and
  its instruction stream does not grow with the nonzeros the way the generated kernels' does (~16 bytes of
  SASS per nonzero): the case of large layers at moderate N (rn50's N = 49 layers with 100-240k nonzeros).

Why a second family: at N = 1..32 the generated kernels' instruction stream *is* the weight (~16 bytes of
SASS per nonzero against 4-8 bytes as data: value + index), one lane in 32 does useful work at N = 1, and
a 200k-nonzero layer takes seconds to compile (the 1000 x 2048 FC layer at N = 1 ran 26.9 us against
3.4 us for cuBLAS). Here the kernel depends only on the shape, so one compile serves every pattern.

Layout (CsrPlan): each row's nonzeros start at a multiple of 4 (the padding is never read as a weight: a
lane's FMA is predicated on the row's real end), so a lane reads 4 column indices and 4 values with one
16-byte (8-byte for 16-bit values) load. `lanes_per_row` lanes share a row (short rows: 32 / lanes rows per
warp), each accumulating `columns` output columns in fp32; a butterfly over the row's lanes sums them in a
fixed order, so the result is deterministic (no atomics).

"csr-staged" (CsrConfig with stage_b, decode widths N = 2..64 that fit one column tile): the same lanes over
a row's nonzeros, but each block first copies B (K x N, the batch entry's) into shared memory, and then
takes rows block after block (persistent: `ctas` blocks, about one per SM, stride over the row blocks). The
csr kernel re-reads a lane's 16-32-byte piece of B row k from L1/L2 for every nonzero and column tile, and
at N = 8-16 those gathers, not W's bytes, bound it (0.4-0.7 TB/s of W on the H200); read
from shared memory they cost one LDS a nonzero, and W is read once (one column tile). The copy costs
ctas x K x N x element bytes from L2 (132 x 128 KB at K = 4096, N = 16 in fp16), once per call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ...formats import SparseMatrix
from ...plan.config import WARP, require_ints, shared_bytes_limit
from ...plan.plan import DEFAULT_LAYOUT, ELEMENT_BYTES, WeightAsData, check_launch, check_problem, fp32_bias

NNZ_PER_STEP = 4  # nonzeros a lane takes per step: one vector load of indices, one of values
MAX_SHORT_INDEX = 65535  # the small-N kernel stores column indices in 16 bits up to this one


@dataclass(frozen=True)
class CsrConfig:
    lanes_per_row: int = 32   # lanes that share one row's nonzeros (4..32); 32 / lanes rows per warp
    columns: int = 8          # output columns (of N) one lane accumulates; grid.x covers N in these tiles
    warps_per_block: int = 4  # rows per block = warps * 32 / lanes_per_row
    # steps of 4 nonzeros a lane issues before waiting on any: the loop's chain (indices, then B) is two
    # dependent L2 round trips per iteration, so 2 halves the iterations of rows up to 256 nonzeros
    unroll: int = 1
    # csr-staged: B copied into shared memory once per block, blocks persistent over the rows (module doc)
    stage_b: bool = False
    ctas: int = 0             # csr-staged: blocks of the grid (about one per SM); 0 otherwise
    # software pipelining: a lane issues the next step's index and value loads before the current step's B
    # loads and FMAs, so a row pays one HBM round trip (its first step), not one a step; csr-staged also
    # loads the next row's range while it works on this one, and the first step's loads fly during the
    # copy of B. Costs the next step's raw words in registers (4-8 a step of 4 nonzeros: indices and values,
    # 16 or 32 bits each)
    prefetch: bool = False

    def __post_init__(self):
        require_ints(self, flags=("stage_b", "prefetch"))
        if self.stage_b and not 1 <= self.ctas <= 65535:
            raise ValueError(f"a csr-staged config needs ctas (its persistent blocks) in 1..65535, got {self.ctas}")
        if not self.stage_b and self.ctas:
            raise ValueError(f"ctas applies to csr-staged configs only (stage_b=True), got ctas={self.ctas}")
        if self.lanes_per_row not in (4, 8, 16, 32):
            raise ValueError(f"lanes_per_row must be 4, 8, 16 or 32, got {self.lanes_per_row}")
        if not 1 <= self.columns <= 32:
            raise ValueError(f"columns must be in 1..32, got {self.columns}")
        if self.warps_per_block not in (1, 2, 4, 8, 16):
            raise ValueError(f"warps_per_block must be 1, 2, 4, 8 or 16, got {self.warps_per_block}")
        if self.unroll not in (1, 2):
            raise ValueError(f"unroll must be 1 or 2, got {self.unroll}")
        if self.unroll * self.columns > 16:
            raise ValueError(f"unroll x columns must be <= 16 (B values held in registers), got "
                             f"{self.unroll} x {self.columns}")

    @property
    def threads(self) -> int:
        return self.warps_per_block * WARP

    @property
    def rows_per_block(self) -> int:
        return self.threads // self.lanes_per_row

    def short(self) -> str:
        return (f"csr_l{self.lanes_per_row}c{self.columns}w{self.warps_per_block}"
                + (f"u{self.unroll}" if self.unroll > 1 else "") + (f"s{self.ctas}" if self.stage_b else "")
                + ("p" if self.prefetch else ""))


@dataclass(frozen=True)
class CsrColumnsConfig:
    columns: int = 1          # output columns per lane: a warp covers 32 x columns of N
    warps_per_row: int = 1    # warps splitting one row's nonzeros (chunks of 32 dealt round robin); their
    # partial sums meet in shared memory and are added in warp order (deterministic, no atomics)
    rows_per_block: int = 4   # rows one block holds: a block is rows_per_block x warps_per_row warps

    def __post_init__(self):
        require_ints(self)
        if self.columns not in (1, 2, 4, 8):
            raise ValueError(f"columns must be 1, 2, 4 or 8, got {self.columns}")
        if self.warps_per_row not in (1, 2, 4, 8):
            raise ValueError(f"warps_per_row must be 1, 2, 4 or 8, got {self.warps_per_row}")
        if self.rows_per_block not in (1, 2, 4, 8):
            raise ValueError(f"rows_per_block must be 1, 2, 4 or 8, got {self.rows_per_block}")
        if self.warps_per_row * self.rows_per_block > 8:
            # at 512 threads a thread may hold 128 registers: a chunk's hoisted loads spill (ptxas 13.0)
            raise ValueError(f"warps_per_row x rows_per_block must be <= 8 warps (256 threads), got "
                             f"{self.warps_per_row} x {self.rows_per_block}")

    @property
    def threads(self) -> int:
        return self.warps_per_row * self.rows_per_block * WARP

    @property
    def tile_columns(self) -> int:
        return WARP * self.columns

    def short(self) -> str:
        return f"csrc_c{self.columns}s{self.warps_per_row}r{self.rows_per_block}"


@dataclass(frozen=True, eq=False)
class CsrPlan(WeightAsData):
    """What the small-N kernel needs: the problem, the config and the weight as padded-CSR arrays."""
    M: int
    K: int
    N: int
    layout: str
    dtype: str
    config: CsrConfig | CsrColumnsConfig
    rows: np.ndarray = field(repr=False)     # int32 [M, 2] on the host: (first slot, end of the real nonzeros)
    # cols and values: numpy on the host (make_csr_plan), or torch tensors on W's device, already as the
    # kernel reads them (make_csr_plan_on_device: uint16 indices held as int16, values in the kernel's dtype)
    cols: np.ndarray = field(repr=False)     # int32 or uint16 [slots]: column index (padding: 0, never used)
    values: np.ndarray = field(repr=False)   # float32 [slots]: weight values (padding: 0, never used)
    nnz: int = 0
    bias: tuple[float, ...] | None = None
    relu: bool = False
    arch: int = 90
    digest: str = ""

    family = "csr"  # W as data (the runtime passes the arrays); Plan's family is "tile"
    partial_rows: tuple[int, ...] = ()
    residual: bool = False  # the epilogue adds R (laid out as the output, parameter p_residual) before ReLU

    @property
    def mapping(self) -> str:
        if isinstance(self.config, CsrColumnsConfig):
            return "csr-columns"
        return "csr-staged" if self.config.stage_b else "csr"

    @property
    def staged(self) -> bool:
        return isinstance(self.config, CsrConfig) and self.config.stage_b

    @property
    def dynamic_shared_bytes(self) -> int:
        """Shared memory the launch gives a block beyond the kernel's static declarations: csr-staged's copy
        of B (K rows of N elements, rounded up to 16 bytes); 0 for the other mappings."""
        return -(-self.K * self.N * self.element_bytes // 16) * 16 if self.staged else 0

    def weight_arrays(self) -> tuple[tuple[np.ndarray, str], ...]:
        """The arrays the kernel reads, in its parameter order after B and C, with the dtype each is
        uploaded as ("values": the kernel's dtype)."""
        return (self.values, "values"), (self.cols, "uint16" if self.index_bytes == 2 else "int32"), (self.rows, "int32")

    @property
    def index_bytes(self) -> int:
        """Bytes of one column index: 2 for the small-N kernel where K <= 65536 (see make_csr_plan)."""
        return self.cols.dtype.itemsize

    @property
    def slots(self) -> int:
        """Entries of cols and values: the nonzeros, each row padded to a multiple of NNZ_PER_STEP."""
        return int(self.cols.shape[0])

    def host_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(cols, values) in host memory (int32 / uint16 and float32), wherever the plan holds them."""
        if isinstance(self.cols, np.ndarray):
            return self.cols, self.values
        cols = self.cols.cpu().numpy()
        return (cols.view(np.uint16) if self.index_bytes == 2 else cols), self.values.float().cpu().numpy()

    @property
    def grid(self) -> tuple[int, int]:
        """(column tiles, row blocks) of one batch entry."""
        if isinstance(self.config, CsrColumnsConfig):
            return math.ceil(self.N / self.config.tile_columns), math.ceil(self.M / self.config.rows_per_block)
        row_blocks = math.ceil(self.M / self.config.rows_per_block)
        if self.config.stage_b:  # persistent: each block strides over the row blocks
            return 1, min(self.config.ctas, row_blocks)
        return math.ceil(self.N / self.config.columns), row_blocks

    @property
    def load_width(self) -> int:
        """Elements of one B row (kn) a lane reads with one load: the widest of 8/4/2/1 that divides both
        its column tile and N (so no vector straddles N), within 16 bytes. nk reads one element at a time.
        csr-columns: a lane's columns are one vector where N allows it, else `columns` single elements 32
        apart (each load still coalesced across the warp)."""
        if self.layout == "nk" and not self.staged:  # csr-staged's copy of B is K x N whatever the layout
            return 1
        if isinstance(self.config, CsrColumnsConfig):
            c = self.config.columns
            return c if self.N % c == 0 and c * self.element_bytes <= 16 else 1
        for width in (8, 4, 2, 1):
            if width * self.element_bytes <= 16 and self.config.columns % width == 0 and self.N % width == 0:
                return width
        return 1

    def describe(self) -> str:
        slots = self.slots
        c = self.config
        how = (f"{c.warps_per_row} warp(s) per row, lanes across N, {c.columns} columns per lane"
               if isinstance(c, CsrColumnsConfig) else f"{c.lanes_per_row} lanes per row, {c.columns} columns per lane")
        if self.staged:
            how += f"; B staged in shared memory ({self.dynamic_shared_bytes} bytes), {c.ctas} persistent blocks"
        return (f"Plan {self.name}\n  W {self.M}x{self.K}, nnz {self.nnz} ({slots} slots, padded to "
                f"{NNZ_PER_STEP} per row); N {self.N}; layout {self.layout}; dtype {self.dtype}\n"
                f"  values and indices as data; {how}; grid {self.grid} x batch, {self.threads} threads")


def make_csr_plan(w: SparseMatrix, n: int, dtype: str = "float32", layout: str = DEFAULT_LAYOUT,
                  config: CsrConfig | CsrColumnsConfig | None = None, bias=None, relu: bool = False,
                  arch: int = 90, residual: bool = False) -> CsrPlan:
    config, short = _checked_options(n, dtype, layout, config, w.shape[1])

    def pack():
        counts = w.row_nnz.astype(np.int64)
        padded = -(-counts // NNZ_PER_STEP) * NNZ_PER_STEP
        starts = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64)
        slots = _checked_slots(int(padded.sum()))
        cols = np.zeros(max(slots, NNZ_PER_STEP), np.uint16 if short else np.int32)
        values = np.zeros(max(slots, NNZ_PER_STEP), np.float32)
        where = np.repeat(starts - w.indptr[:-1], counts) + np.arange(w.nnz)
        cols[where] = w.indices
        values[where] = w.values.astype(np.float32)
        return np.stack([starts, starts + counts], axis=1).astype(np.int32), cols, values

    # every csr config pads alike: only the index width shapes the arrays (values stay float32 here)
    rows, cols, values = w.packed(("csr", short), pack)
    return _checked_plan(CsrPlan(w.shape[0], w.shape[1], n, layout, dtype, config, rows, cols, values, w.nnz,
                                 fp32_bias(bias, w.shape[0]), relu, arch, w.digest(), residual=bool(residual)))


def make_csr_plan_on_device(w, n: int, dtype: str = "float32", layout: str = DEFAULT_LAYOUT,
                            config: CsrConfig | CsrColumnsConfig | None = None, bias=None, relu: bool = False,
                            arch: int = 90, residual: bool = False) -> CsrPlan:
    """make_csr_plan's plan from a formats.DeviceCsr, its cols and values packed by torch ops on W's device
    and left there as the kernel reads them (the same slots, bit for bit: tests/cpu/mappings); only the
    per-row ranges (M x 2) come to the host. Plans of one DeviceCsr share its arrays (DeviceCsr.packed). The
    plan's digest is empty: W is data, its kernel keyed by shape and options (runtime.kernel.plan_spec)."""
    import torch

    config, short = _checked_options(n, dtype, layout, config, w.shape[1])

    def pack():
        device = w.device
        counts = w.row_nnz()
        padded = (counts + NNZ_PER_STEP - 1) // NNZ_PER_STEP * NNZ_PER_STEP
        ends = torch.cumsum(padded, 0)
        starts = ends - padded
        slots = _checked_slots(int(ends[-1]))
        row_of = torch.repeat_interleave(torch.arange(w.shape[0], device=device), counts, output_size=w.nnz)
        where = (starts - w.indptr[:-1])[row_of] + torch.arange(w.nnz, device=device)
        # uint16 indices travel as int16 (torch's casts wrap: the same 16 bits); values in the kernel's dtype
        cols = torch.zeros(max(slots, NNZ_PER_STEP), dtype=torch.int16 if short else torch.int32, device=device)
        cols[where] = w.indices.to(cols.dtype)
        values = torch.zeros(max(slots, NNZ_PER_STEP), dtype=getattr(torch, dtype), device=device)
        values[where] = w.values.to(values.dtype)
        return torch.stack([starts, starts + counts], dim=1).to(torch.int32).cpu().numpy(), cols, values

    # every csr config pads alike: only the index width and the dtype shape the arrays
    rows, cols, values = w.packed(("csr", short, dtype), pack)
    return _checked_plan(CsrPlan(w.shape[0], w.shape[1], n, layout, dtype, config, rows, cols, values, w.nnz,
                                 fp32_bias(bias, w.shape[0]), relu, arch, "", residual=bool(residual)))


def _checked_options(n: int, dtype: str, layout: str, config, k: int) -> tuple[CsrConfig | CsrColumnsConfig, bool]:
    """(the config, whether column indices are 16-bit): the problem's refusals before any array is made."""
    check_problem(n, dtype, layout)
    config = config or CsrConfig()
    if n * ELEMENT_BYTES[dtype] >= 2 ** 32:  # a B row's bytes are a 32-bit immediate of the address arithmetic
        raise ValueError(f"N = {n}: a row of B would be {n * ELEMENT_BYTES[dtype]} bytes, over the 4 GiB the CSR "
                         "kernels address with one 32-bit stride; split N")
    if isinstance(config, CsrColumnsConfig) and layout != "kn":
        raise ValueError("the csr-columns mapping reads B's rows across the lanes (layout 'kn'); with layout "
                         "'nk' a lane's columns are K elements apart: use a CsrConfig or a TileConfig")
    # The small-N kernel at decode widths is bound by W's bytes: a 16-bit index makes a nonzero 4 bytes in
    # fp16 instead of 6 (1.5x fewer). csr-columns broadcasts indices by shuffle and the convolution packs
    # taps into the index's top bits: both keep 32 bits.
    return config, isinstance(config, CsrConfig) and k <= MAX_SHORT_INDEX + 1


def _checked_slots(slots: int) -> int:
    if slots >= 2 ** 31:
        raise ValueError(f"W has {slots} padded nonzeros; the small-N kernel indexes them with 32 bits")
    return slots


def _checked_plan(plan: CsrPlan) -> CsrPlan:
    """The refusals that depend on the whole plan (load width, registers, shared memory, grid)."""
    config, n, dtype = plan.config, plan.N, plan.dtype
    if isinstance(config, CsrColumnsConfig) and config.columns == 8 and plan.load_width != 8:
        # eight single loads a nonzero: ptxas hoists the chunk's loads past 255 registers and spills
        raise ValueError(f"csr-columns with 8 columns a lane needs them as one 16-byte load (a 16-bit dtype "
                         f"and N a multiple of 8); got {dtype}, N = {n}: use columns <= 4")
    if isinstance(config, CsrColumnsConfig) and plan.arch < 90 and _b_registers(plan) >= 4:
        # measured with ptxas 13.0: for sm_80 it keeps all 32 nonzeros' B loads of a chunk in flight and
        # spills past 255 registers at 4 B registers a nonzero (sm_90's allocation stays near 195)
        raise ValueError(f"csr-columns with {config.columns} {dtype} columns a lane spills on sm_{plan.arch}: use "
                         "columns <= 2 there (4 for a 16-bit dtype with N a multiple of 4)")
    if plan.staged:
        _check_staged(plan)
    check_launch(plan.grid)
    return plan


def densify_csr(plan: CsrPlan, arrays, out):
    """W dense in `out` (torch, M x K, on the arrays' device) from the kernel's device arrays (values, cols,
    rows: runtime.kernel.weight_data), by torch ops on that device and without a host sync. Every slot is
    scattered, padding too (value 0 at column 0, added: it changes nothing), so the temporaries are one row
    index and one column index a slot."""
    import torch

    values, cols, rows = arrays[:3]
    slots = int(plan.rows[-1, 0] + -(-(plan.rows[-1, 1] - plan.rows[-1, 0]) // NNZ_PER_STEP) * NNZ_PER_STEP) \
        if plan.M else 0  # the last row's padded end, from the host copy of the plan
    starts = rows[:, 0].long()
    padded = torch.diff(starts, append=starts.new_full((1,), slots))  # filled on the device: no host copy
    row_of = torch.repeat_interleave(torch.arange(plan.M, device=out.device), padded, output_size=slots)
    col = cols[:slots].long() & 0xFFFF if cols.dtype == torch.int16 else cols[:slots].long()  # uint16 as int16
    out.zero_()
    # atomic adds into the flat view (no sort, as index_put_ with accumulate does): each cell gets its one
    # value and exact zeros
    out.view(-1).index_add_(0, row_of * plan.K + col, values[:slots].to(out.dtype))
    return out


def staged_fits(k: int, n: int, dtype: str, arch: int = 90) -> bool:
    """Whether B (K x N in dtype) fits csr-staged's shared memory on sm_<arch>."""
    return -(-k * n * ELEMENT_BYTES[dtype] // 16) * 16 <= shared_bytes_limit(arch)


def _check_staged(plan: CsrPlan) -> None:
    c = plan.config
    if plan.arch < 90 and c.threads > 256 and plan.element_bytes == 4 and c.unroll * c.columns >= 16:
        # measured with ptxas 13.0: for sm_80 at 512 threads (128 registers a thread) two steps of 8 fp32
        # columns spill 220 bytes; sm_90 allocates them in 128 without spilling
        raise ValueError(f"csr-staged with {c.unroll} x {c.columns} fp32 columns at {c.threads} threads spills "
                         f"on sm_{plan.arch}: use unroll 1 or 8 warps a block")
    if plan.N > c.columns:
        raise ValueError(f"csr-staged takes N in one column tile: N = {plan.N} needs columns >= N (got "
                         f"{c.columns}); use csr (stage_b=False) or csr-columns for wider N")
    if not staged_fits(plan.K, plan.N, plan.dtype, plan.arch):
        limit = shared_bytes_limit(plan.arch)
        raise ValueError(f"csr-staged copies B into shared memory: K = {plan.K} x N = {plan.N} in {plan.dtype} is "
                         f"{plan.dynamic_shared_bytes} bytes, over the {limit} a block has on sm_{plan.arch}; use csr "
                         "(stage_b=False)")


def _b_registers(plan: CsrPlan) -> int:
    """32-bit registers one nonzero's B values take in a lane (16-bit pairs share one in a vector load)."""
    c = plan.config.columns
    return c if plan.element_bytes == 4 or plan.load_width == 1 else c // 2


def csr_bytes(plan: CsrPlan) -> dict[str, int]:
    """Per batch entry, what the small-N kernel reads: W's data (index + value per slot) once per column
    tile, and per nonzero and column tile one 32-byte sector of B (the lane's columns of row k; nk: one
    sector per column). `minimum`: every row of B once."""
    tiles = plan.grid[0]
    data = plan.slots * (plan.index_bytes + plan.element_bytes) * tiles
    if plan.staged:  # W once; B once per block (its copy into shared memory), from L2 after the first
        return {"fetched": data + plan.grid[1] * plan.dynamic_shared_bytes,
                "minimum": plan.K * plan.N * plan.element_bytes}
    if isinstance(plan.config, CsrColumnsConfig):  # one coalesced segment of B row k per nonzero and tile
        segment = min(plan.config.tile_columns, plan.N) * plan.element_bytes
        return {"fetched": data + plan.nnz * tiles * (-(-segment // 32) * 32),
                "minimum": plan.K * plan.N * plan.element_bytes}
    per_nonzero = min(32, plan.config.columns * plan.element_bytes) if plan.layout == "kn" else 32 * plan.config.columns
    return {"fetched": data + plan.nnz * tiles * per_nonzero, "minimum": plan.K * plan.N * plan.element_bytes}


def execute_csr(plan: CsrPlan, b: np.ndarray) -> np.ndarray:
    """float64 reference of what the kernel computes (used by tests and the CPU bench mode)."""
    b = np.asarray(b, dtype=np.float64)
    if b.ndim == 3:
        return np.stack([execute_csr(plan, one) for one in b])
    operand = b if plan.layout == "kn" else b.T
    out = np.zeros((plan.M, plan.N))
    cols, values = plan.host_arrays()
    for r, (start, end) in enumerate(plan.rows.tolist()):
        out[r] = values[start:end].astype(np.float64) @ operand[cols[start:end]]
    if plan.bias is not None:
        out += np.asarray(plan.bias)[:, None]
    if plan.relu:
        out = np.maximum(out, 0)
    return out if plan.layout == "kn" else out.T


def csr_traffic(plan: CsrPlan) -> dict[str, int]:
    """The bytes the kernel moves (csr_bytes, C written once) and the floor."""
    output = plan.M * plan.N * plan.element_bytes
    traffic = csr_bytes(plan)
    return {"fetched_bytes": traffic["fetched"] + output, "floor_bytes": traffic["minimum"] + output}
