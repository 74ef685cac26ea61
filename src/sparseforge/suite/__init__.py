"""The case suite: which matrices to benchmark (DLMC files, LLM layers), with their M, K, nnz and N."""
from .cases import DEFAULT_TOKENS, SAMPLE_DIR, Case, discover, read_batchsizes
from .llm import LINEAR_SHAPES, LLM_DEFAULT_TOKENS, LLMCase, llm_cases, magnitude_prune, parse_llm_spec

__all__ = ["Case", "DEFAULT_TOKENS", "LINEAR_SHAPES", "LLMCase", "LLM_DEFAULT_TOKENS", "SAMPLE_DIR", "discover",
           "llm_cases", "magnitude_prune", "parse_llm_spec", "read_batchsizes"]
