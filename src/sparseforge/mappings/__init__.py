"""The kernel families (mappings of the SpMM and convolution work onto the GPU) and their registry
(registry.py): one record per family, asked by every dispatch point. A family's folder holds its own plan,
rendering, cost and design space; shared helpers (the PTX emitter, operands, the GPU table, plan utilities)
stay in plan/, codegen/ and tune/ where every family reaches them, and no family folder imports another."""
