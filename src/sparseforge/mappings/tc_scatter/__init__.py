"""The tc-scatter family (float16 / bfloat16, small N): W's nonzeros scattered into dense 16 x 16 tiles for
the tensor cores (mma.m16n8k16): plan.py (the scatter format, plan, CPU reference, operand bytes), render.py
(the PTX), cost.py (the cost model's estimate), space.py (its candidates)."""
