"""Bytes a weight of each decode format as built (CPU): delta-runs with 8- and 4-bit gaps and bitmap tiles, per
Linear shape, sparsity and pruning method (global magnitude, or Wanda's per-row masks with skewed columns), every
array a kernel reads counted (values in the 16-bit dtype, gaps, bitmaps, offsets, start tables, padding).
Decode is memory-bound, so these bytes are what a kernel's speed is bounded by and what a converted model holds;
the masks' method shows whether a format's size depends on how the pruning spread the nonzeros.
Usage: python benchmarks/format_bytes.py OUT.json [LLM_SPEC ...]   (default: llm:0.5,0.7,0.9 on Llama and Qwen2
shapes, both methods)"""
import json
import sys
import time

from sparseforge.bench.report import provenance
from sparseforge.mappings.bitmap_tc.plan import BitmapTcConfig, make_bitmap_tc_plan
from sparseforge.mappings.delta_runs.plan import DeltaRunsConfig, make_delta_runs_plan
from sparseforge.suite import discover

DEFAULT_SPECS = ("llm:0.5,0.7,0.9:llama_4096x4096,llama_1024x4096,llama_4096x14336,qwen2_3584x3584,qwen2_512x3584:"
                 "magnitude,wanda",)
DTYPE = "float16"
# (name, plan maker): bitmap tiles are the same arrays at every width; N = 8 is a width its kernels take
FORMATS = (("delta-runs 8-bit gaps", lambda w: make_delta_runs_plan(w, 1, DTYPE, "nk", DeltaRunsConfig())),
           ("delta-runs 4-bit gaps", lambda w: make_delta_runs_plan(w, 1, DTYPE, "nk", DeltaRunsConfig(gap_bits=4))),
           ("bitmap tiles", lambda w: make_bitmap_tc_plan(w, 8, DTYPE, "nk", BitmapTcConfig())))
VALUE_BYTES = 2  # the plans keep values in float64 for the CPU executor; the device holds them in 16 bits


def format_bytes(plan) -> int:
    """All bytes of W's arrays on the device."""
    return sum(a.size * VALUE_BYTES if kind == "values" else a.nbytes for a, kind in plan.weight_arrays())


def main(out: str, specs) -> None:
    records = []
    for spec in specs:
        for case in discover(spec, n=1):
            w = case.load(seed=0, dtype=DTYPE)
            weights = case.M * case.K
            for name, make in FORMATS:
                started = time.perf_counter()
                total = format_bytes(make(w))
                records.append({"case": case.name, "model": case.model, "method": case.method, "layer": case.layer,
                                "sparsity": case.sparsity, "dtype": DTYPE, "M": case.M, "K": case.K, "nnz": w.nnz,
                                "format": name, "bytes_per_weight": total / weights,
                                # what the format adds to the nonzeros' own 16-bit values: gaps and fillers,
                                # or bitmaps, start tables, offsets and padding
                                "beyond_values_bytes_per_weight": (total - VALUE_BYTES * w.nnz) / weights,
                                "fewer_bytes_than_dense": VALUE_BYTES * weights / total,
                                "pack_seconds": time.perf_counter() - started})
                print(f"{case.name:50s} {name:22s} {total / weights:.4f} B/weight", flush=True)
            with open(out, "w") as f:  # after every case: a cut run keeps what it measured
                json.dump({"provenance": provenance(sys.argv), "cases": records}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:] or DEFAULT_SPECS)
