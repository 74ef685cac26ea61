"""The bitmap decode family (N = 1): W as a bitmap + packed values, the fewest bytes of W where the weight's
bytes bound the layer: plan.py (format, plan, CPU reference, operand bytes), render.py (the PTX), cost.py (the
cost model's estimate), space.py (its candidates)."""
