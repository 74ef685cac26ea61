"""The DLMC case suite: which matrices to benchmark, with their M, K, nnz and N."""
from .cases import DEFAULT_TOKENS, SAMPLE_DIR, Case, discover, read_batchsizes

__all__ = ["Case", "DEFAULT_TOKENS", "SAMPLE_DIR", "discover", "read_batchsizes"]
