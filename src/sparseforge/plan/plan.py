"""The inspector: a sparsity pattern + problem -> Plan, the plain data object that codegen renders.

A Plan is a list of row groups. One warp runs one group for 32*vec output columns: it loads each B row
(column k of W) used by any of the group's rows once, and feeds it to every row that has a nonzero there.
Groups are contiguous rows balanced by nonzeros, so no warp carries much more work than the mean.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass, field

import numpy as np

from ..dtypes import KERNEL_DTYPES
from ..formats import SparseMatrix
from .config import TileConfig, epilogue_tag

LAYOUTS = ("kn", "nk")  # "kn": C[M,N] = W @ B[K,N]; "nk": Y[N,M] = X[N,K] @ W^T (a linear layer's tokens)
DEFAULT_LAYOUT = "kn"  # what every layout argument means when left out
DTYPES = KERNEL_DTYPES  # the one table lives in dtypes.py
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class WeightAsData:
    """What every plan whose kernel reads W as data (CsrPlan, BitmapPlan) shares: the binary depends on the
    shape and options, not the pattern, so one compile serves every weight of the shape; one element a
    store; X read as it is."""
    transposes_input = False
    bordered = False  # reads the operand as it lies (ConvTilePlan: a zero-bordered copy of a convolution's input)

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.dtype]

    @property
    def threads(self) -> int:
        return self.config.threads

    @property
    def output_alignment(self) -> int:
        return self.element_bytes

    @property
    def name(self) -> str:
        epi = epilogue_tag(self.bias, self.relu, self.residual)
        return f"spmm_{self.layout}_{self.dtype}_m{self.M}k{self.K}n{self.N}_{self.config.short()}{epi}"

    @property
    def source_key(self) -> str:
        """What the generated text depends on (the weight's values are data, not code)."""
        return f"{self.name}|{self.arch}"


@dataclass(frozen=True)
class ColumnUse:
    k: int                                   # column of W = row of B (kn) / column of X (nk)
    uses: tuple[tuple[int, float], ...]      # (slot of the row within the group, weight value)


@dataclass(frozen=True)
class RowGroup:
    rows: tuple[int, ...]                    # rows of W (= rows of C) this group writes
    columns: tuple[ColumnUse, ...]           # union of the rows' columns, ascending k
    segment: int = 0                         # which piece of a split group this is (0: the one adding bias)
    segments: int = 1                        # pieces the group was split into (1: not split)

    @property
    def nnz(self) -> int:
        return sum(len(c.uses) for c in self.columns)

    @property
    def partial(self) -> bool:
        """Its sums are partial: the kernel adds them into the output atomically."""
        return self.segments > 1

    @property
    def width(self) -> int:
        """Distinct k the group reads (B rows loaded per column tile)."""
        return len(self.columns)


@dataclass(frozen=True)
class GroupSketch:
    """A row group's counts without its program: what the cost model reads, built in numpy (sketch_plan).
    A plan made of sketches can be ranked, not rendered."""
    rows: tuple[int, ...]
    nnz: int
    width: int                               # distinct k the group reads
    segment: int = 0
    segments: int = 1

    @property
    def partial(self) -> bool:
        return self.segments > 1


@dataclass(frozen=True)
class Plan:
    M: int
    K: int
    N: int
    layout: str                              # "kn": C[M,N] = W @ B[K,N]; "nk": Y[N,M] = X[N,K] @ W^T
    dtype: str                               # operand dtype; accumulation is always fp32
    config: TileConfig
    groups: tuple[RowGroup, ...]
    bias: tuple[float, ...] | None = None    # per output row, baked into the accumulator's start
    relu: bool = False
    arch: int = 90                           # target compute capability x10
    digest: str = field(default="", compare=False)  # of the weight; names the kernel

    family = "tile"  # every nonzero an immediate of the generated code (CsrPlan's family is "csr")
    bordered = False  # the operand read as it lies; ConvTilePlan: a zero-bordered copy of a convolution's input

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.dtype]

    @property
    def direct(self) -> bool:
        """The operand is read K x N with direct loads (kn, or nk with X transposed by the launch)."""
        return self.layout == "kn" or self.config.transpose_x

    @property
    def mapping(self) -> str:
        """The mapping of the work (a tuner candidate each): "row-per-block" (every warp of a block on one
        row's code, many blocks), "split-k" (groups cut along K, partial sums added atomically),
        "staged-x" (nk: X through shared memory), "inline" (any of these with every group's code inline
        in the kernel, no calls), else "row-groups" (a warp loads each B row once for a group of rows
        sharing it)."""
        c = self.config
        if not self.direct:
            return "staged-x"
        if c.inline:
            return "inline"
        if c.segment_nnz and any(g.partial for g in self.groups):
            return "split-k"
        return "row-per-block" if c.rows_per_group == 1 else "row-groups"

    @property
    def threads(self) -> int:
        return self.config.threads

    @property
    def transposes_input(self) -> bool:
        """The launch hands the kernel X transposed (nk with transpose_x)."""
        return self.config.transpose_x

    @property
    def output_alignment(self) -> int:
        """Bytes the output pointer must be aligned to (vector stores of vec elements)."""
        return self.config.vec * self.element_bytes

    @property
    def output_strides(self) -> tuple[int, int]:
        """(elements between W's rows, elements between a thread's consecutive columns) in the output:
        kn's C is M x N, (N, 1); nk's Y is N x M, (1, M)."""
        return (self.N, 1) if self.layout == "kn" else (1, self.M)

    def store_runs(self, group) -> list[tuple[int, int]]:
        """The group's slots as (first slot, count) runs stored as one vector along the rows: singles here
        (nk's rows are adjacent in Y too, so it could take runs like ConvTilePlan's in nhwc; not measured)."""
        return [(slot, 1) for slot in range(len(group.rows))]

    @property
    def columns_per_block(self) -> int:
        c = self.config
        return c.warps_per_block * c.columns_per_warp if self.direct else 32

    @property
    def grid(self) -> tuple[int, int]:
        """(column tiles, row-group blocks) of one batch entry."""
        per_block = self.config.groups_per_block if self.direct else self.config.warps_per_block
        return math.ceil(self.N / self.columns_per_block), math.ceil(len(self.groups) / per_block)

    @property
    def nnz(self) -> int:
        return sum(g.nnz for g in self.groups)

    @property
    def partial_rows(self) -> tuple[int, ...]:
        """Rows written by atomic adds of split groups: the launch zeroes them first."""
        return tuple(sorted({r for g in self.groups if g.partial for r in g.rows}))

    @property
    def b_loads(self) -> int:
        """B rows loaded per column tile, over all groups (nnz minus what column sharing saves)."""
        return sum(g.width for g in self.groups)

    @property
    def sketch(self) -> bool:
        """Made by sketch_plan: counts only, for ranking; make_plan builds the renderable plan."""
        return bool(self.groups) and isinstance(self.groups[0], GroupSketch)

    @property
    def name(self) -> str:
        epi = epilogue_tag(self.bias, self.relu)
        return (f"spmm_{self.layout}_{self.dtype}_m{self.M}k{self.K}n{self.N}_{self.config.short()}"
                f"{epi}_{self.digest[:12]}")

    def describe(self) -> str:
        sizes = [g.nnz for g in self.groups] or [0]
        return (f"Plan {self.name}\n"
                f"  W {self.M}x{self.K}, nnz {self.nnz}; N {self.N}; layout {self.layout}; dtype {self.dtype}\n"
                f"  {len(self.groups)} row groups (<= {self.config.rows_per_group} rows; "
                f"{len(self.partial_rows)} rows split), nnz per group "
                f"mean {np.mean(sizes):.1f} max {max(sizes)}; B loads {self.b_loads} "
                f"(sharing saves {1 - self.b_loads / max(self.nnz, 1):.1%})\n"
                f"  grid {self.grid} x batch, {self.config.threads} threads, vec {self.config.vec}; "
                f"bias {'yes' if self.bias is not None else 'no'}, relu {self.relu}")


