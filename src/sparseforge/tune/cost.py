"""The cost model: a plan -> predicted microseconds, from what the kernel must do, so the chooser times only
the few candidates that can win. Pure and deterministic (plans in, numbers out; no GPU).

Terms, each a time on the whole GPU (GPU below: one H200's measured or datasheet figures):
- issue: warp instructions / (SMs x 4 schedulers x clock);
- operand traffic: the dense operand's bytes each work item fetches (B rows re-read per row group, or per
  nonzero and column tile in the small-N kernel), at the L2 rate the benchmarks measured for these reads;
- instruction fetch: each block fetches the code of its groups (the generated kernels' weight *is* code,
  ~16 bytes of SASS a nonzero against 4-8 as data);
- latency: the longest chain of dependent work one warp runs, times the waves of blocks the GPU can hold.
predicted = launch + max(the four). The constants are the GPU's, not any layer's; `fit` in
benchmarks/cost_fit.py refits them from measured design runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..mappings.registry import plan_family


@dataclass(frozen=True)
class Gpu:
    """One H200. The fitted constants come from benchmarks/cost_fit.py over 397 measured plans: every
    candidate of designs.py on 16 rn50 / Transformer layers (fp32, N = 1 to 12544: row groups, row per
    block, split K, small-N) and the e1a6cad / 8d1233c design and bench runs (fp32, fp16): rms log error
    0.41 -> 0.35, median rank correlation of the designs within a case 0.56 -> 0.70. The rest are the
    datasheet's."""
    sms: int = 132
    clock_hz: float = 1.755e9       # sustained SM clock under load (boost 1.98 GHz)
    l2_bytes_per_s: float = 6.88e12  # fitted: B re-reads from L2 (bench's fetched_tbs reads 3-3.2 TB/s)
    ifetch_bytes_per_s: float = 3.52e11  # fitted: code bytes from L2 into the SMs' instruction caches
    launch_us: float = 2.34         # fitted: a real kernel's floor under graph replay (an empty one: ~0.6 us)
    cycles_per_instruction: float = 12.2  # fitted: one warp's instruction stream with its dependences
    inline_latency: float = 0.6     # inline kernels' chain against called groups' (ptxas keeps ~3x the loads
    # in flight without the call boundary): a guess until designs.py measures inline candidates
    step_cycles: float = 3430.0     # fitted: small-N kernel, one iteration's dependent loads (indices,
    # then B) and its FMAs
    hbm_bytes_per_s: float = 4.0e12  # datasheet 4.8 TB/s; ~3.4-3.6 TB/s measured for streamed weights
    # the generated convolution's copy of x into its zero-bordered buffer: a second kernel in the graph.
    # A guess (an elementwise copy's floor under graph replay) until the conv bench has measured it.
    border_copy_us: float = 1.5
    # bitmap decode: one iteration of a lane's walk over its set bits (x and value from shared memory, then
    # the FMAs). A guess until designs.py has measured the second bitmap design.
    bitmap_iteration_cycles: float = 60.0
    # tc-scatter: one round of a warp's walk as a chain (its loads were issued two rounds ahead), and the
    # latency a warp's read-ahead must cover. Guesses until designs.py has measured the kernel.
    scatter_round_cycles: float = 160.0
    hbm_latency_s: float = 1.0e-6
    # csr-staged: one step's chain with B in shared memory (the index and value loads from HBM, then LDS and
    # the FMAs); a guess until designs.py has measured the kernel
    staged_step_cycles: float = 1800.0
    # CsrConfig.prefetch: a step after a row's first, whose index and value loads the step before issued, as
    # a fraction of an unpipelined step (what is left: its B loads and FMAs); a guess until designs.py has
    # measured the prefetching kernels
    prefetch_step_fraction: float = 0.5
    registers: int = 65536          # per SM
    max_warps: int = 64             # per SM
    sass_bytes: int = 16            # bytes per SASS instruction


H200 = Gpu()


@dataclass(frozen=True)
class Estimate:
    us: float
    terms: dict          # microseconds of each term, for --explain
    compile_s: float     # predicted cold compile seconds (generation + ptxas)

    def as_dict(self) -> dict:
        return {"predicted_us": round(self.us, 3), "terms": {k: round(v, 3) for k, v in self.terms.items()},
                "predicted_compile_s": round(self.compile_s, 2)}


def wave_count(blocks: int, warps_per_block: int, registers: int, gpu: Gpu) -> int:
    per_sm = min(gpu.max_warps, gpu.registers // (32 * max(registers, 24))) // warps_per_block
    return max(1, math.ceil(blocks / (gpu.sms * max(per_sm, 1))))


def estimate(plan, batch: int = 1, gpu: Gpu = H200) -> Estimate:
    """Predicted time of one launch of `plan` over `batch` inputs: its family's estimate (mappings/registry.py)."""
    return plan_family(plan).hook("estimate")(plan, batch, gpu)


def dense_estimate(m: int, k: int, n: int, dtype: str, batch: int = 1, gpu: Gpu = H200) -> float:
    """cuBLAS's time, roughly: the larger of its bytes at HBM speed and its FLOPs at the unit's rate
    (fp32 on CUDA cores, 16-bit on tensor cores), plus the launch. Only to tell whether dense is worth
    timing; the chooser measures it."""
    es = 4 if dtype == "float32" else 2
    flops = 2.0 * m * k * n * batch
    rate = 50e12 if dtype == "float32" else 600e12
    return gpu.launch_us + max((m * k + (k + m) * n * batch) * es / 4.0e12, flops / rate) * 1e6
