"""Which part of the bitmap-tc kernel bounds it: the kernel with one part replaced by register moves (wrong
results, timing only), weights rotated, N = 8. python3 benchmarks/proto/bitmap_tc_probe.py VARIANT"""
import os
import re
import sys
import tempfile

os.environ["SPARSEFORGE_CACHE_DIR"] = tempfile.mkdtemp()
import torch  # noqa: E402

import sparseforge.mappings.bitmap_tc.render as R  # noqa: E402
from sparseforge import compile_spmm  # noqa: E402
from sparseforge.bench.gpu import _rotating_times  # noqa: E402
from sparseforge.codegen.ptx import KernelSource  # noqa: E402
from sparseforge.mappings.bitmap_tc.plan import BitmapTcConfig  # noqa: E402
from sparseforge.suite.llm import magnitude_prune, seeded_weight  # noqa: E402

variant = sys.argv[1]
original = R.render_bitmap_tc


def patched(plan):
    text = original(plan).modules[0]
    if "nolds" in variant:  # the values: a register move instead of each slot's 16-bit shared load
        text = re.sub(r"ld\.shared\.u16 (%v\d), \[%ad\];", r"mov.u32 \1, %ad;", text)
    if "nostarts" in variant:  # the word's stored start: a constant
        text = re.sub(r"ld\.shared\.u16 (%p\d), \[%sg\+\d+\];", r"mov.u32 \1, 64;", text)
    if "nob" in variant:  # B: constants instead of the 16-byte loads
        text = re.sub(r"@%pq ld\.global\.nc\.v4\.b32 \{([^}]*)\}, \[[^\]]*\];",
                      lambda m: " ".join(f"mov.b32 {r.strip()}, 15360;" for r in m[1].split(",")), text)
    if "bl1" in variant:  # B from one line of X (an L1 hit after the first): its loads' latency from L2 taken away
        text = re.sub(r"(@%pq ld\.global\.nc\.v4\.b32 \{[^}]*\}, )\[%rdy(\d+)\+\d+\];", r"\1[%rdx\2];", text)
    if "nocopy" in variant:  # the chunks: a shared store instead of the copy (wrong starts: reads past the buffer)
        text = text.replace("cp.async.cg.shared.global [%ad], [%rdt], 16;", "st.shared.b32 [%ad], %t;")
    return KernelSource(plan.name, (text,), 0)


R.render_bitmap_tc = patched
for shape, sparsity in (((14336, 4096), 0.5), ((14336, 4096), 0.9), ((4096, 4096), 0.7)):
    w = magnitude_prune(seeded_weight(*shape, seed=0), sparsity).astype("float16")
    for config in (BitmapTcConfig(8, 2, 4), BitmapTcConfig(4, 4), BitmapTcConfig(8, 2, 4, b_ahead=1)):
        kernel = compile_spmm(w, 8, torch.float16, "nk", config=config, tune_budget=None)
        t = _rotating_times(kernel, w.to_torch("cuda"), "nk", torch.float16, (8, shape[1]), 11)
        print(f"{variant:14s} {shape} {sparsity} {config.short()} sparse {t['sparseforge_rotating_us']:.2f} us "
              f"cublas {t['cublas_rotating_us']:.2f} us", flush=True)