def _balanced_groups(row_nnz: np.ndarray, max_rows: int, n_groups_hint: int) -> list[tuple[int, ...]]:
    """Cut rows into contiguous groups of <= max_rows rows whose nonzero counts stay near the mean.

    A row heavier than the mean gets a group of its own rather than dragging neighbours along."""
    cap = max(int(np.ceil(row_nnz.sum() / max(n_groups_hint, 1))), 1)
    groups, current, load = [], [], 0
    for row, count in enumerate(row_nnz.tolist()):
        if current and (len(current) == max_rows or load + count > cap):
            groups.append(tuple(current))
            current, load = [], 0
        current.append(row)
        load += count
    if current:
        groups.append(tuple(current))
    return groups


CLUSTER_WINDOW = 4096  # rows compared with each other at once: the overlap matrix is window^2 floats


_CLUSTERS: dict = {}  # (weight digest, max_rows, hint) -> groups: candidates of one layer share them
_CLUSTERS_LOCK = threading.Lock()  # the chooser plans candidates in threads


def _clustered_groups(w: SparseMatrix, max_rows: int, n_groups_hint: int) -> list[tuple[int, ...]]:
    """Groups of <= max_rows rows that share columns, within windows of CLUSTER_WINDOW rows. Greedy: the
    heaviest free row seeds a group, which then takes the free row sharing most columns with its rows so
    far, while the group's nonzeros stay within the cap _balanced_groups uses."""
    key = (w.digest(), max_rows, n_groups_hint)
    with _CLUSTERS_LOCK:
        groups = _CLUSTERS.get(key)
        if groups is None:
            if len(_CLUSTERS) > 64:
                _CLUSTERS.clear()
            groups = _CLUSTERS[key] = _cluster(w, max_rows, n_groups_hint)
    return groups


