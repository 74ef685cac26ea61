"""The delta-runs decode family (N = 1, 16-bit): a warp a row, each lane a run of the row's nonzeros as 8-bit
column gaps + values, 3 bytes a nonzero: plan.py (format, plan, CPU reference, operand bytes, densify),
render.py (the PTX), cost.py (the cost model's estimate), space.py (its candidates)."""
