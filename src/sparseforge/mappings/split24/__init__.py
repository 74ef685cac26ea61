"""The split-24 composite (layout nk, float16 / bfloat16, large N): W as a 2:4 part on Sparse Tensor Cores
(cuSPARSELt, semi/) plus the nonzeros its 4-groups could not keep as a residual SpMM by another family:
plan.py (the split, plan, operand bytes), cost.py (the cost model's estimate), space.py (its candidates).
Nothing generated of its own, so no renderer."""