def clusters_of(w: SparseMatrix) -> list[list]:
    """The clusterings computed for W in this process, as [max_rows, hint, groups] records (JSON-able): a
    cached choice keeps its winner's, so a later process skips the greedy clustering (~0.1 s a layer)."""
    digest = w.digest()
    with _CLUSTERS_LOCK:
        return [[rows, hint, [list(g) for g in groups]] for (d, rows, hint), groups in _CLUSTERS.items()
                if d == digest]


def remember_clusters(w: SparseMatrix, records) -> None:
    """Seed the memo with clusterings a cached choice recorded (clusters_of's format). A record that does
    not partition W's rows is ignored: the clustering is then computed again."""
    digest, m = w.digest(), w.shape[0]
    for record in records or ():
        try:
            rows, hint, groups = int(record[0]), int(record[1]), [tuple(int(r) for r in g) for g in record[2]]
        except (TypeError, ValueError, IndexError):
            continue
        flat = sorted(r for g in groups for r in g)
        if flat != list(range(m)) or any(not 0 < len(g) <= rows for g in groups):
            continue
        with _CLUSTERS_LOCK:
            _CLUSTERS[(digest, rows, hint)] = groups


def _cluster(w: SparseMatrix, max_rows: int, n_groups_hint: int) -> list[tuple[int, ...]]:
    import scipy.sparse as sp

    cap = max(int(np.ceil(w.row_nnz.sum() / max(n_groups_hint, 1))), 1)
    pattern = sp.csr_matrix((np.ones(w.indices.size, np.float32), w.indices, w.indptr), shape=w.shape)
    groups = []
    for start in range(0, w.shape[0], CLUSTER_WINDOW):
        stop = min(start + CLUSTER_WINDOW, w.shape[0])
        block = pattern[start:stop]
        overlap = (block @ block.T).toarray()
        groups += [tuple(start + r for r in g) for g in _greedy(overlap, w.row_nnz[start:stop], max_rows, cap)]
    return groups


