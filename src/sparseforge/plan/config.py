"""Tiling parameters of a generated SpMM kernel: small, frozen, hashable, self-validating (Sputnik style)."""
from __future__ import annotations

from dataclasses import dataclass

WARP = 32
# dynamic shared memory a block may have, by arch (the CUDA C programming guide's table); 48 KB elsewhere
SHARED_BYTES = {90: 227 * 1024, 80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024}


def shared_bytes_limit(arch: int) -> int:
    """The dynamic shared memory a block may have on sm_`arch`."""
    return SHARED_BYTES.get(arch, 48 * 1024)


def require_ints(config, flags: tuple[str, ...] = ()) -> None:
    """Every field of a frozen config dataclass an int (2.0 == 2 would pass membership checks, then break
    the rendered PTX), refused with the field named; the fields named in `flags` a bool instead."""
    for name, value in vars(config).items():
        if name in flags:
            if type(value) is not bool:
                raise TypeError(f"{name} must be a bool, got {value!r}")
        elif type(value) is not int:
            raise TypeError(f"{name} must be an int, got {value!r}")


def epilogue_tag(bias, relu: bool, residual: bool = False) -> str:
    """The part of a kernel's name its epilogue decides."""
    return ("_bias" if bias is not None else "") + ("_relu" if relu else "") + ("_res" if residual else "")


@dataclass(frozen=True)
class TileConfig:
    rows_per_group: int = 4   # max rows of W one warp computes; their shared B columns are loaded once
    # kn: warps side by side over columns, all running the same group's code (one instruction fetch
    # serves them all); nk: row groups (one warp each) sharing one staged tile of X
    warps_per_block: int = 4
    vec: int = 1              # consecutive output columns per thread (vector loads/stores of this width)
    load_batch: int = 8       # B loads issued ahead of their FMAs (software pipelining depth)
    groups_per_block: int = 1  # kn: row groups a block runs one after another
    # 0: a group's nonzeros are never split. N > 0: a group holding more than N nonzeros is cut along its
    # columns into segments of at most about N, each its own work item; their partial sums meet in the
    # output through atomic adds. Long rows then stop being one warp's serial tail, and small-N problems
    # get more warps (split-K). Costs: the split rows are zeroed first, and ReLU cannot be fused.
    segment_nnz: int = 0
    # kn only. 0: each group of a block's run reads all of K in one pass. N > 0: the run goes N rows of B
    # at a time, every group of the run over one chunk before the next, so a chunk's B rows are re-read
    # from L1 by the run's other groups rather than from L2 (accumulators of the whole run stay live).
    chunk_k: int = 0
    # nk only. False: X (N x K) is staged through shared memory, transposed, with one row group per warp.
    # True: the launch transposes X into a K x N copy and the kernel reads it like B in kn (coalesced
    # direct loads, warps side by side over tokens running one group's code), writing Y in place.
    transpose_x: bool = False
    # False: a group is a run of consecutive rows. True: rows are grouped by the columns they share (greedy:
    # each group starts from the heaviest free row and takes the free rows overlapping it most), so a group
    # loads fewer distinct B rows: 1.06-1.5x fewer B loads on DLMC rn50 and Transformer matrices (CPU count).
    cluster_rows: bool = False
    # False: each group's code is a function of its own, the kernel calls it (modules compile apart, in
    # parallel: ptxas time grows faster than linearly with a function's size). True: every group's code
    # inline in the kernel, as a whole-kernel compiler (NVRTC) would emit it: no call, so ptxas can keep a
    # group's loads in flight across the whole row (the called functions keep ~5 16-byte loads in flight
    # where load_batch asks for 16, read off their SASS); only for small layers (tune/space.py).
    inline: bool = False

    def __post_init__(self):
        if not 1 <= self.rows_per_group <= 32:
            raise ValueError(f"rows_per_group must be in 1..32, got {self.rows_per_group}")
        if self.warps_per_block not in (1, 2, 4, 8, 16):
            raise ValueError(f"warps_per_block must be 1, 2, 4, 8 or 16, got {self.warps_per_block}")
        if self.vec not in (1, 2, 4):
            raise ValueError(f"vec must be 1, 2 or 4, got {self.vec}")
        if not 1 <= self.load_batch <= 64:
            raise ValueError(f"load_batch must be in 1..64, got {self.load_batch}")
        if not 1 <= self.groups_per_block <= 64:
            raise ValueError(f"groups_per_block must be in 1..64, got {self.groups_per_block}")
        if self.chunk_k < 0:
            raise ValueError(f"chunk_k must be >= 0 (0: one pass over K), got {self.chunk_k}")
        if self.segment_nnz < 0:
            raise ValueError(f"segment_nnz must be >= 0 (0: no splitting), got {self.segment_nnz}")
        for flag in ("transpose_x", "cluster_rows", "inline"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")

    @property
    def threads(self) -> int:
        return self.warps_per_block * WARP

    @property
    def columns_per_warp(self) -> int:
        return WARP * self.vec

    def short(self) -> str:
        split = f"s{self.segment_nnz}" if self.segment_nnz else ""
        chunk = f"k{self.chunk_k}" if self.chunk_k else ""
        transposed = "t" if self.transpose_x else ""
        clustered = ("c" if self.cluster_rows else "") + ("i" if self.inline else "")
        return (f"r{self.rows_per_group}w{self.warps_per_block}v{self.vec}b{self.load_batch}g{self.groups_per_block}"
                f"{split}{chunk}{transposed}{clustered}")
