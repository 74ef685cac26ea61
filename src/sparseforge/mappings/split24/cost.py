"""The cost model's estimate of a split-24 plan (tune/cost.py holds the GPU table and dense_estimate)."""
from __future__ import annotations

from ...tune.cost import Estimate, Gpu, dense_estimate

# Sparse Tensor Cores against dense tensor cores on the same product. cuSPARSELt measured 1.2-1.5x over cuBLAS
# at N >= 2048 on Llama shapes (docs/history.md, fp16 / bf16), about 1x below N = 256.
SPARSE_TC_SPEEDUP = 1.3
# the residual R's product on CUDA cores: fp32 FMAs over R's nonzeros, at the rate the generated kernels reach
# on rn50 layers (~15-25 TFLOP/s of useful FMAs on the H200): a guess until designs.py has measured split-24
RESIDUAL_FLOPS = 20e12


def split24_estimate(plan, batch: int, gpu: Gpu) -> Estimate:
    """cuSPARSELt's 2:4 product (dense tensor cores' estimate over SPARSE_TC_SPEEDUP, never below its
    launch); where R has nonzeros, X's transposed copy (read and write) and R's pass over cuSPARSELt's M x N
    output D (read and write, R's FLOPs on CUDA cores, X^T's rows re-read from L2); then the copy of D into
    X's layout (N x M: read and write); each its own launch."""
    es = 2
    dense = dense_estimate(plan.M, plan.K, plan.N, plan.dtype, batch, gpu) - gpu.launch_us
    tensor = dense / SPARSE_TC_SPEEDUP
    transpose = 2 * plan.M * plan.N * batch * es / gpu.hbm_bytes_per_s * 1e6
    residual_nnz = plan.split.residual.nnz
    residual = 0.0
    if residual_nnz:
        x_copy = 2 * plan.K * plan.N * batch * es / gpu.hbm_bytes_per_s
        over_d = 2 * plan.M * plan.N * batch * es / gpu.hbm_bytes_per_s
        gathers = residual_nnz * plan.N * batch * es / gpu.l2_bytes_per_s
        residual = (x_copy + max(over_d + gathers, 2.0 * residual_nnz * plan.N * batch / RESIDUAL_FLOPS)) * 1e6
    launches = (4 if residual_nnz else 2) * gpu.launch_us
    terms = {"tensor": tensor, "transpose": transpose, "residual": residual, "launches": launches}
    return Estimate(launches + tensor + transpose + residual, terms, 0.3 if residual_nnz else 0.0)