def _greedy(overlap: np.ndarray, nnz: np.ndarray, max_rows: int, cap: int) -> list[tuple[int, ...]]:
    free = np.ones(len(nnz), bool)
    groups = []
    for seed in np.argsort(-nnz, kind="stable").tolist():
        if not free[seed]:
            continue
        free[seed] = False
        members, load, score = [seed], int(nnz[seed]), overlap[seed].copy()
        while len(members) < max_rows:
            fits = free & (load + nnz <= cap)
            if not fits.any():
                break
            pick = int(np.argmax(np.where(fits, score, -1.0)))
            free[pick] = False
            members.append(pick)
            load += int(nnz[pick])
            score += overlap[pick]
        groups.append(tuple(sorted(members)))
    return groups


def _group_program(w: SparseMatrix, rows: tuple[int, ...]) -> RowGroup:
    by_column: dict[int, list[tuple[int, float]]] = {}
    for slot, row in enumerate(rows):
        lo, hi = w.indptr[row], w.indptr[row + 1]
        for k, value in zip(w.indices[lo:hi].tolist(), w.values[lo:hi].astype(np.float32).tolist()):
            by_column.setdefault(k, []).append((slot, value))
    return RowGroup(rows, tuple(ColumnUse(k, tuple(by_column[k])) for k in sorted(by_column)))


def split_group(group: RowGroup, segment_nnz: int) -> list[RowGroup]:
    """Cut a group whose nonzeros exceed segment_nnz into consecutive column ranges of near-equal nonzeros."""
    if not segment_nnz or group.nnz <= segment_nnz:
        return [group]
    pieces = math.ceil(group.nnz / segment_nnz)
    target = group.nnz / pieces
    cuts, current, load = [], [], 0
    for column in group.columns:
        current.append(column)
        load += len(column.uses)
        if load >= target * (len(cuts) + 1) and len(cuts) < pieces - 1:
            cuts.append(tuple(current))
            current = []
    if current:
        cuts.append(tuple(current))
    if len(cuts) == 1:
        return [group]
    return [RowGroup(group.rows, columns, i, len(cuts)) for i, columns in enumerate(cuts)]


def split_counts(uses: np.ndarray, segment_nnz: int) -> list[tuple[int, int]]:
    """(nonzeros, distinct k) of each piece split_group cuts a group into, from its columns' use counts in k
    order, without building the columns: a cut i falls on the first column after cut i - 1 whose running load
    reaches i / pieces of the group's, so one heavy column can take two cuts' share and leave fewer pieces."""
    load = np.cumsum(uses)
    total = int(load[-1]) if len(load) else 0
    if not segment_nnz or total <= segment_nnz:
        return [(total, len(uses))]
    pieces = math.ceil(total / segment_nnz)
    target = total / pieces
    ends, start = [], 0  # the last column of each piece
    while len(ends) < pieces - 1 and start < len(load):
        column = start + int(np.searchsorted(load[start:], target * (len(ends) + 1), side="left"))
        if column >= len(load):
            break
        ends.append(column)
        start = column + 1
    if start < len(load):
        ends.append(len(load) - 1)
    if len(ends) == 1:
        return [(total, len(uses))]
    bounds = [-1, *ends]
    return [(int(load[b] - (load[a] if a >= 0 else 0)), b - a) for a, b in zip(bounds, bounds[1:])]


def _check_split(config: TileConfig, relu: bool, dtype: str, arch: int) -> None:
    if not config.segment_nnz:
        return
    if relu:
        raise ValueError("segment_nnz > 0 splits rows into partial sums, which cannot be rectified: use "
                         "relu=False (apply ReLU after the kernel) or segment_nnz=0")
    if dtype == "bfloat16" and arch < 90:
        raise ValueError(f"split rows in bfloat16 need bf16 atomic adds (sm_90+); sm_{arch}: use segment_nnz=0")


