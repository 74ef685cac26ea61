"""The bitmap-tc family (float16 / bfloat16, N = 1..16): W as bitmap tiles (formats/bitmap_tiles.py) decoded
in registers into mma.m16n8k16 A fragments: plan.py (plan, CPU reference, operand bytes), render.py (the
PTX), cost.py (the cost model's estimate), space.py (its candidates)."""
