"""How much the masked ResNet-50 of model_rn50.py amplifies a small perturbation, in float64 on the CPU: the
floor under any half-precision run's error against float64. Perturbs the input by a relative 1e-4 and 1e-3,
and rounds the weights, folded statistics and input to fp16 while keeping float64 arithmetic.

    PYTHONPATH=src python benchmarks/rn50_conditioning.py PATTERN_DIR OUT.json
"""
import json
import sys
import time

import torch

from sparseforge.bench.report import provenance
from sparseforge.models import apply_dlmc_masks, calibrate_batchnorm, resnet50


def main(pattern_dir: str, out: str) -> int:
    started = time.perf_counter()
    model = resnet50(seed=0)  # as model_rn50.py builds it (seed, masks, calibration, input seed)
    apply_dlmc_masks(model, pattern_dir)
    calibrate_batchnorm(model, input_shape=(8, 3, 224, 224))
    model = model.double().eval()
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1)).double()
    generator = torch.Generator().manual_seed(2)
    result = {"provenance": provenance(sys.argv), "model": "rn50", "patterns": pattern_dir, "batch": 1}
    with torch.no_grad():
        reference = model(x)

        def rel(y):
            return float((y - reference).norm() / reference.norm())

        for eps in (1e-4, 1e-3):
            noise = torch.randn(x.shape, generator=generator, dtype=torch.float64)
            result[f"output_rel_change_at_input_rel_{eps:g}"] = rel(model(x + eps * noise * x.norm() / noise.norm()))
        for t in list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]:
            t.data = t.data.half().double()
        result["fp16_rounded_weights_and_input_float64_math"] = rel(model(x.half().double()))
    result["seconds"] = time.perf_counter() - started
    print(json.dumps({k: v for k, v in result.items() if k != "provenance"}, indent=1))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