def pick_vec(n: int, layout: str, wanted: int) -> int:
    """Widest vector width <= wanted that divides N (kn only: nk stages through shared memory)."""
    if layout == "nk":
        return 1
    for vec in (4, 2, 1):
        if vec <= wanted and n % vec == 0:
            return vec
    return 1


def fp32_bias(bias, m: int) -> tuple[float, ...] | None:
    """M bias values (any sequence or numpy array) as the fp32 numbers a kernel adds, or None; a wrong
    length or a NaN/inf is refused with the entry named."""
    if bias is None:
        return None
    values = np.asarray(bias, dtype=np.float64).reshape(-1)
    if values.size != m:
        raise ValueError(f"bias must have M = {m} entries (one per row of W), got {values.size} "
                         f"(shape {np.shape(bias)})")
    with np.errstate(over="ignore"):
        kept = values.astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(kept))
    if bad.size:
        what = "is not finite" if not np.isfinite(values[bad[0]]) else "overflows float32 (the kernels add fp32)"
        raise ValueError(f"bias[{bad[0]}] = {values[bad[0]]} {what}: a NaN or inf bias would poison every output "
                         "of its row; fix the bias first")
    return tuple(kept.tolist())


def check_problem(n: int, dtype: str, layout: str) -> None:
    """What every plan family refuses alike: an unknown layout or dtype, N < 1."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if n < 1:
        raise ValueError(f"N must be >= 1, got {n}")


def _checked(w: SparseMatrix, n: int, dtype: str, layout: str, config: TileConfig | None, bias, relu: bool,
             arch: int) -> tuple[TileConfig, tuple[float, ...] | None, list[tuple[int, ...]]]:
    """(config with the vector width N allows, bias as fp32 values, the row groups) after validation."""
    check_problem(n, dtype, layout)
    config = config or TileConfig()
    _check_split(config, relu, dtype, arch)
    if config.inline and (config.chunk_k or (layout == "nk" and not config.transpose_x)):
        raise ValueError("inline applies to direct kernels in one pass (kn, or nk with transpose_x; no chunk_k)")
    if config.transpose_x and layout != "nk":
        raise ValueError("transpose_x applies to layout 'nk' (in 'kn' the operand is already K x N)")
    if config.chunk_k and layout != "kn" and not config.transpose_x:
        raise ValueError("chunk_k applies to layout 'kn' or to 'nk' with transpose_x (staged X has chunks "
                         "of its own)")
    vec = pick_vec(n, layout, config.vec)
    if vec != config.vec:
        config = dataclasses.replace(config, vec=vec)
    bias_values = fp32_bias(bias, w.shape[0])
    hint = math.ceil(w.shape[0] / config.rows_per_group)
    if config.cluster_rows:
        rows = _clustered_groups(w, config.rows_per_group, hint)
    else:
        rows = _balanced_groups(w.row_nnz, config.rows_per_group, hint)
    return config, bias_values, rows


def make_plan(w: SparseMatrix, n: int, dtype: str = "float32", layout: str = DEFAULT_LAYOUT,
              config: TileConfig | None = None, bias=None, relu: bool = False, arch: int = 90) -> Plan:
    """Inspect W's pattern and build the plan for C = W @ B (kn) or Y = X @ W^T (nk), N columns/tokens."""
    config, bias_values, rows = _checked(w, n, dtype, layout, config, bias, relu, arch)
    groups = tuple(piece for r in rows for piece in split_group(_group_program(w, r), config.segment_nnz))
    plan = Plan(w.shape[0], w.shape[1], n, layout, dtype, config, groups, bias_values, relu, arch, w.digest())
    check_launch(plan.grid)
    return plan


MAX_GRID_Y = 65535  # CUDA's limit on a launch's second grid dimension (the row blocks)


