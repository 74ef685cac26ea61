"""The delta-runs mapping for decode (N = 1..8, 16-bit): a warp a row, each lane one run of the row's
nonzeros, each nonzero its value and an 8-bit gap to the lane's previous one.

Why (measured on the H200, docs/design.md): decode is bound by W's bytes. Padded CSR with 16-bit indices
costs 4 bytes a nonzero (as many as dense fp16 at 50%); the bitmap designs cost fewer bytes but pay per
position (tensor-core fragments) or walk bits in a serial chain per lane, and streamed 1.1-1.4 TB/s. Here a
nonzero costs 3 bytes and about 5 instructions (extract the gap, add it to the lane's column, read x from
shared memory, convert, FMA), with no chain longer than an add, so the kernel streams at 2.5-3.2 TB/s: 1.2-1.3x
over cuBLAS at 50%, 1.7-1.85x at 70%, 2.8-3.6x at 90% (Llama shapes, fp16, weights rotated through HBM).

Layout (DeltaRunsPlan), per row r with Q_r slots of E entries (E = 4 with 8-bit gaps, 8 with 4-bit gaps; the
row's nonzeros in column order, a zero-valued filler wherever a gap exceeds 255 / 15, the last slot padded with
zero values at the last column):
- the row's slots are split into 32 runs of consecutive slots: c = Q_r // 32 each, one more for the first
  Q_r % 32 runs; lane l of the row's warp takes run l;
- slot i of run l is stored at rows[r, 0] + 32 i + l, so a warp's loads of one step are contiguous
  (rows[r] = (first slot, Q_r));
- gaps[slot]: one 32-bit word, entry e's column minus the previous entry's of its run in bits [e g, e g + g)
  (0 for a run's first entry); values[E slot + e]: the values; bases[r, l]: the column of run l's first entry
  (uint16: K <= 65536).
Bytes: 3 a nonzero with 8-bit gaps, 2.5 with 4-bit gaps (fewer where gaps are short: 50-70%), plus a slot's
padding a row and 72 a row of offsets (0.018 B/weight at K = 4096, 0.005 at K = 14336).

The kernel (render.py): a block stages X in shared memory as [K][Np] (Np: N rounded up to 1, 2, 4 or 8; fp32
where it fits, else the kernel's dtype: Llama's K = 14336 at N = 8); warp w of block b takes row b * warps + w;
each lane walks its run, `ahead` slots in flight while the previous group is summed (two register sets); a
nonzero reads its column's Np values with one shared load and adds N FMAs into fp32 sums; a fixed-order
butterfly over the lanes (deterministic, no atomics); lane 0 adds bias and the residual, applies ReLU and
stores. One format serves every N, so a decoder layer converted for several widths holds W once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ...formats import SparseMatrix
from ...plan.config import WARP, require_ints, shared_bytes_limit
from ...plan.plan import DEFAULT_LAYOUT, WeightAsData, check_gated_pair, check_launch, check_problem, fp32_bias

GAP_BITS = (8, 4)   # bits of an entry's gap: 8 (4 entries a slot) or 4 (8 entries a slot, 2.5 bytes a nonzero)
MAX_K = 65536       # run bases are uint16
MAX_N = 8           # columns of X a nonzero's one shared load brings (16 bytes of 16-bit values)
# shared memory a block may have (static + dynamic, less the 1 KB the system reserves), per arch: X staged


@dataclass(frozen=True)
class DeltaRunsConfig:
    warps_per_block: int = 8  # rows of a block (x is staged once per block for all of them)
    ahead: int = 2            # slots a lane has in flight while it sums the previous group
    gap_bits: int = 8         # 8: a slot is 4 entries (a 32-bit gap word, 8 bytes of values); 4: 8 entries (16
    # bytes of values), 2.5 bytes a nonzero where gaps are short (a gap past 15 takes a zero-valued filler)
    overlap: bool = True      # the row's first loads issued before X is staged (their round trip overlaps the copy:
    # what a call at 90% is mostly made of)
    x_bits: int = 32          # X staged as fp32 where it fits the block's shared memory (32), or always in the kernel's
    # 16-bit dtype (16): half the bytes every block copies from L2 and holds, a widening a nonzero more
    ctas: int = 0             # 0: a block a `warps_per_block` rows; else that many persistent blocks, each warp
    # taking every (ctas * warps)-th row with the next row's record loaded while it sums one: X is copied ctas
    # times, not once per `warps_per_block` rows (at N = 8, 4096 x 8 fp16 is 64 KB a block)

    def __post_init__(self):
        require_ints(self, flags=("overlap",))
        if self.warps_per_block not in (2, 4, 8, 16):
            raise ValueError(f"warps_per_block must be 2, 4, 8 or 16, got {self.warps_per_block}")
        if self.ahead not in (1, 2, 4, 8):
            raise ValueError(f"ahead must be 1, 2, 4 or 8, got {self.ahead}")
        if self.gap_bits not in GAP_BITS:
            raise ValueError(f"gap_bits must be 8 or 4, got {self.gap_bits}")
        if self.x_bits not in (32, 16):
            raise ValueError(f"x_bits must be 32 or 16, got {self.x_bits}")
        if not 0 <= self.ctas <= 65535:
            raise ValueError(f"ctas (persistent blocks; 0: none) must be in 0..65535, got {self.ctas}")

    @property
    def threads(self) -> int:
        return self.warps_per_block * WARP

    def short(self) -> str:
        return (f"dr_w{self.warps_per_block}a{self.ahead}" + ("" if self.gap_bits == 8 else f"g{self.gap_bits}")
                + ("o" if self.overlap else "") + ("x16" if self.x_bits == 16 else "")
                + (f"s{self.ctas}" if self.ctas else ""))


@dataclass(frozen=True)
class RunsFormat:
    """W as the delta-runs kernel reads it (see the module docstring); shared by every config and width.
    Arrays are numpy (host plans) or torch tensors on W's device (device plans), as the kernel reads them:
    gaps int32 (the 4 bytes' bits), values in the kernel's dtype (numpy: float32), rows int32 [M, 2],
    bases int16 [M, 32] (uint16 bits)."""
    M: int
    K: int
    nnz: int
    fillers: int
    gap_bits: int
    gaps: object = field(repr=False)
    values: object = field(repr=False)
    rows: object = field(repr=False)
    bases: object = field(repr=False)

    @property
    def slots(self) -> int:
        return int(self.gaps.shape[0])

    @property
    def per_slot(self) -> int:
        """Entries a slot holds: its 32-bit gap word's gaps."""
        return 32 // self.gap_bits

    def nbytes(self, element_bytes: int) -> int:
        return self.slots * (4 + self.per_slot * element_bytes) + self.M * (8 + 2 * WARP)

    def on_host(self) -> "RunsFormat":
        if isinstance(self.gaps, np.ndarray):
            return self
        return RunsFormat(self.M, self.K, self.nnz, self.fillers, self.gap_bits, self.gaps.cpu().numpy(),
                          self.values.float().cpu().numpy(), self.rows.cpu().numpy(), self.bases.cpu().numpy())


def pack_runs(indptr, indices, values, shape: tuple[int, int], gap_bits: int = 8) -> RunsFormat:
    """The format from CSR torch tensors (indptr [M + 1], indices [nnz] ascending within rows, values [nnz]),
    by torch ops on their device; values keep their dtype. gap_bits: 8 or 4 (see DeltaRunsConfig)."""
    import torch

    m, k = shape
    per, max_gap = 32 // gap_bits, (1 << gap_bits) - 1
    device = indptr.device
    counts = torch.diff(indptr.long())
    nnz = int(indices.numel())
    rows = torch.repeat_interleave(torch.arange(m, device=device), counts, output_size=nnz)
    cols = indices.long()
    vals = values
    prev = torch.cat([cols.new_zeros(1), cols[:-1]]) if nnz else cols
    same_row = torch.cat([torch.zeros(1, dtype=torch.bool, device=device), rows[1:] == rows[:-1]]) if nnz else \
        torch.zeros(0, dtype=torch.bool, device=device)
    gap = torch.where(same_row, cols - prev, torch.zeros_like(cols))
    fill = torch.clamp((gap - 1) // max_gap, min=0)  # fillers before an entry (its gap over max_gap)
    fillers = int(fill.sum()) if nnz else 0
    if fillers:  # entry e moves past the fillers before it; filler j (1..f) of entry e at prev + max_gap j
        moved = torch.arange(nnz, device=device) + torch.cumsum(fill, 0)
        owner = torch.repeat_interleave(torch.arange(nnz, device=device), fill, output_size=fillers)
        j = torch.arange(fillers, device=device) - (torch.cumsum(fill, 0) - fill)[owner] + 1
        total = nnz + fillers
        rows2, cols2 = rows.new_empty(total), cols.new_empty(total)
        vals2 = torch.zeros(total, dtype=vals.dtype, device=device)
        rows2[moved], cols2[moved], vals2[moved] = rows, cols, vals
        at = moved[owner] - fill[owner] + j - 1
        rows2[at], cols2[at] = rows[owner], prev[owner] + max_gap * j
        rows, cols, vals = rows2, cols2, vals2
        counts = torch.bincount(rows, minlength=m)
    entries = rows.numel()
    slots = (counts + per - 1) // per  # slots a row
    first_slot = torch.cumsum(slots, 0) - slots
    first_entry = torch.cumsum(counts, 0) - counts
    total = max(int(slots.sum()), 1)
    if total >= 2 ** 31:
        raise ValueError(f"W has {total} slots of entries; the delta-runs kernel indexes them with 32 bits")
    j = torch.arange(entries, device=device) - first_entry[rows]  # entry within its row
    q = j // per
    c, rem = (slots >> 5)[rows], (slots & (WARP - 1))[rows]
    longer = rem * (c + 1)  # the slots of the runs with one more
    in_longer = q < longer
    shorter = torch.clamp(c, min=1)  # the other runs' length (never 0 where one is used)
    lane = torch.where(in_longer, q // (c + 1), rem + (q - longer) // shorter)
    i = torch.where(in_longer, q % (c + 1), (q - longer) % shorter)
    run = rows * WARP + lane
    starts = torch.ones(entries, dtype=torch.bool, device=device)  # a run's first entry
    if entries > 1:
        starts[1:] = run[1:] != run[:-1]
    prev = torch.cat([cols.new_zeros(1), cols[:-1]]) if entries else cols
    delta = torch.where(starts, torch.zeros_like(cols), cols - prev)
    place = (first_slot[rows] + WARP * i + lane) * per + j % per
    gaps = torch.zeros(total * per, dtype=torch.int64, device=device)
    gaps[place] = delta
    out_values = torch.zeros(total * per, dtype=vals.dtype, device=device)
    out_values[place] = vals
    bases = torch.zeros(m * WARP, dtype=torch.int64, device=device)
    bases[run[starts]] = cols[starts]
    words = (gaps.view(total, per) << (torch.arange(per, device=device) * gap_bits)).sum(1)  # disjoint bits
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # the 32 bits, signed
    bases = torch.where(bases >= 2 ** 15, bases - 2 ** 16, bases).to(torch.int16).view(m, WARP)
    row_info = torch.stack([first_slot, slots], 1).to(torch.int32)
    return RunsFormat(m, k, nnz, fillers, gap_bits, words, out_values, row_info, bases)


def runs_format(w: SparseMatrix, gap_bits: int = 8) -> RunsFormat:
    """W's format in host memory (numpy), packed once per matrix and gap width (every config the chooser plans
    shares it): by torch ops on a GPU where there is one (seconds on a host core for a Llama layer), else on the
    CPU; the same format either way."""
    return w.packed(("delta-runs", gap_bits), lambda: _packed_on_gpu(w, gap_bits) or _pack_matrix(w, "cpu", gap_bits))


def _pack_matrix(w: SparseMatrix, device, gap_bits: int) -> RunsFormat:
    import torch

    values = torch.from_numpy(np.array(w.values, dtype=np.float32)).to(device)  # a copy: W's arrays are read-only
    return pack_runs(torch.from_numpy(w.indptr.astype(np.int64)).to(device),
                     torch.from_numpy(w.indices.astype(np.int64)).to(device), values, w.shape, gap_bits).on_host()


def _packed_on_gpu(w: SparseMatrix, gap_bits: int) -> RunsFormat | None:
    try:
        import torch

        return _pack_matrix(w, "cuda", gap_bits) if torch.cuda.is_available() else None
    except RuntimeError:  # no usable CUDA build, or out of GPU memory: the CPU packs it
        return None


@dataclass(frozen=True, eq=False)
class DeltaRunsPlan(WeightAsData):
    """What the delta-runs kernel needs: the problem, the config and W's runs format."""
    M: int
    K: int
    N: int
    layout: str
    dtype: str
    config: DeltaRunsConfig
    format: RunsFormat = field(repr=False)
    nnz: int = 0
    bias: tuple[float, ...] | None = None
    relu: bool = False
    arch: int = 90
    digest: str = ""
    residual: bool = False  # the epilogue adds R (laid out as the output, parameter p_residual) before ReLU
    writes_dense: bool = False  # the kernel writes W's values into C (M x K, zeroed) instead of multiplying
    gate: RunsFormat | None = field(default=None, repr=False)  # gated MLP: C = silu(G X) * (W X), G's format here

    family = "delta-runs"  # W is data the runtime uploads (weight_arrays), not code
    mapping = "delta-runs"
    partial_rows: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return WeightAsData.name.fget(self) + ("_writes_dense" if self.writes_dense else "") + \
            ("_gated" if self.gate is not None else "")

    @property
    def grid(self) -> tuple[int, int]:
        """(1, row blocks) of one batch entry: a block a warps_per_block rows, or the persistent blocks (no more
        than there are rows for)."""
        blocks = math.ceil(self.M / self.config.warps_per_block)
        return 1, min(blocks, self.config.ctas) if self.config.ctas else blocks

    @property
    def n_pad(self) -> int:
        """X's columns a nonzero reads with one shared load: N rounded up to a power of two."""
        return 1 << (self.N - 1).bit_length()

    @property
    def x_bytes(self) -> int:
        """Bytes of one staged X value: fp32 where [K][Np] fits the block's shared memory (and the config allows
        it), else 16-bit."""
        fits = _staged_bytes(self.K, self.n_pad, 4) <= shared_bytes_limit(self.arch)
        return 4 if self.config.x_bits == 32 and fits else 2

    @property
    def registers(self) -> int:
        """Registers a thread takes, near what ptxas 13.0 gives for sm_90 as the runtime builds it
        (-c): N = 1, 8-bit gaps: 36 / 42 / 48 / 96 at 1 / 2 / 4 / 8 slots ahead, 4-bit: 40 / 55 / 80 / 128. With X
        staged in 16 bits (N = 8 at K = 14336) ptxas hoists every entry's X words and their widening: 108 / 128
        / 192 at 1 / 2 / 4 slots ahead with 8-bit gaps, 126 / 191 with 4-bit, past 255 beyond."""
        per, ahead = self.format.per_slot, self.config.ahead
        gated = self.N if self.gate is not None else 0  # the gate's sums, kept while the up's row is walked
        if self.N > 1 and self.x_bytes == 2:
            return 64 + 8 * per * ahead + gated
        wide = 0 if self.N == 1 else 5 * self.n_pad
        return 32 + (2 * (1 + per // 2) + 2) * ahead + wide + gated

    @property
    def dynamic_shared_bytes(self) -> int:
        """X staged as [K][Np], rounded up to 16 bytes (none where the kernel writes W dense)."""
        return 0 if self.writes_dense else _staged_bytes(self.K, self.n_pad, self.x_bytes)

    def weight_arrays(self) -> tuple:
        """The arrays the kernel reads, in its parameter order after B and C, with the dtype each is
        uploaded as ("values": the kernel's dtype)."""
        formats = (self.format,) if self.gate is None else (self.format, self.gate)
        return tuple(pair for f in formats
                     for pair in ((f.values, "values"), (f.gaps, "int32"), (f.rows, "int32"), (f.bases, "int16")))

    def bytes_read(self) -> int:
        """W's bytes the kernel streams once: gaps and values of every slot, the rows' slots and run bases."""
        gate = 0 if self.gate is None else self.gate.nbytes(self.element_bytes)
        return self.format.nbytes(self.element_bytes) + gate

    def describe(self) -> str:
        dense = self.M * self.K * self.element_bytes
        c = self.config
        return (f"Plan {self.name}\n  W {self.M}x{self.K}, nnz {self.nnz} ({self.format.fillers} fillers, "
                f"{self.format.slots} slots of {self.format.per_slot}); N {self.N}; layout {self.layout}; dtype "
                f"{self.dtype}\n  a warp a row, a lane a run of {self.format.gap_bits}-bit column gaps + values: "
                f"{self.bytes_read()} bytes of W "
                f"({dense / max(self.bytes_read(), 1):.2f}x fewer than dense); X as [K][{self.n_pad}] "
                f"{'fp32' if self.x_bytes == 4 else self.dtype} in shared memory "
                f"({self.dynamic_shared_bytes} bytes a block); {c.ahead} slots in flight a lane; grid {self.grid} x "
                f"batch, {self.threads} threads")


def _staged_bytes(k: int, n_pad: int, x_bytes: int) -> int:
    return -(-k * n_pad * x_bytes // 16) * 16


def _checked_options(n: int, dtype: str, layout: str, config, k: int, arch: int) -> DeltaRunsConfig:
    check_problem(n, dtype, layout)
    config = config or DeltaRunsConfig()
    if n > MAX_N:
        raise ValueError(f"the delta-runs kernel computes N <= {MAX_N} (one shared load a nonzero), got N = {n}: use "
                         "another mapping (compile_spmm without a config chooses one)")
    if dtype == "float32":
        raise ValueError("the delta-runs kernel reads 16-bit values (float16, bfloat16); for float32 use another "
                         "mapping (compile_spmm without a config chooses one)")
    limit = shared_bytes_limit(arch)
    n_pad = 1 << (n - 1).bit_length()
    fits = limit // (n_pad * 2)  # X staged in 16 bits where fp32 is too big
    if k > MAX_K or _staged_bytes(k, n_pad, 2) > limit:
        raise ValueError(f"K = {k}, N = {n}: the delta-runs kernel keeps X in shared memory ({limit} bytes on "
                         f"sm_{arch}) and run bases in 16 bits, so K <= {min(MAX_K, fits)} here: use another mapping")
    return config


def make_delta_runs_plan(w: SparseMatrix, n: int, dtype: str = "float16", layout: str = DEFAULT_LAYOUT,
                         config: DeltaRunsConfig | None = None, bias=None, relu: bool = False, arch: int = 90,
                         residual: bool = False) -> DeltaRunsPlan:
    config = _checked_options(n, dtype, layout, config, w.shape[1], arch)
    m, k = w.shape
    return _checked_plan(DeltaRunsPlan(m, k, n, layout, dtype, config, runs_format(w, config.gap_bits), w.nnz,
                                       fp32_bias(bias, m), relu, arch, w.digest(), residual=bool(residual)))


def gated_delta_runs_plan(gate: DeltaRunsPlan, gate_arrays, up: DeltaRunsPlan, up_arrays) -> DeltaRunsPlan:
    """The Llama MLP's gate and up projections in one kernel: C = silu(G X) * (U X), from two plans of the same
    problem and config. gate_arrays / up_arrays: the (values, gaps, rows, bases) their kernels read (device
    tensors: the gated kernel shares them, nothing copied), or None for each plan's own format."""
    import dataclasses

    def over(plan: DeltaRunsPlan, arrays) -> RunsFormat:
        if arrays is None:
            return plan.format
        f = plan.format
        values, gaps, rows, bases = arrays[:4]
        return RunsFormat(f.M, f.K, f.nnz, f.fillers, f.gap_bits, gaps, values, rows, bases)

    check_gated_pair(gate, up)
    if up.config.ctas:
        raise ValueError("a gated kernel takes a row a warp (ctas=0): plan the gate and up with ctas=0")
    return _checked_plan(dataclasses.replace(up, format=over(up, up_arrays), gate=over(gate, gate_arrays),
                                             nnz=gate.nnz + up.nnz,
                                             digest=f"{gate.digest}+{up.digest}" if gate.digest or up.digest else ""))


def _checked_plan(plan: DeltaRunsPlan) -> DeltaRunsPlan:
    if plan.registers > min(255, 65536 // plan.threads):  # past it ptxas caps the registers and spills
        raise ValueError(f"{plan.config.warps_per_block} warps with {plan.config.ahead} slots ahead at N = {plan.N} "
                         f"need about {plan.registers} registers a thread, over the {min(255, 65536 // plan.threads)} "
                         "a thread may have (255, and a block's 65536): use fewer warps_per_block or a smaller ahead")
    check_launch(plan.grid)
    return plan


def make_delta_runs_plan_on_device(w, n: int, dtype: str = "float16", layout: str = DEFAULT_LAYOUT,
                                   config: DeltaRunsConfig | None = None, bias=None, relu: bool = False,
                                   arch: int = 90, residual: bool = False) -> DeltaRunsPlan:
    """make_delta_runs_plan's plan from a formats.DeviceCsr, its format packed by torch ops on W's device and
    shared by the matrix's plans; the digest is empty (W is data)."""
    import torch

    config = _checked_options(n, dtype, layout, config, w.shape[1], arch)
    m, k = w.shape
    fmt = w.packed(("delta-runs", dtype, config.gap_bits),
                   lambda: pack_runs(w.indptr, w.indices, w.values.to(getattr(torch, dtype)), w.shape, config.gap_bits))
    return _checked_plan(DeltaRunsPlan(m, k, n, layout, dtype, config, fmt, w.nnz, fp32_bias(bias, m), relu, arch,
                                       "", residual=bool(residual)))


def decoded(plan: DeltaRunsPlan, arrays=None):
    """(rows, columns, values) torch tensors of every entry (fillers and padding included: value 0), read back
    from the format the way the kernel walks it: a run's columns are its base plus its gaps' running sum. From
    the kernel's device arrays (values, gaps, rows, bases) where given, else the plan's own. Elementwise ops,
    scatters and one cumsum on the arrays' device, no host sync (a prefill densifies every layer with it)."""
    import torch

    f = plan.format
    if arrays is None:
        as_torch = (lambda a: a) if not isinstance(f.gaps, np.ndarray) else torch.from_numpy
        arrays = tuple(as_torch(a) for a in (f.values, f.gaps, f.rows, f.bases))
    values, gaps, rows, bases = arrays[:4]
    device = gaps.device
    per, bits = f.per_slot, f.gap_bits
    used = f.slots if f.nnz + f.fillers else 0  # every slot is a row's (an empty W keeps one spare slot)
    first_slot, slots = rows[:, 0].long(), rows[:, 1].long()
    row = torch.repeat_interleave(torch.arange(plan.M, device=device), slots, output_size=used)
    local = torch.arange(used, device=device) - first_slot[row]  # slots are the rows' in row order
    i, lane = local >> 5, local & (WARP - 1)
    c, rem = slots[row] >> 5, slots[row] & (WARP - 1)
    run_first = first_slot[row] + lane * c + torch.minimum(lane, rem)  # the run's first slot in run order
    order = run_first + i  # the slot's place in run order (runs of a row one after another)
    delta = torch.zeros(used, per, dtype=torch.int64, device=device)
    delta[order] = (gaps[:used].long()[:, None] >> (torch.arange(per, device=device) * bits)) & ((1 << bits) - 1)
    vals = torch.zeros(used, per, dtype=values.dtype, device=device)
    vals[order] = values.view(-1, per)[:used]
    begin = torch.zeros(used, dtype=torch.int64, device=device)
    begin[order] = run_first * per  # the run's first entry, in run order
    base = torch.zeros(used, dtype=torch.int64, device=device)
    base[order] = bases.reshape(-1).long()[row * WARP + lane] & 0xFFFF
    at = torch.zeros(used, dtype=torch.int64, device=device)
    at[order] = row
    running = torch.cumsum(delta.view(-1), 0)  # a run's first gap is 0: its first column is its base
    cols = base.repeat_interleave(per) + running - running[begin.repeat_interleave(per)]
    return at.repeat_interleave(per), cols, vals.view(-1)


def execute_delta_runs(plan: DeltaRunsPlan, b: np.ndarray) -> np.ndarray:
    """float64 reference of what the kernel computes, from W (and a gated kernel's G) read back out of the
    plan's own layout."""
    import dataclasses

    b = np.asarray(b, dtype=np.float64)
    if b.ndim == 3:
        return np.stack([execute_delta_runs(plan, one) for one in b])
    x = b if plan.layout == "kn" else b.T  # K x N

    def product(p: DeltaRunsPlan) -> np.ndarray:
        rows, cols, vals = (t.cpu().numpy() for t in decoded(p))
        out = np.zeros((p.M, p.N))
        np.add.at(out, rows, vals.astype(np.float64)[:, None] * x[cols])
        return out

    out = product(plan)
    if plan.gate is not None:
        g = product(dataclasses.replace(plan, format=plan.gate, gate=None))
        out = g / (1 + np.exp(-g)) * out
    if plan.bias is not None:
        out += np.asarray(plan.bias)[:, None]
    if plan.relu:
        out = np.maximum(out, 0)
    return out if plan.layout == "kn" else out.T


def dense_writer_plan(plan: DeltaRunsPlan) -> DeltaRunsPlan:
    """The plan of a kernel that writes W dense (C: M x K, zeroed first) from the same arrays, one store a
    nonzero: a prefill's densify at the speed of a write of W, where the torch decode (densify_delta_runs)
    takes a dozen passes over every entry."""
    import dataclasses

    if plan.gate is not None:
        raise ValueError("a gated kernel writes no W dense: take its gate's and up's own plans")
    return dataclasses.replace(plan, N=1, layout="nk", bias=None, relu=False, residual=False, writes_dense=True,
                               config=dataclasses.replace(plan.config, overlap=False, ctas=0, x_bits=32))  # one writer
    # for all of a matrix's configs of one gap width and warps: it stages no X


def densify_delta_runs(plan: DeltaRunsPlan, arrays, out):
    """W dense in `out` (torch, M x K, on the arrays' device) from the kernel's device arrays, by torch ops
    on that device. Fillers and padding add zeros (exact, in any order). None for a gated kernel: it holds
    two weights, not one W."""
    if plan.gate is not None:
        return None
    rows, cols, vals = decoded(plan, arrays)
    out.zero_()
    out.view(-1).index_add_(0, rows * plan.K + cols, vals.to(out.dtype))
    return out


def delta_runs_traffic(plan: DeltaRunsPlan) -> dict[str, int]:
    """W's format streamed once, X staged once per block (from L2), C written once; and the floor."""
    output = plan.M * plan.N * plan.element_bytes
    staged = plan.grid[1] * plan.K * plan.N * plan.element_bytes
    return {"fetched_bytes": plan.bytes_read() + staged + output,
            "floor_bytes": plan.bytes_read() + plan.K * plan.N * plan.element_bytes + output}
