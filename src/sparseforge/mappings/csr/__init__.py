"""The CSR families: W as data over padded CSR. csr: the small-N kernel (lanes over a row's nonzeros),
csr-staged (B in shared memory, persistent blocks) and their prefetching forms; csr-columns: a warp per row
with lanes across N (also the direct convolution's implicit-im2col kernel, plan/conv.py). plan.py (format,
plan, CPU reference, operand bytes), render.py (the PTX), cost.py (the cost model's estimates), space.py
(their candidates)."""