def check_gated_pair(gate, up) -> None:
    """What every gated kernel's plan (the Llama MLP's silu(G X) * (U X)) asks of its gate's and up's plans: the
    same problem and config, each a plain product (no bias, ReLU, residual, dense writing or gate of its own)."""
    same = ("M", "K", "N", "layout", "dtype", "arch", "config")
    differ = [f for f in same if getattr(gate, f) != getattr(up, f)]
    if differ:
        raise ValueError(f"a gated kernel needs the gate and up plans alike; they differ in {', '.join(differ)}: "
                         "plan both with one config")
    for name, plan in (("gate", gate), ("up", up)):
        if plan.bias is not None or plan.relu or plan.residual or getattr(plan, "writes_dense", False) \
                or plan.gate is not None:
            raise ValueError(f"the {name} plan of a gated kernel must be a plain product (no bias, ReLU, residual, "
                             "dense writing or gate of its own): silu(G X) * (U X) is its whole epilogue")


def check_launch(grid: tuple[int, int]) -> None:
    """Refuse a plan whose row blocks pass the launch limit (one row per block at M > 65535, say): the
    chooser then drops it, and a fixed config gets this error instead of a launch failure later."""
    if grid[1] > MAX_GRID_Y:
        raise ValueError(f"this tiling needs {grid[1]} row blocks, over CUDA's {MAX_GRID_Y} a launch: use more "
                         "rows per group or more groups per block")


def sketch_plan(w: SparseMatrix, n: int, dtype: str = "float32", layout: str = DEFAULT_LAYOUT,
                config: TileConfig | None = None, bias=None, relu: bool = False, arch: int = 90) -> Plan:
    """The plan make_plan would build, as counts per group (nonzeros, distinct k; split groups cut into
    near-equal pieces): numpy only, ~50x faster, so the chooser can rank every candidate of a large layer."""
    config, bias_values, rows = _checked(w, n, dtype, layout, config, bias, relu, arch)
    group_of_row = np.empty(w.shape[0], np.int64)
    for g, members in enumerate(rows):
        group_of_row[list(members)] = g
    nnz = np.bincount(group_of_row, weights=w.row_nnz, minlength=len(rows)).astype(np.int64)
    group_of_nonzero = group_of_row[np.repeat(np.arange(w.shape[0]), w.row_nnz)]
    if len(rows) * w.shape[1] <= 1 << 24:  # distinct k per group: a (groups x K) mask beats a unique by ~20x
        seen = np.zeros((len(rows), w.shape[1]), bool)
        seen[group_of_nonzero, w.indices] = True
        width = seen.sum(axis=1)
    else:
        keys = np.sort(group_of_nonzero * w.shape[1] + w.indices)
        keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])] if keys.size else keys
        width = np.bincount(keys // w.shape[1], minlength=len(rows))
    uses = None
    if config.segment_nnz and (nnz > config.segment_nnz).any():  # each (group, k)'s uses, in k order per group
        keys, counts = np.unique(group_of_nonzero * w.shape[1] + w.indices, return_counts=True)
        starts = np.searchsorted(keys // w.shape[1], np.arange(len(rows) + 1))
        uses = (counts, starts)
    groups = []
    for g, (members, count, distinct) in enumerate(zip(rows, nnz.tolist(), width.tolist())):
        pieces = [(count, distinct)]
        if uses is not None and count > config.segment_nnz:  # cut where split_group cuts: the launch reads the grid
            pieces = split_counts(uses[0][uses[1][g]:uses[1][g + 1]], config.segment_nnz)
        groups += [GroupSketch(members, c, d, i, len(pieces)) for i, (c, d) in enumerate(pieces)]
    plan = Plan(w.shape[0], w.shape[1], n, layout, dtype, config, tuple(groups), bias_values, relu, arch, w.digest())
    check_launch(plan.grid)
    return plan
