"""The generated kernels (row groups): every nonzero an FMA with its value as an immediate, in any tiling
(row groups, row per block, split K, chunked runs, inline; nk staged or transposed; a convolution over its
zero-bordered input). Its plan (plan/plan.py Plan, plan/conv.py ConvTilePlan) and renderer (codegen/ptx.py)
are the shared ones every stage builds on; here: autotune.py and space.py (its candidates), cost.py (the cost
model's estimate and predicted compile)."""
